#!/usr/bin/env bash
# Builds and runs epx-bench on every visible GPU (or the CPU reference run where there is none).
# Usage: scripts/bench.sh [epx-bench flags, see epx-bench --help]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=$("$root/scripts/deps.sh" bench)  # the build's needs only (no test or lint tools)
export PYTHON
build=$("$root/scripts/configure.sh")
cmake --build "$build" -j "$(nproc)" --target epx-bench
"$build/bench/epx-bench" "$@"
