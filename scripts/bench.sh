#!/usr/bin/env bash
# Builds and runs epx-bench on every visible GPU (or the CPU reference run where there is none).
# Usage: scripts/bench.sh [epx-bench flags, see epx-bench --help] [--plot FILE.svg]
#   --plot FILE.svg  also the run's bar chart (per op the EPX time beside the NCCL all-to-all of the same run),
#                    drawn from its JSON (--json-file, or a temporary file) by python -m epx_tools.bench_plot;
#                    the CPU reference run (no GPU) has nothing to plot and says so
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
args=()
plot=""
json=""
while [ $# -gt 0 ]; do
  case $1 in
    --plot | --plot=*)
      if [ "$1" = --plot ]; then
        [ $# -ge 2 ] || { echo "scripts/bench.sh: --plot needs a value" >&2; exit 2; }
        plot=$2
        shift
      else
        plot=${1#--plot=}
      fi
      [[ $plot == ?*.svg ]] || { echo "scripts/bench.sh: invalid --plot = $plot: must end in .svg" >&2; exit 2; }
      ;;
    --json-file) json=${2-} && args+=("$1") ;;
    --json-file=*) json=${1#--json-file=} && args+=("$1") ;;
    *) args+=("$1") ;;
  esac
  shift
done
if [ -n "$plot" ] && [ -z "$json" ]; then
  json=$(mktemp --suffix .json)
  trap 'rm -f "$json"' EXIT
  args+=(--json-file "$json")
fi
PYTHON=$("$root/scripts/deps.sh" bench)  # the build's needs only (no test or lint tools)
export PYTHON
build=$("$root/scripts/configure.sh")
cmake --build "$build" -j "$(nproc)" --target epx-bench
status=0
"$build/bench/epx-bench" "${args[@]}" || status=$?
if [ -n "$plot" ] && [ $status = 0 ] && [ -s "$json" ]; then
  # Exit status 1 is "nothing to plot" (the CPU reference run, said on stderr): the run itself succeeded.
  PYTHONPATH=$root/python "$PYTHON" -m epx_tools.bench_plot "$json" --out "$plot" || [ $? = 1 ] || status=2
fi
exit $status
