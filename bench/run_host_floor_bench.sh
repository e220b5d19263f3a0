#!/usr/bin/env bash
# The host step beside its floors, in one run: shared-memory steps against their copy floor
# (shm_floor_bench.py), many small tensors over gRPC against raw TCP (small_tensors_bench.py), the
# fixed cost of tiny steps against one gRPC round trip (step_overhead_bench.py),
# Newton-Schulz in fp32 and bf16 against the GEMM peaks of the same libraries (cpu_precision_bench),
# Gram against standard Newton-Schulz and ns_algorithm auto's choice per shape (ns_choice_bench),
# and a Muon session's memory above idle against its state, bounded and not (ns_memory_bench.py).
#
#   bench/run_host_floor_bench.sh [--build DIR] [--threads N]
#
# Needs a build with the benchmarks (cmake --build build). PYTHON picks the interpreter with torch
# (default python3). Run it on a quiet machine: every figure is a time.
set -euo pipefail

BUILD=build
THREADS=2
PYTHON=${PYTHON:-python3}
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) BUILD=$2; shift ;;
    --threads) THREADS=$2; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
cd "$(dirname "${BASH_SOURCE[0]}")/.."
echo "== $(uname -m), $(nproc) CPUs: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "== shared memory against its copy floor"
"$PYTHON" bench/shm_floor_bench.py --binary "$BUILD/muond" --threads "$THREADS" --phases
echo "== many small tensors over gRPC against raw TCP"
"$PYTHON" bench/small_tensors_bench.py --binary "$BUILD/muond" --threads "$THREADS"
echo "== the fixed cost of a step against one gRPC round trip"
"$PYTHON" bench/step_overhead_bench.py --binary "$BUILD/muond" --tensors 8
"$PYTHON" bench/step_overhead_bench.py --binary "$BUILD/muond" --tensors 64
if [[ -x $BUILD/cpu_precision_bench ]]; then
  echo "== Newton-Schulz in fp32 and bf16 against the GEMM peaks"
  "$BUILD/cpu_precision_bench" --threads "$THREADS"
else
  echo "== cpu_precision_bench was not built (no oneDNN): bf16 figures skipped"
fi
echo "== Gram against standard Newton-Schulz, and ns_algorithm auto's choice"
"$BUILD/ns_choice_bench" --backend cpu --threads "$THREADS"
echo "== a Muon session's memory above idle against its state"
"$PYTHON" bench/ns_memory_bench.py --binary "$BUILD/muond" --threads "$THREADS"
echo "== load at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
