#pragma once

#include <cuda_runtime.h>

#include <functional>
#include <memory>

namespace epx {

// How an operation is ordered against the caller's stream (DeepEP's previous_event / async_finish); every
// normal and low-latency call takes one.
struct StreamOrder {
  cudaStream_t compute_stream = nullptr;  // the caller's stream
  cudaEvent_t previous_event = nullptr;   // if set, the comm stream waits for it instead of compute_stream
  bool async_finish = false;              // true: return an event; false: compute_stream waits for the op
};

// A CUDA event shared by copies, destroyed with the last one. Empty when an operation finished synchronously.
class Event {
 public:
  Event() = default;
  // `on_synchronized` (optional) runs after every synchronize(), before a CUDA error is raised: an event an
  // EPX call returns raises its Buffer's failure there (Buffer::check_timeout), naming rank, peer and phase.
  static Event record(cudaStream_t stream, std::function<void()> on_synchronized = {});
  bool valid() const { return event_ != nullptr; }
  cudaEvent_t get() const { return event_.get(); }
  void wait_on(cudaStream_t stream) const;  // makes `stream` wait for this event
  void synchronize() const;

 private:
  std::shared_ptr<CUevent_st> event_;
  std::function<void()> on_synchronized_;
};

}  // namespace epx
