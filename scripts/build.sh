#!/usr/bin/env bash
# Installs the dependencies (scripts/setup.sh) and builds muond into build/ (or $MUOND_BUILD_DIR).
# Extra arguments are passed to the CMake configure step, e.g. -DMUOND_ENABLE_CUDA=OFF.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${MUOND_BUILD_DIR:-$root/build}
"$root/scripts/setup.sh"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
cmake --build "$build" -j"$(nproc)"
