#!/usr/bin/env bash
# Everything the README's results need, in one GPU-machine call: the C++ and Python GPU tests with the example,
# the normal-mode benchmark at 12, 24 and 48 SMs for 4,096 and 16,384 tokens per rank, the low-latency
# benchmark and its 1-token fixed cost, (with 4 or more GPUs) the low-latency benchmark across virtual nodes of
# half the GPUs each, and the plots of all of it (python -m epx_tools.plot, into $OUT/plots.tar.gz).
# A device call brings back at most 8 files, so every stage's logs are packed into $OUT/logs.tar.gz and the
# tables into $OUT/summary.txt. Exit status: non-zero when any stage failed.
# Knobs: those of gpu-check.sh (GPU_TESTS, PY_TESTS, EPX_TEST_RANKS_PER_GPU, EPX_REBUILD, ...); STAGES
# (default "tests normal ll fixed-cost nodes") picks the stages.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/gpu-out}
mkdir -p "$out"
work=$(mktemp -d)
summary=$out/summary.txt
: >"$summary"
failed=""

# stage NAME VAR=VALUE...: one gpu-check.sh run with those settings, logs under $work/NAME.
stage() {
  local name=$1
  shift
  echo "=== $name: $*" | tee -a "$summary"
  env "$@" OUT="$work/$name" "$root/scripts/gpu-check.sh" >>"$summary" 2>&1 || failed="$failed $name"
}

num_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
stages=${STAGES:-tests normal ll fixed-cost nodes}
for s in $stages; do
  case $s in
    tests) stage tests BENCH_ARGS=skip ;;
    normal)
      stage normal GPU_TESTS=- PY_TESTS=- BENCH_ARGS="--mode normal --num-sms 12,24,48 --tokens 4096"
      stage normal-16384 GPU_TESTS=- PY_TESTS=- BENCH_ARGS="--mode normal --num-sms 12,24,48 --tokens 16384"
      ;;
    ll) stage ll GPU_TESTS=- PY_TESTS=- BENCH_ARGS="--mode low-latency" ;;
    fixed-cost) stage fixed-cost GPU_TESTS=- PY_TESTS=- BENCH_ARGS="--mode low-latency --ll-tokens 1" ;;
    nodes)
      if [ "$num_gpus" -ge 4 ]; then
        stage nodes GPU_TESTS=- PY_TESTS=- BENCH_ARGS="--mode low-latency --ll-ranks-per-node $((num_gpus / 2))"
      fi
      ;;
    *) echo "unknown stage $s" | tee -a "$summary" && failed="$failed $s" ;;
  esac
done

# Plots from every stage's JSON (the bench lines carry their table's header, so runs stay apart).
mapfile -t jsons < <(find "$work" -name bench.json -size +0 | sort)
if [ ${#jsons[@]} -gt 0 ]; then
  mkdir -p "$work/plots"
  PYTHONPATH=$root/python python3 -m epx_tools.plot "${jsons[@]}" \
    --out "$work/plots" >>"$summary" 2>&1 || echo "plots: not drawn (see summary)" | tee -a "$summary"
  tar czf "$out/plots.tar.gz" -C "$work/plots" .
fi
tar czf "$out/logs.tar.gz" -C "$work" .
rm -rf "$work"
echo "failed stages:${failed:- none}" | tee -a "$summary"
[ -z "$failed" ]
