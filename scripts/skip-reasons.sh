#!/usr/bin/env bash
# Prints why tests skipped, one line per reason with its count, from a CTest log (default:
# build/Testing/Temporary/LastTest.log): GoogleTest's "Skipped" messages and pytest's -rs summary lines.
set -euo pipefail
log=${1:-build/Testing/Temporary/LastTest.log}
[ -f "$log" ] || exit 0
awk '
  /: Skipped$/ { if ((getline reason) > 0) count[reason] += 1; next }
  /^SKIPPED \[[0-9]+\] / {
    match($0, /\[[0-9]+\]/)
    n = substr($0, RSTART + 1, RLENGTH - 2)
    reason = $0
    sub(/^SKIPPED \[[0-9]+\] [^ ]*:[0-9]+: /, "", reason)
    count[reason] += n
  }
  END {
    for (reason in count) lines = lines sprintf("  %5d x %s\n", count[reason], reason)
    if (lines != "") printf "skipped tests, by reason:\n%s", lines
  }' "$log"
