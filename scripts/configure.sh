#!/usr/bin/env bash
# Configures the build folder (default: build/) with Ninja. Extra arguments go to cmake.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${EPX_BUILD_DIR:-$root/build}
extra=()
# The GPU image may lack an installed GoogleTest; a source tree can be carried instead.
[ -n "${EPX_GTEST_SOURCE_DIR:-}" ] && extra+=(-DEPX_GTEST_SOURCE_DIR="$EPX_GTEST_SOURCE_DIR")
python_exe=$(command -v "${PYTHON:-python3}")
# The Python binding builds (and its CPU pytest runs) wherever pybind11 is importable.
"$python_exe" -c 'import pybind11' 2>/dev/null && extra+=(-DEPX_BUILD_PYTHON=ON)
# EPX_CONFIGURE_ARGS: extra cmake arguments from the environment (CI turns warnings into errors with it).
# shellcheck disable=SC2086
cmake -S "$root" -B "$build" -G Ninja -DPython3_EXECUTABLE="$python_exe" "${extra[@]}" ${EPX_CONFIGURE_ARGS:-} "$@" >/dev/null
echo "$build"
