#pragma once

#include "device/ptx.cuh"
#include "kernels/normal_kernels.hpp"

// Where one group leader of a normal-mode stream spends its cycles (EPX_NORMAL_PHASES=1): a tool for the
// measured breakdown of a dispatch or combine, not a feature. The leader of channel 0's first group marks the
// end of each step and, when its stream ends, adds its totals to the stream's PhaseReport in host-mapped
// memory (no printf: a kernel that can print may make its first launch wait for the device).
namespace epx::kernels {

struct PhaseClock {
  PhaseReport* report;  // null: off
  long long begin = 0;
  long long last = 0;
  long long spent[PhaseReport::kPhases] = {};

  // `reports` (DispatchArgs::phases, null when off); `leads` whether this thread leads the stream measured.
  __device__ PhaseClock(PhaseReport* reports, PhaseStream stream, bool leads)
      : report(reports != nullptr && leads ? reports + static_cast<int>(stream) : nullptr) {
    if (report != nullptr) begin = last = clock64();
  }
  __device__ bool on() const { return report != nullptr; }
  // The cycles since the last mark count for `phase`.
  __device__ void mark(int phase) {
    if (report == nullptr) return;
    const long long now = clock64();
    spent[phase] += now - last;
    last = now;
  }
  // Adds this launch's totals and the records it moved. One writer per report (one leader, launches in
  // stream order), so plain read-modify-writes suffice.
  __device__ void add_to_report(int records, int record_bytes) const {
    if (report == nullptr) return;
    volatile PhaseReport& r = *report;
    for (int p = 0; p < PhaseReport::kPhases; ++p) r.cycles[p] = r.cycles[p] + spent[p];
    r.total_cycles = r.total_cycles + (last - begin);
    r.records = r.records + records;
    r.record_bytes = record_bytes;
    r.launches = r.launches + 1;
    r.last_end_ns = device::global_timer_ns();  // no start time kept: a register more spilled across nodes
    r.last_cycles = last - begin;
  }
};

}  // namespace epx::kernels
