#!/usr/bin/env bash
# Builds the host-only core and the C++ CPU tests with AddressSanitizer and UndefinedBehaviorSanitizer into
# build-sanitize/ (no CUDA, no Python) and runs them: any memory error or undefined behaviour fails.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${EPX_SANITIZE_BUILD_DIR:-$root/build-sanitize}
flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g -O1"
cmake -S "$root" -B "$build" -G Ninja -DEPX_WITH_CUDA=OFF -DEPX_BUILD_BENCH=OFF -DEPX_BUILD_EXAMPLES=OFF \
  -DEPX_BUILD_PYTHON=OFF -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS="$flags" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
cmake --build "$build" -j "$(nproc)" --target epx_cpu_tests
# The local launcher forks rank processes (leak checks of a forked child report the parent's live memory),
# and one test crashes a rank on purpose with SIGSEGV, which must stay a SIGSEGV.
ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:handle_segv=0 UBSAN_OPTIONS=print_stacktrace=1 "$build/tests/epx_cpu_tests" --gtest_brief=1
