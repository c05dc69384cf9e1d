#!/usr/bin/env bash
# The README's pip route on a clean machine: builds the wheel (scikit-build-core, no build isolation, so the
# installed pybind11 and NVSHMEM wheel are used), installs it into a temporary folder and imports epx and
# deep_ep from there, outside the repository. The build's steps show as they run; the whole log is printed
# only if it fails.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=$("$root/scripts/deps.sh" pip)
target=$(mktemp -d)
log=$(mktemp)
trap 'rm -rf "$target" "$log"' EXIT
echo "pip-check: building the wheel with $PYTHON (2 to 3 minutes on 2 cores; ninja's steps below)"
status=0
"$PYTHON" -m pip install -v --disable-pip-version-check --no-build-isolation --no-deps --target "$target" \
  "$root/python" 2>&1 | tee "$log" | while IFS= read -r line; do
  # ninja's "[12/80] Building CUDA object ..." lines, with the seconds since the start.
  case $line in
    *\[[0-9]*/[0-9]*\]\ *) printf 'pip-check: %4ds [%s\n' "$SECONDS" "${line#*[}" ;;
  esac
done || status=$?
if [ $status != 0 ]; then
  cat "$log"
  echo "pip-check: pip install failed (exit $status)"
  exit $status
fi
echo "pip-check: built and installed in ${SECONDS}s"
cd "$target"
PYTHONPATH="$target" "$PYTHON" -c '
import importlib.util, os
import epx, deep_ep
# The wheel ships the library only: the tools (python/epx_tools) stay in the repository.
shipped = set(os.listdir(os.path.dirname(epx.__file__)))
assert importlib.util.find_spec("epx_tools") is None, "the wheel installed epx_tools"
assert not shipped & {"bench.py", "bench_plot.py", "plot.py", "reference.py"}, sorted(shipped)
print("pip route: epx", epx.__file__, "WITH_NVSHMEM =", epx.WITH_NVSHMEM,
      "| deep_ep.Config().get_nvl_buffer_size_hint(14336, 8) =", deep_ep.Config().get_nvl_buffer_size_hint(14336, 8))
'
