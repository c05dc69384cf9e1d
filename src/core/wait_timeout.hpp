#pragma once

#include <cstdint>

namespace epx {

// The bound of every device wait, in nanoseconds, from seconds: `seconds` must be > 0 (and not NaN); a bound
// beyond what the device's 64-bit nanosecond timer can express (infinity included) means "never give up"
// rather than wrapping to a tiny value.
uint64_t wait_timeout_ns_from_seconds(double seconds);

// The seconds of EPX_WAIT_TIMEOUT_S as text (`fallback` when unset or empty); throws epx::Error naming the
// variable for text that is not a number > 0.
double wait_timeout_seconds_from_text(const char* text, double fallback);

}  // namespace epx
