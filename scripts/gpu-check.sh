#!/usr/bin/env bash
# The one command a GPU machine runs: build (or reuse a carried build), then every GPU test side by side, then
# the benchmark alone on the quiet machine. Within 9 minutes on two GPUs:
#   - the C++ GPU tests at one rank per GPU, in two shards, and the normal suite again with
#     EPX_COMBINE_PUBLISHER_WARP=0;
#   - the C++ GPU tests of larger groups (4 ranks by default) with ranks sharing the GPUs, in two shards
#     (EPX_TEST_RANKS_PER_GPU, EPX_TEST_MIN_RANKS: only the groups one rank per GPU could not run);
#   - the Python GPU tests (megatron-core's included when its wheel is installed or carried in .whl/) and the
#     examples, at one rank per GPU (the test files in two jobs), and the Python tests of larger groups with
#     ranks sharing the GPUs;
#   - epx-bench: normal mode at SM budgets 8, 16, 20, 24 and 32 (a Buffer with a combine staging area: at 8 and
#     16 SMs the combine's rows come back by copy engine), low-latency mode, NCCL beside both.
# Logs, the benchmark's table, JSON and plot (bench.svg) and summary.txt go under $OUT (default gpu-out/); at
# most 8 files, the per-job logs packed in logs.tar.gz. Exit status: non-zero when any stage failed.
# Environment knobs:
#   GPU_TESTS      gtest filter of the C++ GPU tests (default: all; "-" skips them and the C++ examples)
#   PY_TESTS       "-" skips the Python GPU tests and the Python example
#   BENCH_ARGS     epx-bench flags (default: see above; "skip" skips the benchmark)
#   SHARED_RANKS   the larger group size the shared-GPU jobs cover (default 4; 0 skips those jobs)
#   TEST_TIMEOUT / BENCH_TIMEOUT  seconds before the tests / the benchmark are killed (default 420 / 150)
#   EPX_BUILD_DIR  build folder (default build-gpu/); when it already holds the binaries and EPX_REBUILD is
#                  unset, they are used as they are (a build carried from a machine with nvcc).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${OUT:-$root/gpu-out}
mkdir -p "$out"
logs=$(mktemp -d)
start_s=$(date +%s)
elapsed() { echo $(($(date +%s) - start_s)); }
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
# The image may lack an installed GoogleTest: use a source tree carried in .carry/googletest.
if [ ! -f /usr/include/gtest/gtest.h ] && [ -d "$root/.carry/googletest" ]; then
  export EPX_GTEST_SOURCE_DIR=$root/.carry/googletest
fi
# Wheels carried in .whl/ (megatron-core for its fused_a2a tests, on a machine without a network).
site=""
if compgen -G "$root/.whl/*.whl" >/dev/null; then
  site=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$root"/.whl/*.whl ||
    echo "gpu-check: the wheels in .whl/ did not install"
fi

{ nvidia-smi -L; nvidia-smi topo -m; } >"$out/machine.txt" 2>&1
num_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
echo "gpu-check on $num_gpus GPU(s): $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
build_s=0
if [ -n "${EPX_REBUILD:-}" ] || [ ! -x "$build/tests/epx_gpu_tests" ] || [ ! -x "$build/bench/epx-bench" ]; then
  "$root/scripts/configure.sh" >"$logs/configure.log" 2>&1 && cmake --build "$build" -j "$(nproc)" >"$logs/build.log" 2>&1
  build_rc=$?
  build_s=$(elapsed)
  echo "build: rc=$build_rc in ${build_s}s on $(nproc) cores"
  if [ $build_rc != 0 ]; then
    tail -40 "$logs/build.log"
    tar czf "$out/logs.tar.gz" -C "$logs" .
    exit $build_rc
  fi
fi

