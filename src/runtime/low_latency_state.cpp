#include "runtime/low_latency_state.hpp"

#include <utility>

#include "epx/buffer.hpp"
#include "epx/error.hpp"
#include "runtime/buffer_access.hpp"

namespace epx {

struct LowLatencyRecvHook::State {
  std::shared_ptr<LowLatencyState> owner;
  uint64_t call = 0;
  int half = 0;
  std::function<void(cudaStream_t)> launch_receive;
  bool done = false;
};

void check_low_latency_half_free(const LowLatencyState& state, int half) {
  const uint64_t pending = state.pending_call[half];
  if (pending != 0) {
    EPX_FAIL("low-latency call #", state.num_calls, " needs buffer half ", half,
             ", but the receive hook of call #", pending - 1,
             " on that half has not run: run it first (at most two low-latency results may be pending)");
  }
}

void restart_low_latency_calls(LowLatencyState& state) {
  state.num_calls = 0;
  state.pending_call[0] = state.pending_call[1] = 0;
  state.needs_clean = false;
}

void check_low_latency_signals_clean(const LowLatencyState& state) {
  if (state.needs_clean) {
    EPX_FAIL(
        "low-latency call #", state.num_calls,
        " after normal-mode calls across nodes: they share the symmetric buffer, so every rank must call "
        "clean_low_latency_buffer() between them (collective)");
  }
}

void lend_symmetric_buffer_to_normal_mode(LowLatencyState& state) {
  for (int half = 0; half < 2; ++half) {
    if (state.pending_call[half] != 0) {
      EPX_FAIL(
          "normal mode across nodes needs the symmetric buffer, but the receive hook of low-latency call #",
          state.pending_call[half] - 1, " has not run: run it first");
    }
  }
  state.needs_clean = true;
}

LowLatencyRecvHook make_low_latency_hook(std::shared_ptr<LowLatencyState> state, uint64_t call, int half,
                                         std::function<void(cudaStream_t)> launch_receive) {
  auto hook = std::make_shared<LowLatencyRecvHook::State>();
  state->pending_call[half] = call + 1;
  hook->owner = std::move(state);
  hook->call = call;
  hook->half = half;
  hook->launch_receive = std::move(launch_receive);
  return LowLatencyRecvHook(std::move(hook));
}

bool LowLatencyRecvHook::done() const {
  return state_ != nullptr && state_->done;
}

void LowLatencyRecvHook::operator()(cudaStream_t stream) const {
  EPX_CHECK(state_ != nullptr, "hook", "empty", "must come from a call with return_recv_hook");
  EPX_CHECK(!state_->done, "hook", "already run", "a receive hook runs once");
  LowLatencyState& owner = *state_->owner;
  if (owner.buffer == nullptr) {
    EPX_FAIL("the receive hook of low-latency call #", state_->call, " runs after its Buffer was destroyed");
  }
  const ExclusiveUse::Claim claim = BufferAccess::enter_call(*owner.buffer, "a low-latency receive hook");
  if (owner.pending_call[state_->half] != state_->call + 1) {
    EPX_FAIL("the receive hook of low-latency call #", state_->call,
             " is stale: clean_low_latency_buffer() or reset() was called after it");
  }
  state_->launch_receive(stream);
  state_->done = true;
  owner.pending_call[state_->half] = 0;
}

}  // namespace epx
