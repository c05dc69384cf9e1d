#include "epx/event.hpp"

#include "common/cuda_check.hpp"

namespace epx {

Event Event::record(cudaStream_t stream) {
  cudaEvent_t raw = nullptr;
  EPX_CUDA_CHECK(cudaEventCreateWithFlags(&raw, cudaEventDisableTiming));
  Event event;
  event.event_ = std::shared_ptr<CUevent_st>(raw, [](cudaEvent_t e) { cudaEventDestroy(e); });
  EPX_CUDA_CHECK(cudaEventRecord(raw, stream));
  return event;
}

void Event::wait_on(cudaStream_t stream) const {
  if (event_) EPX_CUDA_CHECK(cudaStreamWaitEvent(stream, event_.get(), 0));
}

void Event::synchronize() const {
  if (event_) EPX_CUDA_CHECK(cudaEventSynchronize(event_.get()));
}

}  // namespace epx
