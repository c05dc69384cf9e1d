#!/usr/bin/env bash
# Builds everything and runs the test suite. GPU tests skip themselves where there are too few GPUs.
# Usage: scripts/test.sh [ctest arguments, e.g. -L cpu]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/deps.sh"
build=$("$root/scripts/configure.sh")
cmake --build "$build" -j "$(nproc)"
cd "$build"
ctest --output-on-failure -j "$(nproc)" "$@"
