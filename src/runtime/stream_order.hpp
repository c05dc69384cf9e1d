#pragma once

#include "epx/buffer.hpp"
#include "epx/event.hpp"

namespace epx {

// Start of an operation: the comm stream waits for `previous_event`, or else for the caller's stream.
void begin_on_comm_stream(const Buffer& buffer, const StreamOrder& order);
// End: with async_finish, an event the caller can wait on; otherwise the caller's stream waits for the
// comm stream and the returned Event is empty.
Event end_on_comm_stream(const Buffer& buffer, const StreamOrder& order);

}  // namespace epx
