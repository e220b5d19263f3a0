#!/usr/bin/env bash
# Installs every build and test dependency of muond from Debian packages. Idempotent: packages that are
# already present are left alone, and apt is not touched at all when nothing is missing.
set -euo pipefail

packages=(
  build-essential cmake pkg-config git clang libclang-rt-14-dev clang-format
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libabsl-dev libspdlog-dev libfmt-dev libopenblas-dev liblapacke-dev libdnnl-dev
  libcli11-dev libcpp-httplib-dev nlohmann-json3-dev libssl-dev zlib1g-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3 python3-torch python3-grpcio python3-grpc-tools python3-protobuf python3-pytest python3-numpy
  python3-tqdm python3-pip
  openssl util-linux
  prometheus curl python3-yaml python3-wheel python3-setuptools systemd tmux
)

# `scripts/setup.sh containers` also installs what scripts/container-check.sh needs.
if [[ ${1:-} == containers ]]; then
  packages+=(podman runc debootstrap)
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages present"
  exit 0
fi

echo "setup: installing ${missing[*]}"
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