# ---- Every test, side by side: job NAME ENV=VALUE... -- COMMAND ----
test_timeout=${TEST_TIMEOUT:-420}
shared_ranks=${SHARED_RANKS:-4}
shared_per_gpu=$(((shared_ranks + num_gpus - 1) / num_gpus))
names=()
job() {
  local name=$1
  shift
  local vars=()
  while [ "$1" != "--" ]; do
    vars+=("$1")
    shift
  done
  shift
  names+=("$name")
  (
    job_start=$(date +%s)
    env "${vars[@]}" timeout -k 10 "$test_timeout" "$@" >"$logs/$name.log" 2>&1
    echo "$? $(($(date +%s) - job_start))" >"$logs/$name.rc"
  ) &
}
# Not --gtest_brief: a job killed at TEST_TIMEOUT then names the test it was running ("[ RUN ]").
gpu_filter=${GPU_TESTS:-*}
export PYTHONPATH=$root/python:$build/python${site:+:$site}
if [ "$gpu_filter" != "-" ]; then
  for shard in 0 1; do
    job "cpp-$shard" GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=$shard \
      -- "$build/tests/epx_gpu_tests" --gtest_filter="$gpu_filter" --gtest_output="json:$logs/cpp-$shard.json"
  done
  if [ "$shared_ranks" -gt "$num_gpus" ]; then
    # The larger groups in two shards as well (alone, one job ran past 230 s on 2 x H100), without the two
    # largest batches (65,536 tokens, far above the old cap), which the groups of one rank per GPU run.
    heavy="*SixtyFive*:*FarAbove*"
    if [[ $gpu_filter == *-* ]]; then shared_filter="$gpu_filter:$heavy"; else shared_filter="$gpu_filter:-$heavy"; fi
    for shard in 0 1; do
      job "cpp-shared-$shard" EPX_TEST_RANKS_PER_GPU="$shared_per_gpu" EPX_TEST_MIN_RANKS=$((num_gpus + 1)) \
        GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=$shard -- "$build/tests/epx_gpu_tests" \
        --gtest_filter="$shared_filter" --gtest_output="json:$logs/cpp-shared-$shard.json"
    done
  fi
  # Switches read once per process (a test cannot toggle them): the combine without its publisher warp (on by
  # default with 2 ranks) on the normal suite of one rank per GPU.
  job cpp-pub-off EPX_COMBINE_PUBLISHER_WARP=0 -- "$build/tests/epx_gpu_tests" \
    --gtest_filter="Normal/NormalRanks.*:Normal.OddChunksTwoRanks:-*SixtyFive*:*FarAbove*" \
    --gtest_output="json:$logs/cpp-pub-off.json"
  # The numbered C++ examples, each checking its own result, on every GPU (4 ranks at most).
  if [ -x "$build/examples/epx_example_normal" ]; then
    ranks=$((num_gpus > 4 ? 4 : num_gpus))
    job cpp-examples -- bash -c "'$build/examples/epx_example_normal' $ranks && '$build/examples/epx_example_low_latency' $ranks"
  fi
fi
if [ "${PY_TESTS:-1}" != "-" ] && [ -d "$build/python/epx" ]; then
  pytest_opts=(-q -p no:cacheprovider -rs)
  # One rank per GPU in two jobs, the test files alternately (one job took 219 s alone and ran past 240 s beside
  # the others); each lists its slowest tests.
  mapfile -t py_files < <(find tests/python/gpu -name 'test_*.py' | sort)
  for shard in 0 1; do
    files=()
    for i in "${!py_files[@]}"; do
      if ((i % 2 == shard)); then files+=("${py_files[$i]}"); fi
    done
    then_example=""
    if [ "$shard" = 0 ]; then then_example=" && python3 examples/03_moe_layer.py"; fi
    job "py-$shard" -- bash -c "python3 -m pytest ${pytest_opts[*]} --durations=5 ${files[*]}$then_example"
  done
  if [ "$shared_ranks" -gt "$num_gpus" ]; then
    job py-shared EPX_TEST_RANKS_PER_GPU="$shared_per_gpu" EPX_TEST_MIN_RANKS=$((num_gpus + 1)) \
      -- python3 -m pytest "${pytest_opts[@]}" tests/python/gpu
  fi
fi
wait

