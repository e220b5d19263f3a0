#!/usr/bin/env bash
# Every GPU check of muond, for a machine with an NVIDIA GPU that has the CUDA runtime, torch and
# grpcio but none of the libraries muond builds against. Two halves:
#
#   scripts/gpu-check.sh bundle [BUILD]      on the build machine: packs into .gpu/ the daemon and its
#                                            CUDA library, the GPU test binaries, the benchmarks and
#                                            the Python package (with its generated stubs), through
#                                            the bundler named by $GPU_BUNDLE (default
#                                            ../shared/tools/gpu-bundle.sh); libraries over 1 MiB are
#                                            xz-compressed. Refuses a bundle over 60 MiB.
#   scripts/gpu-check.sh run PHASE [OUT]     on the GPU machine, from the repository root, one phase
#                                            per call so that each fits well under ten minutes:
#       probe    the environment: GPU, driver, compute mode, `ldd` of every carried binary, the
#                versions of torch, its CUDA and NCCL, grpcio, protobuf and pytest, and an import of
#                the generated stubs
#       cpp      the CUDA backend tests, the conformance suite, the CUDA IPC and NCCL primitives, the
#                GPU daemon test and the C++ client's CUDA IPC steps
#       python   the Python SDK's tests against a --backend cuda daemon (GPU transports included)
#       bench    the benchmarks with torch beside them
#       all      the four in order (for a machine without a per-call limit)
#       lease    one call of a short lease: probe, the C++ programs at once, the benchmarks, then
#                the Python suite while MUOND_GPU_DEADLINE (default 540) seconds last
#       tests    the same without the benchmarks: probe, the C++ programs, then the whole Python
#                suite (about 100 s and 420 s on an H200 with 14 workers)
#
# The summary (OUT/summary.txt) and every log, packed (OUT/logs.tgz, since a lent machine returns
# at most 8 files), go into OUT (default $OUT, else gpu-check-out); the logs are written under
# MUOND_GPU_WORK (default /tmp/muond-gpu-check) and repacked after each phase. Each step is bounded
# by a timeout, runs even when an earlier one failed, and adds a line to the summary with its exit
# status and its PASS, FAIL and SKIP counts. MUOND_REQUIRE_GPU=1 is set for every step: a test that finds no usable GPU fails
# instead of skipping, so a broken GPU path cannot pass as "skipped". Python runs with the
# machine's pytest and PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 (the carried pytest only where the machine
# has none). Exits 1 when any step of the phase failed.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
GPU_DIR="$ROOT/.gpu"
MAX_BUNDLE_MIB=60

bundle() {
  local build=${1:-$ROOT/build}
  local bundler=${GPU_BUNDLE:-$ROOT/../shared/tools/gpu-bundle.sh}
  [[ -x $bundler ]] || { echo "gpu-check: no bundler at $bundler (set GPU_BUNDLE)" >&2; exit 2; }
  # mlp_trainer: the C++ example, which the Python suite's health check runs beside the daemon.
  local programs=(muond libmuond_cuda.so cuda_backend_test backend_conformance_test integration_test
                  cuda_peer_test cuda_ipc_integration_test ns_bench step_bench elementwise_bench
                  mlp_trainer)
  local files=()
  for p in "${programs[@]}"; do
    [[ -e $build/$p ]] || { echo "gpu-check: $build/$p is missing: build it first (cmake --build $build)" >&2; exit 2; }
    files+=("$build/$p")
  done
  # The client's streaming copy travels with the Python package (build/python, copied below).
  [[ -e $build/python/muond/_stream_copy.so ]] ||
    { echo "gpu-check: $build/python/muond/_stream_copy.so is missing: build muond_stream_copy" >&2; exit 2; }
  rm -rf "$GPU_DIR"
  "$bundler" "$GPU_DIR" "${files[@]}" || exit 2
  mkdir -p "$GPU_DIR/python"
  cp -r "$ROOT/python/muond" "$GPU_DIR/python/"
  [[ -d $build/python ]] && cp -r "$build/python/." "$GPU_DIR/python/"
  # pytest travels too (pure Python, from this machine's python3), for a GPU machine without one.
  mkdir -p "$GPU_DIR/pytest"
  /usr/bin/python3 - "$GPU_DIR/pytest" <<'PY' || { echo "gpu-check: pytest not found for /usr/bin/python3" >&2; exit 2; }
import os, shutil, sys
import _pytest, iniconfig, packaging, pluggy, py, pytest
for module in (pytest, _pytest, pluggy, iniconfig, packaging, py):
    source = os.path.dirname(module.__file__)
    shutil.copytree(source, os.path.join(sys.argv[1], os.path.basename(source)),
                    ignore=shutil.ignore_patterns("__pycache__"))
PY
  # Libraries over 1 MiB (OpenBLAS, oneDNN, gRPC) travel xz-compressed, about a third smaller than
  # gzip: the bundle and the tree must fit one 64 MiB transfer. `run` unpacks them (xz, else python3's
  # lzma module).
  find "$GPU_DIR/lib" -type f -size +1M -exec xz -9 -T2 {} \;
  local mib
  mib=$(du -sm "$GPU_DIR" | awk '{print $1}')
  echo "gpu-check: bundle ${mib} MiB in $GPU_DIR"
  if ((mib > MAX_BUNDLE_MIB)); then
    echo "gpu-check: the bundle is over ${MAX_BUNDLE_MIB} MiB: it may not travel in one transfer" >&2
    exit 2
  fi
}

