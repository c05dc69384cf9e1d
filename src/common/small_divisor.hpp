#pragma once

#include <cstdint>

#include "common/host_device.hpp"

namespace epx {

// x / d and x % d by one multiply-high, for a divisor fixed per call (experts per rank, top-k). A 32-bit
// division by a value the compiler does not know is about 25 dependent instructions on the GPU (I2F,
// MUFU.RCP, two IMAD.HI and the fix-ups); the low-latency routing divided each entry's expert twice that way.
// With m = ceil(2^32 / d) and e = m * d - 2^32 (0 <= e < d), x * m / 2^32 = x / d + x * e / (d * 2^32): for
// x = q * d + r the excess x * e / (d * 2^32) stays below 1 / d when x * e < 2^32, which r / d <= (d - 1) / d
// leaves room for, so floor(x * m / 2^32) = q. Exact whenever x * d < 2^32
// (tests/cpu/test_small_divisor.cpp).
struct SmallDivisor {
  uint32_t divisor = 1;
  uint32_t magic = 0;  // ceil(2^32 / divisor); 0 for a divisor of 1 (2^32 does not fit): div returns x

  SmallDivisor() = default;
  // d >= 1 (0 is taken as 1: nothing divides by it).
  EPX_HD explicit SmallDivisor(uint32_t d)
      : divisor(d > 1 ? d : 1), magic(d > 1 ? 0xffffffffu / d + 1u : 0u) {}

  // x / divisor, for x * divisor < 2^32.
  EPX_HD uint32_t div(uint32_t x) const {
    if (magic == 0) return x;
#if defined(__CUDA_ARCH__)
    return __umulhi(x, magic);
#else
    return static_cast<uint32_t>((uint64_t(x) * magic) >> 32);
#endif
  }
  // x % divisor, for x * divisor < 2^32.
  EPX_HD uint32_t mod(uint32_t x) const {
    return x - div(x) * divisor;
  }
};

}  // namespace epx
