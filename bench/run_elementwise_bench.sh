#!/usr/bin/env bash
# Runs the torch peer (elementwise_torch.py) and muond's elementwise_bench one after the other on
# this machine's CPU and prints, per optimizer and size, muond's Gparam/s, torch's (plain and
# foreach), muond/torch against torch's faster variant, and muond's bytes per second against the
# triad's (the bandwidth limit, measured in the same run).
#
#   bench/run_elementwise_bench.sh [--build DIR] [--threads N] [--reps N] [--params N ...]
#
# PYTHON picks the interpreter with torch (default python3). Targets (README, CPU performance):
# muond/torch >= 1.5 and >= 70% of the triad.
set -euo pipefail

BUILD=build
THREADS=0
REPS=10
PARAMS=(16000000 64000000)
PYTHON=${PYTHON:-python3}
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) BUILD=$2; shift ;;
    --threads) THREADS=$2; shift ;;
    --reps) REPS=$2; shift ;;
    --params) PARAMS=(); while [[ $# -gt 1 && $2 =~ ^[0-9]+$ ]]; do PARAMS+=("$2"); shift; done ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

HERE=$(cd "$(dirname "$0")" && pwd)
BENCH=
for candidate in "$BUILD/elementwise_bench" "$BUILD/bench/elementwise_bench"; do
  if [[ -x $candidate ]]; then BENCH=$candidate; break; fi
done
if [[ -z $BENCH ]]; then
  echo "cannot find elementwise_bench under $BUILD (cmake --build $BUILD --target elementwise_bench)" >&2
  exit 1
fi

OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
echo "torch ($PYTHON)..." >&2
"$PYTHON" "$HERE/elementwise_torch.py" --threads "$THREADS" --reps "$REPS" --params "${PARAMS[@]}" --json > "$OUT/torch.jsonl"
echo "muond elementwise_bench..." >&2
"$BENCH" --backend cpu --threads "$THREADS" --reps "$REPS" --params "${PARAMS[@]}" --json > "$OUT/muond.jsonl"

"$PYTHON" - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def load(name):
    with open(f"{out}/{name}") as f:
        return [json.loads(line) for line in f if line.startswith("{")]
torch_rows, muond_rows = load("torch.jsonl"), load("muond.jsonl")
triad = {r["params"]: r for r in muond_rows if r["bench"] == "triad"}
print(f"{'step':<7} {'params':>10} {'muond':>8} {'torch':>8} {'torch':>8} {'muond/':>7} "
      f"{'muond':>7} {'triad':>7} {'muond/':>7}")
print(f"{'':<7} {'':>10} {'Gp/s':>8} {'plain':>8} {'foreach':>8} {'torch':>7} "
      f"{'GB/s':>7} {'GB/s':>7} {'triad':>7}")
for r in (r for r in muond_rows if r["bench"] == "step"):
    peers = {t["variant"]: t["gparams"] for t in torch_rows
             if t["optimizer"] == r["optimizer"] and t["params"] == r["params"]}
    best = max(peers.values())
    bw = triad[r["params"]]["gbps"]
    print(f"{r['optimizer']:<7} {r['params']:>10} {r['gparams']:>8.3f} {peers.get('plain', 0):>8.3f} "
          f"{peers.get('foreach', 0):>8.3f} {r['gparams'] / best:>7.2f} {r['gbps']:>7.1f} {bw:>7.1f} "
          f"{r['gbps'] / bw:>7.0%}")
print(f"\nthreads: {triad[next(iter(triad))]['threads']}; bytes per parameter: adamw 28, lion 20, sgd 20 "
      "(STREAM's count: reads + writes, no write-allocate)")
PY
