#include "core/wait_timeout.hpp"

#include <cmath>
#include <cstdlib>

#include "epx/error.hpp"

namespace epx {

uint64_t wait_timeout_ns_from_seconds(double seconds) {
  EPX_CHECK(!std::isnan(seconds), "wait_timeout_s", seconds, "must be a number");
  EPX_CHECK(seconds > 0, "wait_timeout_s", seconds, "must be > 0");
  // Half the 64-bit range: about 292 years, and `start + bound` comparisons stay clear of overflow.
  constexpr uint64_t kNever = UINT64_MAX / 2;
  if (seconds >= static_cast<double>(kNever) / 1e9) return kNever;
  const uint64_t ns = static_cast<uint64_t>(seconds * 1e9);
  return ns > 0 ? ns : 1;
}

double wait_timeout_seconds_from_text(const char* text, double fallback) {
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  const double seconds = std::strtod(text, &end);
  EPX_CHECK(end != text && *end == '\0', "EPX_WAIT_TIMEOUT_S", text, "must be a number of seconds");
  EPX_CHECK(!std::isnan(seconds), "EPX_WAIT_TIMEOUT_S", text, "must be a number of seconds");
  EPX_CHECK(seconds > 0, "EPX_WAIT_TIMEOUT_S", text, "must be > 0");
  return seconds;
}

}  // namespace epx
