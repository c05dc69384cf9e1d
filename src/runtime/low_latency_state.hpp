#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>

#include "epx/low_latency.hpp"

namespace epx {

// Host side of the low-latency protocol of one Buffer (BufferAccess::low_latency_state): which half the next
// call uses and which halves still wait for a receive hook. The device side (monotonic signals) lives in the
// buffer's control area.
struct LowLatencyState {
  uint64_t num_calls = 0;             // low-latency calls issued; call n uses half n & 1
  uint64_t pending_call[2] = {0, 0};  // 1 + the call whose receive has not run on that half, 0 = none
  // A normal-mode call across nodes ran since the last clean: it wrote its queues over the low-latency
  // signals (one symmetric buffer serves both modes, LowLatencyBufferMap), so low-latency calls wait for a
  // clean.
  bool needs_clean = false;
  // The caller's stream the last call joined the comm stream into (every call issued so far is ordered before
  // work queued there next), if the last call ended that way: a low-latency call that returns no event may
  // then launch straight on that stream, saving the two cross-stream hops of the comm stream.
  std::optional<cudaStream_t> joined_stream;
  // A call launched straight on joined_stream (not the comm stream, not captured) since it joined;
  // BufferAccess::ordering_event(buffer, 2) was recorded behind it there. The comm stream's next work waits
  // for that event, unless it waits for the caller's stream and that is joined_stream.
  bool launched_on_joined = false;
  // EPX_LL_PHASE_STAMPS=1 at construction: device memory the kernels stamp their phases into
  // ([kMaxPhaseStampBlocks][kNumPhaseStamps], kernels::LowLatencyStamp, for epx-bench), else null.
  std::shared_ptr<uint64_t> phase_stamps;
  int max_smem_bytes = 0;          // the device's opt-in shared memory per block
  const Buffer* buffer = nullptr;  // the owner until destroy(): hooks check it before they launch
};

// Marks `half` busy until the returned hook runs `launch_receive`.
LowLatencyRecvHook make_low_latency_hook(std::shared_ptr<LowLatencyState> state, uint64_t call, int half,
                                         std::function<void(cudaStream_t)> launch_receive);

// Throws unless `half` is free for `call` (no earlier call's receive pending on it).
void check_low_latency_half_free(const LowLatencyState& state, int half);

// The signals are clean again (clean_low_latency_buffer, reset): the call sequence restarts at 0 on every
// rank, no receive is pending, and normal mode's writes no longer stand between.
void restart_low_latency_calls(LowLatencyState& state);

// Throws when a normal-mode call across nodes ran since the last clean_low_latency_buffer().
void check_low_latency_signals_clean(const LowLatencyState& state);

// A normal-mode call across nodes is about to use the symmetric buffer's shared area: throws while a
// low-latency receive is still pending (its messages live there), else marks the low-latency signals for a
// clean.
void lend_symmetric_buffer_to_normal_mode(LowLatencyState& state);

}  // namespace epx
