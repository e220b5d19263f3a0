#!/usr/bin/env bash
# The main job, end to end: installs dependencies, builds muond, starts the daemon on 127.0.0.1 with
# the embedded CPU backend, trains through it, and stops it.
#   1. examples/mlp_trainer (C++): a two-layer MLP, forward and backward written out;
#   2. examples/train_gpt.py (PyTorch): a small character-level transformer with muond.RemoteOptimizer.
# Environment: DEMO_STEPS (transformer steps, default 200).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${MUOND_BUILD_DIR:-$root/build}
# Only what the demo runs: the daemon, the C++ example, the Python stubs and the client's streaming
# copy (scripts/test.sh builds the rest).
MUOND_BUILD_TARGETS="muond mlp_trainer muond_python_stubs muond_stream_copy" "$root/scripts/build.sh"

port_file=$(mktemp)
rm -f "$port_file"
# The daemon writes its log to a file, so that nothing but the trainers writes to this terminal (their
# progress bars stay whole); its warnings, if any, are summarized at the end.
log=${MUOND_DEMO_LOG:-$build/demo/muond.log}
mkdir -p "$(dirname "$log")"
"$build/muond" --listen 127.0.0.1:0 --port-file "$port_file" --backend cpu --log-level info --log-format json \
  >"$log" 2>&1 &
daemon=$!
summarize() {
  kill -TERM $daemon 2>/dev/null
  wait $daemon 2>/dev/null || true
  rm -f "$port_file"
  echo
  /usr/bin/python3 "$root/scripts/log_summary.py" "$log"
}
trap summarize EXIT
for _ in $(seq 200); do [ -s "$port_file" ] && break; sleep 0.05; done
[ -s "$port_file" ] || { echo "demo: muond did not start; its log ($log):" >&2; tail -20 "$log" >&2; exit 1; }
endpoint=127.0.0.1:$(cat "$port_file")
echo "muond runs at $endpoint with the CPU backend; its log: $log"
# The transformer's torch loads the same OpenBLAS as the daemon, which on a CPU newer than it knows
# falls back to SSE3 kernels: it takes the kernels the daemon runs (docs/operations.md, "OpenBLAS's
# kernels") unless OPENBLAS_CORETYPE was given.
if [ -z "${OPENBLAS_CORETYPE:-}" ]; then
  OPENBLAS_CORETYPE=$("$build/muond" --print-blas-kernel) && export OPENBLAS_CORETYPE
fi

echo "== C++ trainer: two-layer MLP through muond at $endpoint"
"$build/mlp_trainer" --endpoint "$endpoint" --steps 150 | awk 'NR <= 3 || /^step/ && ($2 % 25 == 0) || /->/'

echo
echo "== PyTorch trainer: character-level transformer through muond at $endpoint"
PYTHONPATH="$build/python:$root/python${PYTHONPATH:+:$PYTHONPATH}" \
  /usr/bin/python3 "$root/examples/train_gpt.py" --endpoint "$endpoint" --steps "${DEMO_STEPS:-200}"
