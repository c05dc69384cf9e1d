#pragma once

#include "epx/buffer.hpp"
#include "epx/event.hpp"

namespace epx {

// Start of an operation: the comm stream waits for `previous_event`, or else for the caller's stream.
void begin_on_comm_stream(const Buffer& buffer, const StreamOrder& order);
// End: with async_finish, an event the caller can wait on; otherwise the caller's stream waits for the
// comm stream and the returned Event is empty.
Event end_on_comm_stream(const Buffer& buffer, const StreamOrder& order);

// Where an operation's kernels go: straight onto the caller's stream when it returns no event, waits for no
// previous_event and every earlier operation is already ordered before that stream's next work (the last one
// joined it); the comm stream would then add two cross-stream hops (four driver calls) and change nothing the
// caller can see. Otherwise onto the comm stream, ordered by begin_on_comm_stream.
cudaStream_t begin_operation(const Buffer& buffer, const StreamOrder& order);
// After kernels went onto `stream` (begin_operation's): where that is a caller's stream, an event recorded
// there marks them, for the comm stream's next work to wait for (begin_on_comm_stream).
void mark_launched(const Buffer& buffer, cudaStream_t stream);
// The end of an operation whose kernels went onto `stream` (begin_operation's); marks them unless `marked`
// (mark_launched ran right after their launch).
Event end_operation(const Buffer& buffer, const StreamOrder& order, cudaStream_t stream, bool marked = false);

}  // namespace epx
