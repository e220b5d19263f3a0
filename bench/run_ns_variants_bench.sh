#!/usr/bin/env bash
# Turbo-Muon's AOL preconditioning (4 steps, the `aol` set) against the Frobenius scaling (5 steps,
# the `simple` and `polar_express` sets) with muond's ns_bench, on 1024x2752 and 4096x4096: the time
# of one Newton–Schulz call and the orthogonality residual of its output (docs/algorithms.md,
# Telemetry), with the time ratio against Frobenius + simple (above 1: AOL is faster).
#
#   bench/run_ns_variants_bench.sh [--cpu] [--build DIR] [--reps N] [--shapes 1024x2752,4096x4096]
#
# Default: the GPU (muond's CUDA backend, bf16 GEMMs). --cpu: the CPU backend in fp32.
set -euo pipefail

BUILD=build
BACKEND=cuda
REPS=5
SHAPES=1024x2752,4096x4096
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cpu) BACKEND=cpu ;;
    --build) BUILD=$2; shift ;;
    --reps) REPS=$2; shift ;;
    --shapes) SHAPES=$2; shift ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

run() {  # preconditioner coefficients steps
  "$BUILD/ns_bench" --backend "$BACKEND" --json --warmup 1 --reps "$REPS" --shapes "$SHAPES" \
    --preconditioner "$1" --coefficients "$2" --steps "$3"
}

ROWS=$(run frobenius simple 5; run frobenius polar_express 5; run aol aol 4)
ROWS="$ROWS" python3 - <<'PY'
import json
import os

rows = [json.loads(line) for line in os.environ["ROWS"].splitlines() if line.startswith("{")]
base = {r["shape"]: r["ms"] for r in rows if r["preconditioner"] == "frobenius" and r["coefficients"] == "simple"}
print("Newton-Schulz variants on %s (%s GEMMs)" % (rows[0]["backend"], rows[0]["precision"]))
print("%-12s %-28s %9s %9s %20s" % ("shape", "variant", "ms/call", "residual", "vs frobenius simple"))
for r in sorted(rows, key=lambda r: r["shape"]):
    name = "%s %s x%d" % (r["preconditioner"], r["coefficients"], r["steps"])
    print("%-12s %-28s %9.2f %9.4f %19.2fx" % (r["shape"], name, r["ms"], r["residual"], base[r["shape"]] / r["ms"]))
PY
