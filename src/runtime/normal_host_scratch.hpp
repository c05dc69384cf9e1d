#pragma once

#include <array>
#include <chrono>
#include <cstdint>

#include "buffer_map/internode_buffer_map.hpp"
#include "epx/buffer.hpp"
#include "kernels/normal_kernels.hpp"
#include "runtime/buffer_access.hpp"

namespace epx {

// What normal mode keeps in the Buffer's host-mapped scratch (BufferAccess::host_scratch): the one place its
// slots are carved.
struct NormalHostScratch {
  // Tagged counts of the last notify (HostCountIndex), written by the device.
  static constexpr int kMaxCountWords = 3 + kMaxInternodeRanks + kMaxExperts;
  uint64_t counts[kMaxCountWords];
  // Output pointers of a receive launched before the counts were known, written by the host.
  kernels::PublishedOutputs outputs;
  // 1 + the token index of an out-of-range expert id, written by the layout kernel (0: none).
  int invalid_id;
  // Host only: the sequence of the last notify (the same on every rank: notifies are collective).
  uint32_t notify_sequence;
  // Host only: the sequence of a receive launched by dispatch_notify whose outputs are not published yet.
  uint32_t pending_receive;
  // Host only: nanoseconds the host spent waiting for dispatch counts (the notify's or the layout board's),
  // summed over every call: what of a dispatch's host time is the count exchange, not the host's own work.
  uint64_t count_wait_ns;
  // Per normal-mode stream, where its channel-0 leader's cycles went (EPX_NORMAL_PHASES=1), written by the
  // device; read and zeroed by take_phase_reports.
  kernels::PhaseReport phases[kernels::kPhaseStreams];
  // Host only: the rows the last notify received (sizes the next one's rows allocation before its counts).
  int last_recv_rows;
  // Host only: what the last get_dispatch_layout posted to the layout board, under the sequence of the
  // notify after it (0: nothing). A notify whose inputs are these outputs reads its counts there.
  struct LayoutPost {
    const int* num_tokens_per_rank;
    const int* num_tokens_per_expert;
    int num_experts;
    uint32_t sequence;
  } layout_post;
};
static_assert(sizeof(NormalHostScratch) <= sizeof(int) * BufferAccess::kHostScratchInts,
              "BufferAccess::kHostScratchInts must hold NormalHostScratch");

inline NormalHostScratch& normal_host_scratch(const Buffer& buffer) {
  return *reinterpret_cast<NormalHostScratch*>(BufferAccess::host_scratch(buffer));
}

// Nanoseconds since `start` (the host's waits for counts: their bounds and NormalHostScratch::count_wait_ns).
inline uint64_t elapsed_ns(std::chrono::steady_clock::time_point start) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count());
}

// Whether the normal-mode kernels report their phases (EPX_NORMAL_PHASES=1, read once).
bool phase_reports_requested();

// The phase reports of this Buffer's normal-mode calls since the last take (all zero unless
// phase_reports_requested()), then zeroed. Call once those calls finished (after a stream sync). For the
// benchmark's breakdown rows.
std::array<kernels::PhaseReport, kernels::kPhaseStreams> take_phase_reports(const Buffer& buffer);

// The device's address of `field`, a member of the Buffer's NormalHostScratch.
template <typename T>
T* device_address(const Buffer& buffer, T* field) {
  const auto offset =
      reinterpret_cast<char*>(field) - reinterpret_cast<char*>(BufferAccess::host_scratch(buffer));
  return reinterpret_cast<T*>(reinterpret_cast<char*>(BufferAccess::host_scratch_device(buffer)) + offset);
}

}  // namespace epx