# The counts a test log reports, as "PASS n FAIL n SKIP n" (gtest's and pytest's summaries).
counts() {
  local log=$1
  python3 - "$log" <<'PY' 2>/dev/null || echo "PASS ? FAIL ? SKIP ?"
import re, sys
text = open(sys.argv[1], errors="replace").read()
# gtest: one "[  FAILED  ] Suite.Test (N ms)" line per test that failed or was skipped, and the
# "[  PASSED  ] N tests." summary.
passed = sum(int(n) for n in re.findall(r"^\[  PASSED  \] (\d+) tests?\.", text, re.M))
failed = len(re.findall(r"^\[  FAILED  \] \S+.* \(\d+ ms\)$", text, re.M))
skipped = len(re.findall(r"^\[  SKIPPED \] \S+.* \(\d+ ms\)$", text, re.M))
# --gtest_brief=1 prints no per-test SKIPPED line, only the "[  SKIPPED ] N tests." summary.
skipped = max(skipped, sum(int(n) for n in re.findall(r"^\[  SKIPPED \] (\d+) tests?\.", text, re.M)))
# pytest: its last summary line, e.g. "3 failed, 120 passed, 9 skipped in 80.1s".
for line in re.findall(r"^=*\s*((?:\d+ [a-z]+(?:, )?)+) in [\d.]+s", text, re.M)[-1:]:
    for n, what in re.findall(r"(\d+) ([a-z]+)", line):
        if what == "passed": passed += int(n)
        elif what in ("failed", "error", "errors"): failed += int(n)
        elif what == "skipped": skipped += int(n)
print(f"PASS {passed} FAIL {failed} SKIP {skipped}")
PY
}

unpack() {
  [[ -d $GPU_DIR ]] || { echo "gpu-check: no $GPU_DIR: run 'scripts/gpu-check.sh bundle' on the build machine" >&2; exit 2; }
  find "$GPU_DIR/lib" -name '*.gz' -exec gzip -d -f {} \;  # bundles made before xz
  if command -v xz >/dev/null; then
    find "$GPU_DIR/lib" -name '*.xz' -exec xz -d -f {} \;
  else
    find "$GPU_DIR/lib" -name '*.xz' -exec python3 -c 'import lzma, os, shutil, sys
with lzma.open(sys.argv[1]) as packed, open(sys.argv[1][:-3], "wb") as plain: shutil.copyfileobj(packed, plain)
os.remove(sys.argv[1])' {} \;
  fi
  # shellcheck disable=SC1091
  source "$GPU_DIR/env.sh"
  export MUOND_BINARY="$GPU_DIR/bin/muond" MUOND_REQUIRE_GPU=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
  PYTHON=${PYTHON:-python3}
  PY_PATH="$GPU_DIR/python"
  "$PYTHON" -c 'import pytest' 2>/dev/null || PY_PATH="$PY_PATH:$GPU_DIR/pytest"
}

# step NAME SECONDS COMMAND...: runs it into WORK/NAME.log under a timeout, adds its summary line.
step() {
  local name=$1 seconds=$2 log="$WORK_DIR/$1.log"
  shift 2
  echo "== $name: $*" >"$log"
  timeout --kill-after=10 "$seconds" "$@" >>"$log" 2>&1
  local rc=$?
  ((rc == 124 || rc == 137)) && echo "gpu-check: $name ran past ${seconds} s and was stopped" >>"$log"
  printf '%-22s exit %3d  %s  (%s)\n' "$name" "$rc" "$(counts "$log")" "$name.log" | tee -a "$WORK_DIR/summary.txt"
}

