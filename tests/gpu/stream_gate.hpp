#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

#include "gpu/cuda_check.hpp"

namespace epx::test {

// Holds a stream at a host callback until release(), or until a timeout: a library call that wrongly waits
// for the held stream (or for the device) then only stalls until the timeout and shows up as timed_out().
class StreamGate {
 public:
  explicit StreamGate(cudaStream_t stream, std::chrono::milliseconds timeout = std::chrono::seconds(10))
      : stream_(stream), state_(std::make_unique<State>()) {
    state_->timeout = timeout;
    EPX_CUDA_CHECK(cudaLaunchHostFunc(stream, &StreamGate::hold, state_.get()));
  }
  StreamGate(const StreamGate&) = delete;
  StreamGate& operator=(const StreamGate&) = delete;
  // The callback reads the state: it must have run before the state goes.
  ~StreamGate() {
    release();
    cudaStreamSynchronize(stream_);
  }
  void release() { state_->released.store(true, std::memory_order_release); }
  // Meaningful once the stream has passed the gate.
  bool timed_out() const { return state_->timed_out.load(std::memory_order_acquire); }

 private:
  struct State {
    std::atomic<bool> released{false};
    std::atomic<bool> timed_out{false};
    std::chrono::milliseconds timeout{0};
  };
  static void CUDART_CB hold(void* raw) {
    auto* state = static_cast<State*>(raw);
    const auto deadline = std::chrono::steady_clock::now() + state->timeout;
    while (!state->released.load(std::memory_order_acquire)) {
      if (std::chrono::steady_clock::now() > deadline) {
        state->timed_out.store(true, std::memory_order_release);
        return;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  cudaStream_t stream_;
  std::unique_ptr<State> state_;
};

}  // namespace epx::test
