#!/bin/sh
# Prints the Debian packages that hold the shared libraries the given binaries load (ldd, then
# dpkg -S), one per line: what the runtime image must install. Run in the build stage.
set -eu
for binary in "$@"; do
  ldd "$binary" | awk '/=> \// { print $3 }'
done | sort -u | while read -r library; do
  dpkg -S "$(readlink -f "$library")" 2>/dev/null || dpkg -S "$library" 2>/dev/null || true
done | cut -d: -f1 | sort -u | grep -v -E '^(libc6|libgcc-s1|libstdc\+\+6)$' || true
