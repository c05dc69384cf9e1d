#!/usr/bin/env bash
# Fails when a C++/CUDA file is not formatted as .clang-format says. Fix with: scripts/check-format.sh --fix
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
mapfile -t files < <(git ls-files '*.hpp' '*.cpp' '*.cu' '*.cuh' '*.h')
[ ${#files[@]} -gt 0 ] || exit 0
if [ "${1:-}" = "--fix" ]; then
  clang-format -i "${files[@]}"
else
  clang-format --dry-run -Werror "${files[@]}"
  echo "format: ${#files[@]} files clean"
fi
# Python: ruff with ruff.toml (pyflakes + pycodestyle), where ruff is installed (CI installs it).
if "${PYTHON:-python3}" -m ruff --version >/dev/null 2>&1; then
  "${PYTHON:-python3}" -m ruff check --quiet "$root"
  echo "ruff: clean"
fi
