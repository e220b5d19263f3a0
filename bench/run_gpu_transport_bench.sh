#!/usr/bin/env bash
# Runs gpu_transport_bench.py: the step exchange of CUDA parameters over cuda_ipc, nccl (with two
# GPUs), shm and grpc, each against muond --backend cuda (which the script starts), next to a
# device-to-device copy of the same bytes. Needs a CUDA GPU and a build with the CUDA backend.
#
#   bench/run_gpu_transport_bench.sh [--build DIR] [gpu_transport_bench flags, e.g. --sizes-m 1 16 64 --steps 20]
set -euo pipefail
BUILD=build
if [[ ${1:-} == --build ]]; then BUILD=$2; shift 2; fi
HERE=$(cd "$(dirname "$0")" && pwd)
MUOND=
for candidate in "$BUILD/muond" "$BUILD/bin/muond"; do [[ -x $candidate ]] && MUOND=$candidate && break; done
[[ -n $MUOND ]] || { echo "cannot find muond under $BUILD (cmake --build $BUILD --target muond)" >&2; exit 1; }
PYTHON=${PYTHON:-python3}
# A PYTHONPATH given (a bundle's package with its stubs) comes first.
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$HERE/../python:$BUILD/python"
exec "$PYTHON" "$HERE/gpu_transport_bench.py" --binary "$MUOND" "$@"
