#pragma once

#include <cstdio>

// Where one group leader of a normal-mode stream spends its cycles (EPX_NORMAL_PHASES=1 in a build configured
// with -DEPX_PHASE_CLOCK=ON; other builds compile it away): a tool for the measured breakdown of a dispatch
// or combine, not a feature. The leader marks the end of each step; channel 0 prints its totals when the
// stream ends, so a run shows what each of its steps costs against the whole.
namespace epx::kernels {

struct PhaseClock {
  static constexpr int kPhases = 3;
  bool on = false;
  long long begin = 0;
  long long last = 0;
  long long spent[kPhases] = {};

#ifdef EPX_PHASE_CLOCK
  __device__ explicit PhaseClock(bool enabled) : on(enabled) {
    if (on) begin = last = clock64();
  }
  // The cycles since the last mark count for `phase`.
  __device__ void mark(int phase) {
    if (!on) return;
    const long long now = clock64();
    spent[phase] += now - last;
    last = now;
  }
  // One line: `what`, the group, cycles per phase (named by `names`) and in all, the records moved and their
  // bytes.
  __device__ void print(const char* what, int group, const char* names, int records, int record_bytes) const {
    if (!on) return;
    printf("epx-phases %s group %d: %s = %lld %lld %lld cycles of %lld, %d records of %d bytes\n", what,
           group, names, spent[0], spent[1], spent[2], last - begin, records, record_bytes);
  }
#else
  __device__ explicit PhaseClock(bool) {}
  __device__ void mark(int) {}
  __device__ void print(const char*, int, const char*, int, int) const {}
#endif
};

}  // namespace epx::kernels
