#!/usr/bin/env bash
# The one command a GPU machine runs: build (or reuse a carried build), run the GPU tests, the C++ examples,
# the Python tests and example and the benchmark, and leave logs, the benchmark's table, JSON and plot
# (bench.svg: EPX beside NCCL) plus summary.json under $OUT (default gpu-out/).
# Environment knobs:
#   GPU_TESTS      gtest filter of the GPU tests (default: all; "-" skips them)
#   PY_TESTS       "-" skips the Python GPU tests and the example
#   BENCH_ARGS     epx-bench flags (default: the shapes of docs/BENCHMARKS.md; "skip" skips the benchmark)
#   TEST_TIMEOUT / BENCH_TIMEOUT  seconds before the stage is killed (default 300 / 240)
#   EPX_TEST_RANKS_PER_GPU  N ranks share each GPU in the tests (logic of larger groups on fewer GPUs; slow)
#   EPX_BUILD_DIR  build folder (default build-gpu/); when it already holds the binaries and EPX_REBUILD is
#                  unset, they are used as they are (a build carried from a machine with nvcc).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${OUT:-$root/gpu-out}
mkdir -p "$out"
# Multicast objects can take a shared host out of service: keep every NVLS/multicast path off.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# A stuck device wait reports within this many seconds instead of eating the machine's time.
export EPX_WAIT_TIMEOUT_S=${EPX_WAIT_TIMEOUT_S:-15}
export EPX_BUILD_DIR=${EPX_BUILD_DIR:-$root/build-gpu}
build=$EPX_BUILD_DIR

# NCCL and NVSHMEM come as pip wheels on the GPU image: make their libraries findable at run time.
for module in nvidia.nccl nvidia.nvshmem; do
  dir=$(python3 -c "import $module as m; print(m.__path__[0])" 2>/dev/null) && export LD_LIBRARY_PATH=$dir/lib:${LD_LIBRARY_PATH:-}
done
# The image may lack an installed GoogleTest: use the source tree carried in .carry/ (see README).
if [ ! -f /usr/include/gtest/gtest.h ] && [ -d "$root/.carry/googletest" ]; then
  export EPX_GTEST_SOURCE_DIR=$root/.carry/googletest
fi

{ nvidia-smi -L; nvidia-smi topo -m; } >"$out/machine.txt" 2>&1
build_s=0
if [ -n "${EPX_REBUILD:-}" ] || [ ! -x "$build/tests/epx_gpu_tests" ] || [ ! -x "$build/bench/epx-bench" ]; then
  start=$(date +%s)
  "$root/scripts/configure.sh" >"$out/configure.log" 2>&1 && cmake --build "$build" -j "$(nproc)" >"$out/build.log" 2>&1
  build_rc=$?
  build_s=$(($(date +%s) - start))
  echo "build: rc=$build_rc in ${build_s}s on $(nproc) cores"
  [ $build_rc = 0 ] || { tail -40 "$out/build.log"; exit $build_rc; }
fi

tests_rc=skipped
if [ "${GPU_TESTS:-*}" != "-" ]; then
  timeout -k 10 "${TEST_TIMEOUT:-300}" "$build/tests/epx_gpu_tests" --gtest_filter="${GPU_TESTS:-*}" --gtest_output="json:$out/gpu-tests.json" \
    >"$out/gpu-tests.log" 2>&1
  tests_rc=$?
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \]|tests? ran" "$out/gpu-tests.log" | tail -40
  grep -E "^\[       OK \]|^\[  FAILED  \]|^\[  SKIPPED \]" "$out/gpu-tests.log" | sed 's/^/  /' | tail -80 >"$out/gpu-tests-brief.txt"
fi

# The numbered C++ examples, each checking its own result, on every GPU (4 ranks at most).
examples_rc=skipped
if [ "${GPU_TESTS:-*}" != "-" ] && [ -x "$build/examples/epx_example_normal" ]; then
  ranks=$(($(nvidia-smi -L | grep -c '^GPU') * ${EPX_TEST_RANKS_PER_GPU:-1}))
  [ $ranks -gt 4 ] && ranks=4
  examples_rc=0
  for example in normal low_latency; do
    timeout -k 10 120 "$build/examples/epx_example_$example" $ranks >>"$out/cpp-examples.log" 2>&1 || examples_rc=1
  done
  tail -12 "$out/cpp-examples.log"
fi

# Python: the binding's GPU pytest suite (torch multiprocessing) and the example MoE layer trained on the GPUs.
py_rc=skipped
if [ "${PY_TESTS:-1}" != "-" ] && [ -d "$build/python/epx" ]; then
  export PYTHONPATH=$root/python:$build/python
  timeout -k 10 "${PY_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -rs tests/python/gpu \
    >"$out/py-tests.log" 2>&1
  py_rc=$?
  tail -15 "$out/py-tests.log"
  if [ "${EPX_TEST_RANKS_PER_GPU:-1}" -le 1 ]; then  # the example's NCCL group needs a GPU per rank
    timeout -k 10 120 python3 examples/03_moe_layer.py >"$out/moe-example.log" 2>&1 || py_rc=example-failed
    tail -8 "$out/moe-example.log"
  fi
fi

bench_rc=skipped
if [ "${BENCH_ARGS:-}" != "skip" ]; then
  # shellcheck disable=SC2086
  timeout -k 10 "${BENCH_TIMEOUT:-240}" "$build/bench/epx-bench" --json-file "$out/bench.json" \
    --plot "$out/bench.svg" ${BENCH_ARGS:-} >"$out/bench.txt" 2>&1
  bench_rc=$?
  tail -60 "$out/bench.txt"
fi

printf '{"date":"%s","build_s":%s,"tests_rc":"%s","examples_rc":"%s","py_rc":"%s","bench_rc":"%s"}\n' \
  "$(date -Iseconds)" "$build_s" "$tests_rc" "$examples_rc" "$py_rc" "$bench_rc" | tee "$out/summary.json"
[ "$tests_rc" = 0 ] || [ "$tests_rc" = skipped ] || exit 1
[ "$examples_rc" = 0 ] || [ "$examples_rc" = skipped ] || exit 1
[ "$py_rc" = 0 ] || [ "$py_rc" = skipped ] || exit 1
[ "$bench_rc" = 0 ] || [ "$bench_rc" = skipped ] || exit 1
