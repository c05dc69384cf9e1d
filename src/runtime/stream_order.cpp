#include "runtime/stream_order.hpp"

#include "gpu/cuda_check.hpp"
#include "runtime/buffer_access.hpp"
#include "runtime/low_latency_state.hpp"

namespace epx {

void begin_on_comm_stream(const Buffer& buffer, const StreamOrder& order) {
  LowLatencyState& state = *BufferAccess::low_latency_state(buffer);
  const bool waits_for_caller =
      order.previous_event == nullptr && order.compute_stream != buffer.comm_stream();
  if (state.joined_stream_has_calls && !(waits_for_caller && order.compute_stream == state.joined_stream)) {
    // Earlier calls went straight onto another stream (or the caller orders this one by an event): the comm
    // stream waits for the last of them (recorded after its launch, so not for the stream's later work, and
    // the stream may be gone by now).
    EPX_CUDA_CHECK(cudaStreamWaitEvent(buffer.comm_stream(), BufferAccess::ordering_event(buffer, 2), 0));
  }
  state.joined_stream_has_calls = false;
  state.joined_stream.reset();  // until end_on_comm_stream joins
  if (order.previous_event != nullptr) {
    EPX_CUDA_CHECK(cudaStreamWaitEvent(buffer.comm_stream(), order.previous_event, 0));
  } else if (order.compute_stream != buffer.comm_stream()) {
    EPX_CUDA_CHECK(cudaEventRecord(BufferAccess::ordering_event(buffer, 0), order.compute_stream));
    EPX_CUDA_CHECK(cudaStreamWaitEvent(buffer.comm_stream(), BufferAccess::ordering_event(buffer, 0), 0));
  }
}

namespace {

// The end of an operation on `stream`: with async_finish, an event the caller can wait on; otherwise the
// caller's stream waits for `stream` (when it is another) and the returned Event is empty.
Event end_on(const Buffer& buffer, const StreamOrder& order, cudaStream_t stream) {
  if (order.async_finish) {
    // The caller's own event; its synchronize() raises the Buffer's failure. The shared state outlives the
    // Buffer and forgets it at destroy().
    return Event::record(stream, [state = BufferAccess::low_latency_state(buffer)] {
      if (state->buffer != nullptr) state->buffer->check_timeout();
    });
  }
  if (order.compute_stream != stream) {
    EPX_CUDA_CHECK(cudaEventRecord(BufferAccess::ordering_event(buffer, 1), stream));
    EPX_CUDA_CHECK(cudaStreamWaitEvent(order.compute_stream, BufferAccess::ordering_event(buffer, 1), 0));
  }
  return Event{};
}

}  // namespace

Event end_on_comm_stream(const Buffer& buffer, const StreamOrder& order) {
  Event event = end_on(buffer, order, buffer.comm_stream());
  if (!order.async_finish) BufferAccess::low_latency_state(buffer)->joined_stream = order.compute_stream;
  return event;
}

cudaStream_t begin_operation(const Buffer& buffer, const StreamOrder& order) {
  LowLatencyState& state = *BufferAccess::low_latency_state(buffer);
  if (!order.async_finish && order.previous_event == nullptr && state.joined_stream == order.compute_stream)
    return order.compute_stream;
  begin_on_comm_stream(buffer, order);
  return buffer.comm_stream();
}

void mark_launched(const Buffer& buffer, cudaStream_t stream) {
  if (stream == buffer.comm_stream()) return;
  EPX_CUDA_CHECK(cudaEventRecord(BufferAccess::ordering_event(buffer, 2), stream));
  BufferAccess::low_latency_state(buffer)->joined_stream_has_calls = true;
}

Event end_operation(const Buffer& buffer, const StreamOrder& order, cudaStream_t stream, bool marked) {
  if (stream == buffer.comm_stream()) return end_on_comm_stream(buffer, order);
  // A caller's stream, which stays joined (a receive whose notify went onto it may end on another stream).
  if (!marked) mark_launched(buffer, stream);
  return end_on(buffer, order, stream);
}

}  // namespace epx
