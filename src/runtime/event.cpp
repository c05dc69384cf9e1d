#include "epx/event.hpp"

#include <utility>

#include "gpu/cuda_check.hpp"

namespace epx {

Event Event::record(cudaStream_t stream, std::function<void()> on_synchronized) {
  cudaEvent_t raw = nullptr;
  EPX_CUDA_CHECK(cudaEventCreateWithFlags(&raw, cudaEventDisableTiming));
  Event event;
  event.event_ = std::shared_ptr<CUevent_st>(raw, [](cudaEvent_t e) { cudaEventDestroy(e); });
  event.on_synchronized_ = std::move(on_synchronized);
  EPX_CUDA_CHECK(cudaEventRecord(raw, stream));
  return event;
}

void Event::wait_on(cudaStream_t stream) const {
  if (event_) EPX_CUDA_CHECK(cudaStreamWaitEvent(stream, event_.get(), 0));
}

void Event::synchronize() const {
  if (!event_) return;
  const cudaError_t status = cudaEventSynchronize(event_.get());
  if (on_synchronized_) on_synchronized_();
  EPX_CUDA_CHECK(status);
}

}  // namespace epx
