#!/usr/bin/env bash
# Builds the libFuzzer target over the daemon's request handling (tests/fuzz/request_fuzzer.cc) with
# clang, ASan and UBSan into the sanitized build folder it shares with scripts/test.sh --sanitize
# (build-sanitize/, or $MUOND_SANITIZE_BUILD_DIR; scripts/sanitized-build-options.sh), writes its seed
# corpus and runs it for a bounded time: scripts/fuzz.sh [SECONDS] (default 60). Its output goes to
# build-sanitize/fuzz.log (the summary is printed). Inputs that add coverage are kept in
# build-sanitize/corpus/ between runs; a failing input is written to build-sanitize/artifacts/ and the
# script fails, showing the report. Replay one with build-sanitize/request_fuzzer
# build-sanitize/artifacts/crash-... (REQUEST_FUZZER_TRACE=1 prints each call the input makes). Extra
# arguments go to libFuzzer.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/scripts/sanitized-build-options.sh"
build=$sanitized_build_dir
seconds=60
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then
  seconds=$1
  shift
fi

"$root/scripts/setup.sh"
mkdir -p "$build"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo "${sanitized_cmake_options[@]}" >"$build/configure.log" 2>&1 ||
  { tail -n 40 "$build/configure.log"; echo "fuzz: configure FAILED (log: $build/configure.log)" >&2; exit 1; }
# Only the fuzzer and its seed generator (scripts/test.sh --sanitize builds the rest of the folder).
echo "fuzz: building request_fuzzer into $build (log: $build/fuzz-build.log)"
if ! cmake --build "$build" -j"$(nproc)" --target request_fuzzer request_seeds >"$build/fuzz-build.log" 2>&1; then
  tail -n 60 "$build/fuzz-build.log"
  echo "fuzz: build FAILED (full log: $build/fuzz-build.log)" >&2
  exit 1
fi

"$build/request_seeds" "$build/seeds" >/dev/null
mkdir -p "$build/corpus" "$build/artifacts"
# A smaller quarantine and returning freed pages slow the growth of RSS (see -rss_limit_mb below).
export ASAN_OPTIONS=${ASAN_OPTIONS:-halt_on_error=1:detect_leaks=1:print_stacktrace=1:quarantine_size_mb=64:allocator_release_to_os_interval_ms=500}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
# -entropic=0: the entropic schedule's bookkeeping costs more than the inputs themselves here (tens
# of thousands of features per input), so the plain schedule covers more in the same time.
# -detect_leaks=0 skips libFuzzer's leak check after every input (gRPC's threads allocate in the
# background, which makes it scan the heap almost every time); LeakSanitizer still checks at exit.
# -rss_limit_mb: ASan keeps freed memory mapped, so RSS creeps up by a few hundred MB a minute while
# the live heap stays small; single allocations are still capped by -malloc_limit_mb.
log="$build/fuzz.log"
echo "fuzz: running request_fuzzer for ${seconds} s (log: $log)"
if ! "$build/request_fuzzer" -max_total_time="$seconds" -max_len=8192 -timeout=20 -entropic=0 -detect_leaks=0 \
  -rss_limit_mb=6144 -malloc_limit_mb=1024 -print_final_stats=1 -artifact_prefix="$build/artifacts/" \
  "$@" "$build/corpus" "$build/seeds" >"$log" 2>&1; then
  tail -n 100 "$log"
  echo "fuzz: FAILED; the input is in $build/artifacts/ (full log: $log)" >&2
  exit 1
fi
grep -E '^#[0-9]+[[:space:]]+DONE|^stat::' "$log" | sed 's/^/fuzz: /'
