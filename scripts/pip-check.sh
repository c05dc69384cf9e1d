#!/usr/bin/env bash
# The README's pip route on a clean machine: builds the wheel (scikit-build-core, no build isolation, so the
# installed pybind11 and NVSHMEM wheel are used), installs it into a temporary folder and imports epx and
# deep_ep from there, outside the repository.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
target=$(mktemp -d)
trap 'rm -rf "$target"' EXIT
"$PYTHON" -m pip install -q --no-build-isolation --no-deps --target "$target" "$root/python"
cd "$target"
PYTHONPATH="$target" "$PYTHON" -c '
import epx, deep_ep
print("pip route: epx", epx.__file__, "WITH_NVSHMEM =", epx.WITH_NVSHMEM,
      "| deep_ep.Config().get_nvl_buffer_size_hint(14336, 8) =", deep_ep.Config().get_nvl_buffer_size_hint(14336, 8))
'