pack() {
  cp "$WORK_DIR/summary.txt" "$OUT_DIR/summary.txt" 2>/dev/null
  tar czf "$OUT_DIR/logs.tgz" -C "$WORK_DIR" . 2>/dev/null
}

# lease [0]: every phase in one call (0: all but the benchmarks, the `tests` phase), bounded by
# MUOND_GPU_DEADLINE seconds in all. The C++ programs run at once, then the benchmarks alone (their
# figures are timings; about 3 minutes, bounded), then the Python suite alone with the time left (it
# is the phase with no fixed length), each phase stopped where the deadline falls.
lease() {
  local with_bench=${1:-1} deadline=${MUOND_GPU_DEADLINE:-540} start=$SECONDS
  local -x MUOND_GPU_WORK=$WORK_DIR
  left() { echo $((deadline - (SECONDS - start))); }
  probe
  # `timeout 0` would mean no limit at all: a probe that took the whole deadline ends the lease.
  local cpp_seconds
  cpp_seconds=$(left)
  ((cpp_seconds > 0)) || { echo "gpu-check: the probe used the whole deadline"; return 0; }
  MUOND_GPU_PARALLEL=1 timeout -k 5 "$cpp_seconds" "$0" run cpp "$OUT_DIR"
  ((with_bench)) && (($(left) > 30)) && timeout -k 5 "$(left)" "$0" run bench "$OUT_DIR"
  # The Python suite takes what is left, its own step limit a little short of it, so that its
  # summary line is written and its log (pytest -v: one line per finished test) packed.
  (($(left) > 30)) && MUOND_GPU_PYTHON_SECONDS=$(($(left) - 15)) timeout -k 5 "$(left)" "$0" run python "$OUT_DIR"
  echo "gpu-check: lease done in $((SECONDS - start)) s"
}

