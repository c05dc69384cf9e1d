#include "runtime/stream_order.hpp"

#include "gpu/cuda_check.hpp"
#include "runtime/buffer_access.hpp"
#include "runtime/low_latency_state.hpp"

namespace epx {

void begin_on_comm_stream(const Buffer& buffer, const StreamOrder& order) {
  LowLatencyState& state = *BufferAccess::low_latency_state(buffer);
  // Calls launched straight on the joined stream are ordered only on it: when this call would not wait for
  // that stream (a previous event, another caller stream), the comm stream waits for the latest of them.
  if (state.launched_on_joined &&
      (order.previous_event != nullptr || state.joined_stream != order.compute_stream)) {
    EPX_CUDA_CHECK(cudaStreamWaitEvent(buffer.comm_stream(), BufferAccess::ordering_event(buffer, 2), 0));
  }
  state.joined_stream.reset();  // until end_on_comm_stream joins
  state.launched_on_joined = false;
  if (order.previous_event != nullptr) {
    EPX_CUDA_CHECK(cudaStreamWaitEvent(buffer.comm_stream(), order.previous_event, 0));
  } else if (order.compute_stream != buffer.comm_stream()) {
    EPX_CUDA_CHECK(cudaEventRecord(BufferAccess::ordering_event(buffer, 0), order.compute_stream));
    EPX_CUDA_CHECK(cudaStreamWaitEvent(buffer.comm_stream(), BufferAccess::ordering_event(buffer, 0), 0));
  }
}

Event end_on_comm_stream(const Buffer& buffer, const StreamOrder& order) {
  if (order.async_finish) {
    // The caller's own event; its synchronize() raises the Buffer's failure. The shared state outlives the
    // Buffer and forgets it at destroy().
    return Event::record(buffer.comm_stream(), [state = BufferAccess::low_latency_state(buffer)] {
      if (state->buffer != nullptr) state->buffer->check_timeout();
    });
  }
  if (order.compute_stream != buffer.comm_stream()) {
    EPX_CUDA_CHECK(cudaEventRecord(BufferAccess::ordering_event(buffer, 1), buffer.comm_stream()));
    EPX_CUDA_CHECK(cudaStreamWaitEvent(order.compute_stream, BufferAccess::ordering_event(buffer, 1), 0));
  }
  BufferAccess::low_latency_state(buffer)->joined_stream = order.compute_stream;
  return Event{};
}

}  // namespace epx
