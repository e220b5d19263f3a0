#!/usr/bin/env bash
# Installs the dependencies (scripts/setup.sh) and builds muond into build/ (or $MUOND_BUILD_DIR).
# Extra arguments are passed to the CMake configure step, e.g. -DMUOND_ENABLE_CUDA=OFF. The compiler's
# output goes to <build>/build.log and is shown only when the build fails (MUOND_VERBOSE=1 shows it).
# MUOND_BUILD_TARGETS (space-separated) builds only those targets and what they need, e.g. the demo's
# "muond mlp_trainer muond_python_stubs"; unset, everything is built (tests and benchmarks too).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${MUOND_BUILD_DIR:-$root/build}
"$root/scripts/setup.sh"
mkdir -p "$build"
log="$build/build.log"
targets=()
for t in ${MUOND_BUILD_TARGETS:-}; do targets+=(--target "$t"); done
echo "build: configuring and compiling ${MUOND_BUILD_TARGETS:-everything} into $build (log: $log)"
start=$SECONDS
if [ "${MUOND_VERBOSE:-0}" = 1 ]; then
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@"
  cmake --build "$build" -j"$(nproc)" "${targets[@]}"
elif ! { cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" &&
         cmake --build "$build" -j"$(nproc)" "${targets[@]}"; } >"$log" 2>&1; then
  tail -n 60 "$log"
  echo "build: FAILED (full log: $log)" >&2
  exit 1
fi
echo "build: done in $((SECONDS - start)) s"
