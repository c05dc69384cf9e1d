#pragma once

#include <cuda_runtime.h>

#include <memory>

namespace epx {

// A CUDA event shared by copies, destroyed with the last one. Empty when an operation finished synchronously.
class Event {
 public:
  Event() = default;
  static Event record(cudaStream_t stream);
  bool valid() const { return event_ != nullptr; }
  cudaEvent_t get() const { return event_.get(); }
  void wait_on(cudaStream_t stream) const;  // makes `stream` wait for this event
  void synchronize() const;

 private:
  std::shared_ptr<CUevent_st> event_;
};

}  // namespace epx
