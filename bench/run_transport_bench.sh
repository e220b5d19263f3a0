#!/usr/bin/env bash
# Starts muond (--backend cpu) on a free loopback port and runs transport_bench against it: one step
# exchange per size over gRPC and shared memory, next to a raw loopback TCP echo and memcpy.
#
#   bench/run_transport_bench.sh [--build DIR] [transport_bench flags, e.g. --sizes-mb 8 64 --reps 3]
set -euo pipefail
BUILD=build
if [[ ${1:-} == --build ]]; then BUILD=$2; shift 2; fi
for tool in muond transport_bench; do
  found=
  for candidate in "$BUILD/$tool" "$BUILD/bench/$tool"; do [[ -x $candidate ]] && found=$candidate && break; done
  [[ -n $found ]] || { echo "cannot find $tool under $BUILD (cmake --build $BUILD --target $tool)" >&2; exit 1; }
  declare "${tool^^}=$found"
done
DIR=$(mktemp -d)
"$MUOND" --backend cpu --listen 127.0.0.1:0 --port-file "$DIR/port" --log-level warn &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null; rm -rf "$DIR"' EXIT
for _ in $(seq 1 600); do [[ -s $DIR/port ]] && break; kill -0 $PID || exit 1; sleep 0.1; done
"$TRANSPORT_BENCH" --endpoint "127.0.0.1:$(cat "$DIR/port")" --daemon-pid "$PID" "$@"
