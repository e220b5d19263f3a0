#!/usr/bin/env bash
# Installs the dependencies (scripts/setup.sh) and builds muond into build/ (or $MUOND_BUILD_DIR).
# Extra arguments are passed to the CMake configure step, e.g. -DMUOND_ENABLE_CUDA=OFF. The compiler's
# output goes to <build>/build.log and is shown only when the build fails (MUOND_VERBOSE=1 shows it).
# MUOND_BUILD_TARGETS (space-separated) builds only those targets and what they need, e.g. the demo's
# "muond mlp_trainer muond_python_stubs"; unset, everything is built (tests and benchmarks too).
# The sources of each target compile in batches (CMake's unity build: the gRPC, protobuf and abseil
# headers that take half of each file's compile time are read once per batch): a build from scratch
# takes about two thirds of the time (761 s against 1168 s on a 2-vCPU machine). MUOND_UNITY_BUILD=OFF
# compiles each file on its own, for a tree rebuilt file by file. So a name in a file's anonymous
# namespace is unique within its target (the batches shift as files come and go); configuring with
# -DCMAKE_UNITY_BUILD_BATCH_SIZE=0 compiles each target as one batch and shows any clash.
# MUOND_DEBUG_INFO=lines compiles with line tables only (-g1, the CMake option of the same name;
# .ci/run sets it), full with full debug information (-g, the default); unset, the build folder keeps
# what it was configured with.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${MUOND_BUILD_DIR:-$root/build}
"$root/scripts/setup.sh"
mkdir -p "$build"
log="$build/build.log"
unity=${MUOND_UNITY_BUILD:-ON}
targets=()
debug_info=()
if [[ -n ${MUOND_DEBUG_INFO:-} ]]; then debug_info=(-DMUOND_DEBUG_INFO="$MUOND_DEBUG_INFO"); fi
for t in ${MUOND_BUILD_TARGETS:-}; do targets+=(--target "$t"); done
echo "build: configuring and compiling ${MUOND_BUILD_TARGETS:-everything} into $build (log: $log)"
start=$SECONDS
if [ "${MUOND_VERBOSE:-0}" = 1 ]; then
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_UNITY_BUILD="$unity" "${debug_info[@]}" "$@"
  cmake --build "$build" -j"$(nproc)" "${targets[@]}"
elif ! { cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_UNITY_BUILD="$unity" "${debug_info[@]}" "$@" &&
         cmake --build "$build" -j"$(nproc)" "${targets[@]}"; } >"$log" 2>&1; then
  tail -n 60 "$log"
  echo "build: FAILED (full log: $log)" >&2
  exit 1
fi
echo "build: done in $((SECONDS - start)) s"
