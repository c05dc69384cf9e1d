#!/usr/bin/env bash
# Builds everything and runs the test suite. GPU tests skip themselves where there are too few GPUs. The last
# line counts the tests, a pytest suite as its tests ("186 passed, 0 failed, 170 skipped"), after a line with
# the reasons for the skips; CTest's own list of skipped tests is left out.
# Usage: scripts/test.sh [ctest arguments, e.g. -L cpu]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# The interpreter with the test dependencies (a venv unless one is active; scripts/deps.sh says which).
PYTHON=$("$root/scripts/deps.sh" test)
export PYTHON
build=$("$root/scripts/configure.sh")
cmake --build "$build" -j "$(nproc)"
cd "$build"
status=0
ctest --output-on-failure --no-tests=error -j "$(nproc)" "$@" | awk '
  /^The following tests did not run:$/ { listing = 1; next }
  listing && /^[ \t]/ { next }
  { listing = 0; print; fflush() }' || status=$?
"$root/scripts/skip-reasons.sh" Testing/Temporary/LastTest.log
exit $status
