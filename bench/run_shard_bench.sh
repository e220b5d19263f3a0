#!/usr/bin/env bash
# One session over 1, 2 and 3 CPU daemons on loopback (bench/shard_bench.py): step time next to the
# placement's predicted balance. Needs Debian's python3 with torch and grpcio (scripts/setup.sh).
#
#   bench/run_shard_bench.sh [--build DIR] [shard_bench.py flags, e.g. --layers 6 --width 512]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=$root/build
if [[ ${1:-} == --build ]]; then BUILD=$2; shift 2; fi
[[ -x $BUILD/muond ]] || { echo "cannot find $BUILD/muond (cmake --build $BUILD --target muond)" >&2; exit 1; }
exec /usr/bin/python3 "$root/bench/shard_bench.py" --binary "$BUILD/muond" "$@"
