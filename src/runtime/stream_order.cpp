#include "runtime/stream_order.hpp"

#include "common/cuda_check.hpp"

namespace epx {

void begin_on_comm_stream(const Buffer& buffer, const StreamOrder& order) {
  if (order.previous_event != nullptr) {
    EPX_CUDA_CHECK(cudaStreamWaitEvent(buffer.comm_stream(), order.previous_event, 0));
  } else if (order.compute_stream != buffer.comm_stream()) {
    Event::record(order.compute_stream).wait_on(buffer.comm_stream());
  }
}

Event end_on_comm_stream(const Buffer& buffer, const StreamOrder& order) {
  Event done = Event::record(buffer.comm_stream());
  if (order.async_finish) return done;
  if (order.compute_stream != buffer.comm_stream()) done.wait_on(order.compute_stream);
  return Event{};
}

}  // namespace epx
