#!/usr/bin/env bash
# Builds everything and runs the test suite. GPU tests skip themselves where there are too few GPUs; the
# reasons are listed at the end (CTest shows a skipped test as "Not Run (Skipped)" without its reason).
# Usage: scripts/test.sh [ctest arguments, e.g. -L cpu]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/deps.sh"
build=$("$root/scripts/configure.sh")
cmake --build "$build" -j "$(nproc)"
cd "$build"
status=0
ctest --output-on-failure -j "$(nproc)" "$@" || status=$?
"$root/scripts/skip-reasons.sh" Testing/Temporary/LastTest.log
exit $status
