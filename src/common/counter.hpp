#pragma once

#include <cstdint>

#include "common/host_device.hpp"

namespace epx {

// Whether a counter that only grows has reached `target`: value >= target modulo 2^32 (the difference read as
// signed), so a counter that wraps still compares right while it is within 2^31 of the target.
EPX_HD bool counter_reached(int value, int target) {
  return static_cast<int>(static_cast<uint32_t>(value) - static_cast<uint32_t>(target)) >= 0;
}

}  // namespace epx
