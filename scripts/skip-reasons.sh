#!/usr/bin/env bash
# Counts a CTest run's tests from its log (default: build/Testing/Temporary/LastTest.log) and prints, last, one
# line "N passed, M failed, K skipped", after a line that counts the skips by reason ("skipped: 170 need a GPU").
# A pytest suite counts as its tests (CTest sees one), each GoogleTest case as one; the reasons come from
# GoogleTest's "Skipped" messages and pytest's -rs lines, worded alike ("needs 2 GPUs, found 0": need a GPU).
set -euo pipefail
log=${1:-build/Testing/Temporary/LastTest.log}
[ -f "$log" ] || { echo "no test log at $log" >&2; exit 1; }
awk '
  # The reason a test gives, in one wording for both suites.
  function normalized(reason,    parts, needed, found) {
    if (reason ~ /^needs [0-9]+ GPUs?, (found [0-9]+|[0-9]+ present)$/) {
      split(reason, parts, /[ ,]+/)
      needed = parts[2] + 0
      found = (parts[4] == "found") ? parts[5] + 0 : parts[4] + 0
      return (found == 0 || needed == 1) ? "need a GPU" : "need " needed " GPUs"
    }
    if (reason == "needs 1 GPU" || reason == "no CUDA device") return "need a GPU"
    if (reason ~ /^could not import \x27[^\x27]+\x27/) {
      sub(/^could not import \x27/, "", reason)
      sub(/\x27.*/, "", reason)
      return "need " reason
    }
    if (reason ~ /^[0-9]+ ranks: below EPX_TEST_MIN_RANKS=/) { sub(/^[0-9]+ ranks: /, "", reason); return reason }
    if (reason ~ /built without CUDA$/) return "need a CUDA build"
    if (reason ~ /built without the NVSHMEM transport$/) return "need the NVSHMEM transport"
    return reason
  }
  function skip(reason, n) {
    reason = normalized(reason)
    if (!(reason in count)) order[++num_reasons] = reason
    count[reason] += n
    skipped += n
  }
  # A test block: "i/n Test: name", its output between "Output:" and "<end of output>", then its status.
  / Test: / && /^[0-9]+\/[0-9]+ / { in_test = 1; in_output = 0; pytest = 0; gtest_reason = ""; next }
  in_test && /^Output:$/ { in_output = 1; getline; next }  # the dashes under it
  in_output && /^<end of output>$/ { in_output = 0; next }
  in_output && /: Skipped$/ { if ((getline line) > 0) gtest_reason = line; next }
  in_output && /^SKIPPED \[[0-9]+\] / {
    reason = $0
    n = reason; sub(/^SKIPPED \[/, "", n); sub(/\].*/, "", n)
    sub(/^SKIPPED \[[0-9]+\] [^ ]*:[0-9]+: /, "", reason)
    py_reason[++num_py_reasons] = reason; py_count[num_py_reasons] = n + 0
    next
  }
  # pytest -q ends with "186 passed, 3 skipped in 12.1s" (or "no tests ran in 0.01s"): that suite counts as its tests.
  in_output && /^(=+ )?([0-9]+ [a-z]+(, )?)+ in [0-9.]+s( \([0-9:]+\))?( =+)?$/ {
    pytest = 1; py_passed = 0; py_failed = 0
    line = $0; gsub(/=/, "", line); sub(/ in [0-9.]+s.*/, "", line)
    num_parts = split(line, parts, /, /)
    for (i = 1; i <= num_parts; i++) {
      split(parts[i], word, / /)
      if (word[2] == "passed" || word[2] == "xfailed" || word[2] == "xpassed") py_passed += word[1]
      else if (word[2] == "failed" || word[2] ~ /^errors?$/) py_failed += word[1]
    }
    next
  }
  in_output { next }
  # The status: "Test Passed.", "Test Failed.", or "Test Pass Reason:" with the line that says why: a skip is
  # GoogleTest'"'"'s "[  SKIPPED ]" matched by the SKIP_REGULAR_EXPRESSION that gtest_discover_tests sets.
  in_test && /^Test [A-Z]/ {
    status = "failed"
    if ($0 ~ /^Test Passed/) status = "passed"
    else if ($0 ~ /^Test Pass Reason:/) status = ((getline line) > 0 && line ~ /^Skip regular expression/) ? "skipped" : "passed"
    if (pytest) {
      passed += py_passed; failed += py_failed
      # A suite that failed without counting a failure (a crash, a fixture) still failed.
      if (status == "failed" && py_failed == 0) failed += 1
      for (i = 1; i <= num_py_reasons; i++) skip(py_reason[i], py_count[i])
    } else if (status == "passed") passed += 1
    else if (status == "skipped") skip(gtest_reason == "" ? "no reason given" : gtest_reason, 1)
    else failed += 1
    in_test = 0; num_py_reasons = 0
  }
  END {
    if (skipped > 0) {
      # The reasons, most frequent first.
      line = ""
      for (done = 0; done < num_reasons; done++) {
        best = 0
        for (i = 1; i <= num_reasons; i++) if (!(i in used) && (best == 0 || count[order[i]] > count[order[best]])) best = i
        used[best] = 1
        line = line (done ? ", " : "") count[order[best]] " " order[best]
      }
      print "skipped: " line
    }
    printf "%d passed, %d failed, %d skipped\n", passed, failed, skipped
  }' "$log"
