#!/usr/bin/env bash
# Builds muond, checks the C++ and CUDA formatting (scripts/format.sh --check), that python/muond has no
# import circle (scripts/check_imports.py) and that docs/architecture.md names only paths that exist
# (scripts/check_doc_paths.py) and that every Markdown code block closes (scripts/check_doc_fences.py),
# that the docs' option tables are the option table's
# (scripts/option_table.py --check), and runs every test:
# kernel unit tests, daemon unit tests, the integration tests (the real daemon on loopback driven
# by the C++ client) and the Python SDK's tests (pytest against
# the real daemon), then a bounded libFuzzer run over the daemon's request handling (scripts/fuzz.sh,
# MUOND_FUZZ_SECONDS, default 30; 0 skips it). Extra arguments go to ctest, e.g.
# scripts/test.sh -R integration (a subset: the fuzz run is skipped, except under --sanitize).
#
# Then the numerics-sensitive tests run a second time under another OpenBLAS kernel
# (scripts/other-blas-kernel.sh names the rule), so that a tolerance that holds for one CPU's kernel
# only fails here rather than on a user's machine (MUOND_OTHER_KERNEL_PASS=0 skips it).
#
# scripts/test.sh --sanitize builds everything with clang, ASan and UBSan into build-sanitize/
# (scripts/sanitized-build-options.sh) and runs the same ctest suite there (the daemon the integration
# and Python tests start is instrumented too), then the bounded fuzzer run from that same build.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
sanitize=0
if [[ ${1:-} == --sanitize ]]; then
  sanitize=1
  shift
fi

if [[ $sanitize == 1 ]]; then
  source "$root/scripts/sanitized-build-options.sh"
  build=$sanitized_build_dir
  MUOND_BUILD_DIR=$build "$root/scripts/build.sh" "${sanitized_cmake_options[@]}"
  export ASAN_OPTIONS=${ASAN_OPTIONS:-halt_on_error=1:detect_leaks=1:print_stacktrace=1:strict_string_checks=1:detect_stack_use_after_return=1}
  export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
  export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$root/tests/lsan.supp:print_suppressions=0}
else
  build=${MUOND_BUILD_DIR:-$root/build}
  "$root/scripts/build.sh"  # installs clang-format with the rest (scripts/setup.sh)
  "$root/scripts/format.sh" --check
  /usr/bin/python3 "$root/scripts/check_imports.py"  # no import circle in python/muond
  /usr/bin/python3 "$root/scripts/check_doc_paths.py"  # every path docs/architecture.md names exists
  /usr/bin/python3 "$root/scripts/check_doc_fences.py"  # every Markdown code block closes
  /usr/bin/python3 "$root/scripts/option_table.py" --check  # the docs' option tables are the table's
fi
cd "$build"
ctest --output-on-failure --timeout 900 -j"$(nproc)" "$@"

if [[ $# -eq 0 && ${MUOND_OTHER_KERNEL_PASS:-1} != 0 ]]; then
  kernel=$(MUOND_BINARY="$build/muond" "$root/scripts/other-blas-kernel.sh")
  echo "test: the numerics-sensitive tests again under OpenBLAS's $kernel kernel" \
    "($(MUOND_BINARY="$build/muond" "$root/scripts/other-blas-kernel.sh" --why))"
  export OPENBLAS_CORETYPE=$kernel
  ctest --output-on-failure --timeout 900 -j"$(nproc)" -L numerics
  # Bounded like ctest's Python tests (900 s), so that a hang fails the run instead of stalling it.
  PYTHONPATH="$build/python:$root/python" PYTHONDONTWRITEBYTECODE=1 MUOND_BINARY="$build/muond" MUOND_TRANSPORT=shm \
    timeout 900 /usr/bin/python3 -m pytest "$root/tests/python/test_precision.py" "$root/tests/python/test_equivalence.py" \
    -q -p no:cacheprovider -m "not ops"
  unset OPENBLAS_CORETYPE
fi

# The fuzzer lives in the sanitized build: the plain run builds only it there (scripts/fuzz.sh), the
# sanitized run has built it already, whatever subset of the suite it was asked for.
fuzz_seconds=${MUOND_FUZZ_SECONDS:-30}
if [[ ($sanitize == 1 || $# -eq 0) && $fuzz_seconds != 0 ]]; then
  # The fuzzer sets its own sanitizer options (a smaller quarantine, among others).
  env -u ASAN_OPTIONS -u UBSAN_OPTIONS -u LSAN_OPTIONS "$root/scripts/fuzz.sh" "$fuzz_seconds"
fi
