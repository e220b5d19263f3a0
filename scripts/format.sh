#!/usr/bin/env bash
# Formats every tracked C, C++ and CUDA file with clang-format (.clang-format: Google's style
# with 120 columns). scripts/format.sh --check changes nothing and fails naming each file that is
# not formatted (scripts/test.sh runs it first).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
mapfile -t files < <(git ls-files '*.c' '*.cc' '*.h' '*.cu' '*.cuh')
if [[ ${1:-} == --check ]]; then
  unformatted=()
  for f in "${files[@]}"; do
    if ! clang-format --dry-run --Werror "$f" >/dev/null 2>&1; then unformatted+=("$f"); fi
  done
  if [[ ${#unformatted[@]} -gt 0 ]]; then
    echo "format: not formatted (run scripts/format.sh): ${unformatted[*]}" >&2
    exit 1
  fi
  echo "format: ${#files[@]} files formatted"
else
  clang-format -i "${files[@]}"
fi
