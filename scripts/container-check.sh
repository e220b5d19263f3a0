#!/usr/bin/env bash
# Builds the CPU image (docker/Dockerfile.cpu) with podman and smoke-tests it, with no image registry:
# the Debian 12 base image is made from Debian's packages (debootstrap bookworm into a folder, then
# `podman import`), the build runs with --isolation chroot, and containers run under runc with a
# containers.conf that sets no default ulimits. Needs root (rootful podman) and the network access
# apt already has.
#
# The smoke test: the container starts the daemon; `muondctl health` inside the container answers
# SERVING; the image's HEALTHCHECK passes (images are built in Docker's format, which keeps
# HEALTHCHECK); a trainer on the host (examples/mlp_trainer, from build/) trains through the container
# over loopback (the container shares the host's network, so it picks shared memory); its Prometheus
# endpoint counts the steps; SIGTERM stops it cleanly with its state checkpointed.
#
#   scripts/container-check.sh              (MUOND_CONTAINER_WORK: where the base rootfs goes)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${MUOND_BUILD_DIR:-$root/build}
work=${MUOND_CONTAINER_WORK:-/var/tmp/muond-container}
base=localhost/muond-debian:12
image=localhost/muond:0.1.0-cpu
name=muond-check-$$

if [ "$(id -u)" -ne 0 ]; then
  echo "container-check: run as root (rootful podman)" >&2
  exit 2
fi
"$root/scripts/setup.sh" containers
if [ ! -x "$build/mlp_trainer" ] || [ ! -x "$build/muondctl" ]; then
  "$root/scripts/build.sh"
fi

mkdir -p "$work"
export CONTAINERS_CONF="$work/containers.conf"
cat >"$CONTAINERS_CONF" <<'EOF'
[containers]
default_ulimits = []
EOF
podman=(podman --runtime runc)

step() { echo "container-check: $*"; }

if ! "${podman[@]}" image exists "$base"; then
  step "making the Debian 12 base image with debootstrap (once)"
  rm -rf "$work/rootfs"
  debootstrap --variant=minbase bookworm "$work/rootfs" http://deb.debian.org/debian >"$work/debootstrap.log" 2>&1 ||
    { tail -n 30 "$work/debootstrap.log"; exit 1; }
  tar -C "$work/rootfs" -c . | "${podman[@]}" import - "$base" >/dev/null
  rm -rf "$work/rootfs"
fi

step "building $image from docker/Dockerfile.cpu (log: $work/build.log)"
start=$SECONDS
if ! "${podman[@]}" build --format docker --isolation chroot --network host -f "$root/docker/Dockerfile.cpu" \
     --build-arg BASE="$base" -t "$image" "$root" >"$work/build.log" 2>&1; then
  tail -n 40 "$work/build.log"
  exit 1
fi
step "built in $((SECONDS - start)) s; image size $("${podman[@]}" image inspect "$image" --format '{{.Size}}') bytes"

port=$((20000 + RANDOM % 20000))
metrics_port=$((port + 1))
cleanup() { "${podman[@]}" rm -f "$name" >/dev/null 2>&1 || true; }
trap cleanup EXIT
"${podman[@]}" run -d --name "$name" --network host \
  -e MUOND_LISTEN="127.0.0.1:$port" -e MUOND_METRICS_LISTEN="127.0.0.1:$metrics_port" \
  -e MUOND_LOG_FORMAT=text "$image" >/dev/null

step "waiting for the daemon in the container to serve"
ok=0
for _ in $(seq 1 120); do
  if "${podman[@]}" exec "$name" muondctl --endpoint "127.0.0.1:$port" --timeout 1 health >/dev/null 2>&1; then
    ok=1
    break
  fi
  if [ "$("${podman[@]}" inspect "$name" --format '{{.State.Running}}')" != true ]; then break; fi
done
if [ $ok != 1 ]; then
  "${podman[@]}" logs "$name" | tail -n 30
  echo "container-check: FAILED: the daemon never served" >&2
  exit 1
fi
step "muondctl health in the container: $("${podman[@]}" exec "$name" muondctl --endpoint "127.0.0.1:$port" health)"
"${podman[@]}" exec "$name" id
if ! "${podman[@]}" healthcheck run "$name"; then
  echo "container-check: FAILED: the image's HEALTHCHECK does not pass" >&2
  exit 1
fi
step "HEALTHCHECK: healthy"

step "training from the host through the container"
"$build/mlp_trainer" --endpoint "127.0.0.1:$port" --session container-check --steps 5 | tail -n 3
"$build/muondctl" --endpoint "127.0.0.1:$port" info
applied=$(curl -fsS "http://127.0.0.1:$metrics_port/metrics" |
  awk '/^muond_steps_total\{outcome="applied",/ { n += $2 } END { print n }')
step "muond_steps_total{outcome=\"applied\"} summed over transports = $applied"
[ "$applied" = 5 ] || { echo "container-check: FAILED: expected 5 applied steps" >&2; exit 1; }

"${podman[@]}" stop -t 60 "$name" >/dev/null
code=$("${podman[@]}" inspect "$name" --format '{{.State.ExitCode}}')
"${podman[@]}" logs "$name" 2>&1 | tail -n 3
[ "$code" = 0 ] || { echo "container-check: FAILED: the daemon exited $code on SIGTERM" >&2; exit 1; }
step "PASSED"
