#!/usr/bin/env bash
# Builds muond and runs every test: kernel unit tests, daemon unit tests, the integration tests
# (the real daemon on loopback driven by the C++ client) and the Python SDK's tests (pytest against
# the real daemon). Extra arguments go to ctest, e.g. scripts/test.sh -R integration.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${MUOND_BUILD_DIR:-$root/build}
"$root/scripts/build.sh"
cd "$build"
ctest --output-on-failure --timeout 900 -j"$(nproc)" "$@"