probe() {
  step probe-gpu 60 nvidia-smi --query-gpu=index,name,driver_version,compute_mode,memory.total,memory.used \
    --format=csv
  step probe-smi 60 nvidia-smi
  step probe-ldd 60 bash -c 'for f in "$1"/bin/* "$1"/lib/*; do file -L "$f" | grep -q ELF || continue;
    echo "-- $f"; ldd "$f" | grep -E "not found|cuda|cublas|nccl|cudart" ; done;
    ! ldd "$1"/bin/* 2>/dev/null | grep -q "not found"' _ "$GPU_DIR"
  step probe-python 120 env PYTHONPATH="$PY_PATH" "$PYTHON" -c '
import sys, grpc, google.protobuf, pytest, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
print("cuda available", torch.cuda.is_available(), "devices", torch.cuda.device_count())
if torch.cuda.is_available():
    print("device 0", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
    print("nccl", torch.cuda.nccl.version())
print("grpcio", grpc.__version__, "protobuf", google.protobuf.__version__, "pytest", pytest.__version__)
import muond, muond._stubs
print("muond", muond.__version__, "stubs from", muond._stubs.__file__)'
  step probe-daemon 60 "$GPU_DIR/bin/muond" --version
}

# cpp_step ARGS...: step ARGS, in the background under MUOND_GPU_PARALLEL=1.
cpp_step() {
  if [[ ${MUOND_GPU_PARALLEL:-0} == 1 ]]; then step "$@" & else step "$@"; fi
}

cpp() {
  # MUOND_GPU_PARALLEL=1 runs the five programs at once (they share the GPU; none times anything):
  # a lease's minutes go further.
  # The CUDA backend's bf16 accuracy test sums its fp64 reference through OpenBLAS on the host, and
  # Debian's OpenBLAS picks its SSE3 kernels on the lent machines' CPUs (107 s there on 2026-12-04):
  # the test programs run under the kernels the daemon would start itself again under.
  local kernel
  kernel=$(timeout 30 "$GPU_DIR/bin/muond" --print-blas-kernel 2>/dev/null) || kernel=""
  if [[ -n ${OPENBLAS_CORETYPE:-} ]]; then
    echo "cpp: OPENBLAS_CORETYPE=$OPENBLAS_CORETYPE (given)" | tee -a "$WORK_DIR/summary.txt"
  elif [[ $kernel =~ ^[A-Za-z0-9_]+$ ]]; then
    export OPENBLAS_CORETYPE=$kernel
    echo "cpp: OPENBLAS_CORETYPE=$kernel (the daemon's choice)" | tee -a "$WORK_DIR/summary.txt"
  else
    echo "cpp: the daemon named no OpenBLAS kernel ('$kernel'): OpenBLAS picks its own" |
      tee -a "$WORK_DIR/summary.txt"
  fi
  cpp_step cuda-backend-tests 240 "$GPU_DIR/bin/cuda_backend_test" --gtest_brief=1
  cpp_step conformance 240 "$GPU_DIR/bin/backend_conformance_test" --gtest_brief=1
  cpp_step cuda-peer 120 "$GPU_DIR/bin/cuda_peer_test" --gtest_brief=1
  cpp_step gpu-daemon 120 "$GPU_DIR/bin/integration_test" --gtest_filter='*GpuDaemon*'
  cpp_step cuda-ipc-client 120 "$GPU_DIR/bin/cuda_ipc_integration_test"
  wait
}

python_tests() {
  # Where the machine's pytest has pytest-xdist and pytest-timeout, the tests run on
  # $MUOND_PYTEST_WORKERS processes (default 8), each daemon on the one GPU, and no test may take
  # more than 320 s (the example's own limit is 300 s): a hang costs one test, not the phase.
  # The stubs' generation test is left out: it needs protoc or grpcio-tools, which a GPU machine
  # need not have (the stubs travel generated, and the build machine's suite runs that test).
  local extra=(--deselect tests/python/test_package.py::test_generated_stubs_import_as_a_subpackage)
  if PYTHONPATH="$PY_PATH" "$PYTHON" -c 'import xdist, pytest_timeout' 2>/dev/null; then
    extra+=(-p xdist.plugin -n "${MUOND_PYTEST_WORKERS:-8}" -p pytest_timeout --timeout 320)
    # Work stealing (pytest-xdist 3.2 and later): a worker left idle takes tests queued behind
    # another's long one. On 2026-12-04 the default scheduler queued the slow tests (collected
    # first) on four of 12 workers, which ran 7 to 14 tests each while the others ran 54 to 125 and
    # went idle; 11 slow ones had not started when the limit fell.
    if PYTHONPATH="$PY_PATH" "$PYTHON" -c 'import sys, xdist
sys.exit(tuple(int(p) for p in xdist.__version__.split(".")[:2]) < (3, 2))' 2>/dev/null; then
      extra+=(--dist worksteal)
    fi
  fi
  # MUOND_PYTEST_ARGS replaces the selection (e.g. test ids to rerun, with options such as
  # --timeout before them); -v prints each test as it finishes,
  # so a run stopped at its limit still says which tests passed.
  # shellcheck disable=SC2086
  step python-sdk-cuda "${MUOND_GPU_PYTHON_SECONDS:-480}" env MUOND_TEST_BACKEND=cuda PYTHONPATH="$PY_PATH" \
    "$PYTHON" -m pytest -v --durations=25 -p no:cacheprovider -m "not ops" "${extra[@]}" \
    ${MUOND_PYTEST_ARGS:-"$ROOT/tests/python"}
}

bench() {
  step ns-bench 200 "$ROOT/bench/run_ns_bench.sh" --build "$GPU_DIR/bin"
  step ns-bench-fp32 200 "$ROOT/bench/run_ns_bench.sh" --build "$GPU_DIR/bin" --precision fp32
  step elementwise-fp32 90 "$GPU_DIR/bin/elementwise_bench" --backend cuda
  step elementwise-bf16 90 "$GPU_DIR/bin/elementwise_bench" --backend cuda --state-dtype bf16
  step gpu-transport-bench 150 env PYTHONPATH="$PY_PATH" PYTHON="$PYTHON" \
    "$ROOT/bench/run_gpu_transport_bench.sh" --build "$GPU_DIR/bin"
}

run() {
  local phase=${1:-}
  OUT_DIR=${2:-${OUT:-$ROOT/gpu-check-out}}
  WORK_DIR=${MUOND_GPU_WORK:-/tmp/muond-gpu-check}
  mkdir -p "$OUT_DIR" "$WORK_DIR"
  trap pack EXIT
  unpack
  local before=0
  [[ -f $WORK_DIR/summary.txt ]] && before=$(wc -l <"$WORK_DIR/summary.txt")
  case "$phase" in
    probe) probe ;;
    cpp) cpp ;;
    python) python_tests ;;
    bench) bench ;;
    all) probe; cpp; python_tests; bench ;;
    lease) lease ;;
    tests) lease 0 ;;
    *) echo "gpu-check: run PHASE: probe, cpp, python, bench, all, lease or tests" >&2; exit 2 ;;
  esac
  ! tail -n +"$((before + 1))" "$WORK_DIR/summary.txt" | grep -qE 'exit +[1-9]'
}

case "${1:-}" in
  bundle) shift; bundle "$@" ;;
  run) shift; run "$@" ;;
  *) sed -n '2,33p' "$0"; exit 2 ;;
esac