# One line per job: passed, failed, skipped (gtest's JSON; pytest's last line), exit status, seconds.
summary=$out/summary.txt
tests_failed=0
{
  printf '%-13s %7s %7s %8s %5s %6s\n' job passed failed skipped rc s
  for name in "${names[@]}"; do
    read -r rc secs <"$logs/$name.rc"
    passed=- failed=- skipped=-
    if [ -f "$logs/$name.json" ]; then
      # Also the job's three slowest tests, into $name.slowest (printed after the table).
      read -r passed failed skipped < <(python3 - "$logs/$name.json" "$name" "$logs/$name.slowest" <<'EOF'
import json, sys
tests = [(t, f"{suite['name']}.{t['name']}")
         for suite in json.load(open(sys.argv[1]))["testsuites"] for t in suite["testsuite"]]
skipped = sum(t.get("result") == "SKIPPED" for t, _ in tests)
failed = sum(bool(t.get("failures")) for t, _ in tests)
print(len(tests) - skipped - failed, failed, skipped)
times = sorted(((float(t.get("time", "0s").rstrip("s")), n) for t, n in tests), reverse=True)[:3]
with open(sys.argv[3], "w") as out:
    print(f"{sys.argv[2]} slowest: " + ", ".join(f"{n} {s:.0f} s" for s, n in times), file=out)
EOF
      )
    elif [[ $name == py* ]]; then
      line=$(grep -E '[0-9]+ (passed|failed)' "$logs/$name.log" | tail -1)
      passed=$(grep -oE '[0-9]+ passed' <<<"$line" | cut -d' ' -f1)
      failed=$(grep -oE '[0-9]+ failed' <<<"$line" | cut -d' ' -f1)
      skipped=$(grep -oE '[0-9]+ skipped' <<<"$line" | cut -d' ' -f1)
    fi
    printf '%-13s %7s %7s %8s %5s %6s\n' "$name" "${passed:-0}" "${failed:-0}" "${skipped:-0}" "$rc" "$secs"
    [ "$rc" = 0 ] || tests_failed=1
  done
} >"$summary"  # not piped into tee: a pipe's subshell would lose tests_failed
cat "$summary"
# Each job's three slowest tests: what to move when a job nears TEST_TIMEOUT beside the others.
for name in "${names[@]}"; do
  if [ -f "$logs/$name.slowest" ]; then
    cat "$logs/$name.slowest"
  elif [[ $name == py-[0-9] ]]; then
    slowest=$(grep -A3 "slowest .*durations" "$logs/$name.log" | grep -E "^[0-9.]+s call" |
      sed -E 's/^([0-9.]+)s call +(.*)$/\2 \1 s/' | paste -sd, - | sed 's/,/, /g')
    [ -n "$slowest" ] && echo "$name slowest: $slowest"
  fi
done | tee -a "$summary"
[ $tests_failed = 0 ] || for name in "${names[@]}"; do
  read -r rc _ <"$logs/$name.rc"
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo "--- $name: killed at TEST_TIMEOUT=${test_timeout}s; running: $(grep -E '^\[ RUN' "$logs/$name.log" | tail -1)"
    grep -vE "Skipped|needs [0-9]+ GPUs|below EPX_TEST_MIN_RANKS|^\[|^$" "$logs/$name.log" | tail -5
  elif [ "$rc" != 0 ]; then
    echo "--- $name (rc $rc), last lines:"
    grep -E "FAILED|Error|error" "$logs/$name.log" | tail -15
  fi
done | tee -a "$summary"
echo "tests done at $(elapsed)s" | tee -a "$summary"

# ---- The benchmark, alone on the machine ----
bench_rc=skipped
if [ "${BENCH_ARGS:-}" != "skip" ]; then
  # shellcheck disable=SC2086
  timeout -k 10 "${BENCH_TIMEOUT:-150}" "$build/bench/epx-bench" --json-file "$out/bench.json" \
    ${BENCH_ARGS:---num-sms 8,16,20,24,32 --staging} >"$out/bench.txt" 2>&1
  bench_rc=$?
  # The bar chart of the run, drawn from its JSON (standard library only; PYTHONPATH holds python/).
  [ -s "$out/bench.json" ] &&
    python3 -m epx_tools.bench_plot "$out/bench.json" --out "$out/bench.svg" >>"$out/bench.txt" 2>&1
  grep -vE "^  " "$out/bench.txt" | tail -45
fi
printf '{"date":"%s","gpus":%s,"build_s":%s,"tests_failed":%s,"bench_rc":"%s","total_s":%s}\n' \
  "$(date -Iseconds)" "$num_gpus" "$build_s" "$tests_failed" "$bench_rc" "$(elapsed)" | tee -a "$summary"
tar czf "$out/logs.tar.gz" -C "$logs" .
rm -rf "$logs" ${site:+"$site"}
[ "$tests_failed" = 0 ] || exit 1
[ "$bench_rc" = 0 ] || [ "$bench_rc" = skipped ] || exit 1
