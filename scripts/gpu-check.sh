#!/usr/bin/env bash
# Every GPU check of muond in one go, for a machine with an NVIDIA GPU that has the CUDA runtime,
# torch and grpcio but none of the libraries muond builds against. Two halves:
#
#   scripts/gpu-check.sh bundle [BUILD]   on the build machine: packs into .gpu/ the daemon and its
#                                         CUDA library, the GPU test binaries, the benchmarks, the
#                                         Python package (with its generated stubs) and its tests,
#                                         through the bundler named by $GPU_BUNDLE (default
#                                         ../shared/tools/gpu-bundle.sh); large libraries are
#                                         xz-compressed so the bundle travels in one piece.
#   scripts/gpu-check.sh run [OUT]        on the GPU machine, from the repository root: unpacks
#                                         .gpu/, then runs, each into its own log under OUT
#                                         (default gpu-check-out): the CUDA backend tests and the
#                                         conformance suite, the GPU daemon test, the CUDA IPC and
#                                         NCCL primitives and the C++ client's CUDA IPC steps, the
#                                         Python SDK tests against a --backend cuda daemon (GPU
#                                         transports included), and the benchmarks with torch
#                                         beside them (the GPU transports' too). Every step runs even
#                                         when an earlier one fails; the summary lists each exit
#                                         status, and the script exits 1 if any failed.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
GPU_DIR="$ROOT/.gpu"

bundle() {
  local build=${1:-$ROOT/build}
  local bundler=${GPU_BUNDLE:-$ROOT/../shared/tools/gpu-bundle.sh}
  [[ -x $bundler ]] || { echo "gpu-check: no bundler at $bundler (set GPU_BUNDLE)" >&2; exit 2; }
  local programs=(muond libmuond_cuda.so cuda_backend_test backend_conformance_test integration_test
                  cuda_peer_test cuda_ipc_integration_test ns_bench step_bench elementwise_bench)
  local files=()
  for p in "${programs[@]}"; do
    [[ -e $build/$p ]] || { echo "gpu-check: $build/$p is missing: build it first (cmake --build $build)" >&2; exit 2; }
    files+=("$build/$p")
  done
  rm -rf "$GPU_DIR"
  "$bundler" "$GPU_DIR" "${files[@]}" || exit 2
  mkdir -p "$GPU_DIR/python"
  cp -r "$ROOT/python/muond" "$GPU_DIR/python/"
  [[ -d $build/python ]] && cp -r "$build/python/." "$GPU_DIR/python/"
  # pytest travels too (pure Python, from this machine's python3), in case the GPU machine lacks it.
  mkdir -p "$GPU_DIR/pytest"
  /usr/bin/python3 - "$GPU_DIR/pytest" <<'PY' || { echo "gpu-check: pytest not found for /usr/bin/python3" >&2; exit 2; }
import os, shutil, sys
import _pytest, iniconfig, packaging, pluggy, py, pytest
for module in (pytest, _pytest, pluggy, iniconfig, packaging, py):
    source = os.path.dirname(module.__file__)
    shutil.copytree(source, os.path.join(sys.argv[1], os.path.basename(source)),
                    ignore=shutil.ignore_patterns("__pycache__"))
PY
  # Libraries over 4 MiB (OpenBLAS, gRPC) travel compressed; `run` unpacks them.
  find "$GPU_DIR/lib" -type f -size +4M -exec xz -T0 -6 {} \;
  du -sh "$GPU_DIR" | awk '{print "gpu-check: bundle " $1 " in " $2}'
}

run() {
  local out=${1:-$ROOT/gpu-check-out}
  mkdir -p "$out"
  [[ -d $GPU_DIR ]] || { echo "gpu-check: no $GPU_DIR: run 'scripts/gpu-check.sh bundle' on the build machine" >&2; exit 2; }
  find "$GPU_DIR/lib" -name '*.xz' -exec xz -d -f {} \;
  # shellcheck disable=SC1091
  source "$GPU_DIR/env.sh"
  export MUOND_BINARY="$GPU_DIR/bin/muond"
  local python=${PYTHON:-python3}
  local summary="$out/summary.txt"
  : >"$summary"
  step() {  # step NAME LOG COMMAND...: runs it, appends its exit status to the summary
    local name=$1 log=$2; shift 2
    echo "== $name" | tee -a "$out/$log"
    "$@" >>"$out/$log" 2>&1
    local rc=$?
    printf '%-28s exit %d (%s)\n' "$name" "$rc" "$log" | tee -a "$summary"
  }
  step device device.log nvidia-smi
  step cuda-backend-tests kernels.log "$GPU_DIR/bin/cuda_backend_test" --gtest_brief=1
  step conformance kernels.log "$GPU_DIR/bin/backend_conformance_test" --gtest_brief=1
  step gpu-daemon daemon.log "$GPU_DIR/bin/integration_test" --gtest_filter='*GpuDaemon*'
  step cuda-peer kernels.log "$GPU_DIR/bin/cuda_peer_test" --gtest_brief=1
  step cuda-ipc-client daemon.log "$GPU_DIR/bin/cuda_ipc_integration_test"
  # The carried pytest comes last on the path: the machine's own is used when it has one.
  step python-sdk-cuda python.log env MUOND_TEST_BACKEND=cuda PYTHONPATH="$GPU_DIR/python:$GPU_DIR/pytest" \
    "$python" -m pytest "$ROOT/tests/python" -q -p no:cacheprovider -m "not ops"
  step ns-bench bench.log "$ROOT/bench/run_ns_bench.sh" --build "$GPU_DIR/bin"
  step elementwise-fp32 bench.log "$GPU_DIR/bin/elementwise_bench" --backend cuda
  step elementwise-bf16 bench.log "$GPU_DIR/bin/elementwise_bench" --backend cuda --state-dtype bf16
  step gpu-transport-bench bench.log env PYTHONPATH="$GPU_DIR/python" PYTHON="$python" \
    "$ROOT/bench/run_gpu_transport_bench.sh" --build "$GPU_DIR/bin"
  ! grep -q 'exit [1-9]' "$summary"
}

case "${1:-}" in
  bundle) shift; bundle "$@" ;;
  run) shift; run "$@" ;;
  *) sed -n '2,20p' "$0"; exit 2 ;;
esac
