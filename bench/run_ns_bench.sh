#!/usr/bin/env bash
# Runs the torch peer (ns_throughput.py) and muond's benchmarks (ns_bench, step_bench) one after
# another on this machine and prints them side by side with the ratio.
#
#   bench/run_ns_bench.sh [--cpu] [--quick] [--precision bf16|fp32] [--build DIR] [--threads N] [--reps N]
#
# Default: the GPU (torch on cuda in bf16, muond's CUDA backend with bf16 GEMMs). --cpu compares
# torch on the CPU in fp32 with muond's CPU backend (fp32); --precision sets both sides' GEMM dtype
# (e.g. fp32 on the GPU); --threads sets both sides' CPU threads (on a shared or small machine 1
# gives the steadiest figures). --quick uses the small shapes.
# PYTHON picks the interpreter with torch (default python3). Ratios are muond/torch throughput:
# above 1 muond is faster.
set -euo pipefail

BUILD=build
DEVICE=cuda
QUICK=()
THREADS=0
REPS=()
PRECISION=()
TORCH_DTYPE=()
PYTHON=${PYTHON:-python3}
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cpu) DEVICE=cpu ;;
    --quick) QUICK=(--quick) ;;
    --build) BUILD=$2; shift ;;
    --threads) THREADS=$2; shift ;;
    --reps) REPS=(--reps "$2"); shift ;;
    --precision)
      [[ $2 == bf16 || $2 == fp32 ]] || { echo "--precision: bf16 or fp32, got $2" >&2; exit 2; }
      PRECISION=(--precision "$2"); TORCH_DTYPE=(--dtype "$2"); shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

HERE=$(cd "$(dirname "$0")" && pwd)
find_binary() {
  for candidate in "$BUILD/$1" "$BUILD/bench/$1"; do
    if [[ -x $candidate ]]; then echo "$candidate"; return; fi
  done
  echo "cannot find $1 under $BUILD (build it: cmake --build $BUILD --target $1)" >&2
  exit 1
}
NS_BENCH=$(find_binary ns_bench)
STEP_BENCH=$(find_binary step_bench)
# On the CPU both sides run OpenBLAS's GEMMs (torch through Debian's build): the kernels the daemon
# runs (docs/operations.md, OpenBLAS's kernels), unless OPENBLAS_CORETYPE chose.
if [[ $DEVICE == cpu && -z ${OPENBLAS_CORETYPE:-} && -x $BUILD/muond ]]; then
  OPENBLAS_CORETYPE=$("$BUILD/muond" --print-blas-kernel) && export OPENBLAS_CORETYPE
  echo "OpenBLAS kernels for both sides: $OPENBLAS_CORETYPE" >&2
fi

OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
echo "torch ($PYTHON, $DEVICE)..." >&2
"$PYTHON" "$HERE/ns_throughput.py" --device "$DEVICE" --threads "$THREADS" --json "${QUICK[@]}" \
  "${REPS[@]}" "${TORCH_DTYPE[@]}" > "$OUT/torch.jsonl"
echo "muond ns_bench..." >&2
"$NS_BENCH" --backend "$DEVICE" --threads "$THREADS" --json "${QUICK[@]}" "${REPS[@]}" "${PRECISION[@]}" \
  > "$OUT/muond.jsonl"
echo "muond step_bench..." >&2
"$STEP_BENCH" --backend "$DEVICE" --threads "$THREADS" --json "${QUICK[@]}" >> "$OUT/muond.jsonl"

"$PYTHON" - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
def load(name):
    with open(f"{out}/{name}") as f:
        return [json.loads(line) for line in f if line.startswith("{")]
torch_rows, muond_rows = load("torch.jsonl"), load("muond.jsonl")
t_ns = {r["shape"]: r for r in torch_rows if r["bench"] == "ns"}
m_ns = [r for r in muond_rows if r["bench"] == "ns"]
if m_ns:
    first = m_ns[0]
    tdtype = next(iter(t_ns.values()))["dtype"] if t_ns else "?"
    print(f"Newton-Schulz, 5 steps: torch {tdtype} vs muond {first['backend']} {first['precision']} GEMMs")
    print(f"{'shape':<20} {'torch TFLOP/s':>14} {'muond TFLOP/s':>14} {'muond/torch':>12}")
    for r in m_ns:
        t = t_ns.get(r["shape"])
        tt = t["tflops"] if t else float("nan")
        print(f"{r['shape']:<20} {tt:14.3f} {r['tflops']:14.3f} {r['tflops'] / tt:12.2f}")
t_step = [r for r in torch_rows if r["bench"] == "step"]
m_step = [r for r in muond_rows if r["bench"] == "step"]
if t_step and m_step:
    t, m = t_step[0], m_step[0]
    print(f"\nWhole step, {m['model']} ({m['params']:,} params, {m['muon_params']:,} in Muon), median:")
    print(f"  torch Muon+AdamW: {t['ms_median']:.3f} ms   muond: {m['ms_median']:.3f} ms   "
          f"muond/torch throughput: {t['ms_median'] / m['ms_median']:.2f}")
EOF
