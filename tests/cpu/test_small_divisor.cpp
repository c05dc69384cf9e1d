// SmallDivisor (src/common/small_divisor.hpp): the multiply-high division the low-latency kernels use for the
// experts per rank and the top-k matches plain division wherever x * d < 2^32.
#include <gtest/gtest.h>

#include <cstdint>

#include "common/small_divisor.hpp"

namespace {

using epx::SmallDivisor;

void expect_exact(uint32_t d, uint32_t x) {
  const SmallDivisor divisor(d);
  ASSERT_EQ(divisor.div(x), x / d) << x << " / " << d;
  ASSERT_EQ(divisor.mod(x), x % d) << x << " % " << d;
}

// Every expert id of every experts-per-rank count the low-latency map allows (E <= 4096).
TEST(SmallDivisor, EveryExpertOfEveryExpertsPerRank) {
  for (uint32_t d = 1; d <= 4096; ++d)
    for (uint32_t x = 0; x < 4096; ++x) expect_exact(d, x);
}

// Top-k entries: up to 65,536 tokens of 16 positions.
TEST(SmallDivisor, EveryTopkEntry) {
  for (uint32_t d = 1; d <= 16; ++d)
    for (uint32_t x = 0; x < (1u << 20); ++x) expect_exact(d, x);
}

// The bound itself: the largest x with x * d < 2^32, and around powers of two, for divisors of every size.
TEST(SmallDivisor, UpToTheBound) {
  for (uint32_t d :
       {1u,          2u,         3u,   5u,    7u,    9u,    15u,    16u,    17u,    36u,      100u,
        255u,        256u,       257u, 1000u, 4095u, 4096u, 65535u, 65536u, 65537u, 1u << 20, (1u << 20) + 1,
        0x7fffffffu, 0xffffffffu}) {
    const uint32_t top =
        static_cast<uint32_t>((uint64_t(1) << 32) / d - ((uint64_t(1) << 32) % d == 0 ? 1 : 0));
    for (uint32_t k = 0; k < 64 && k <= top; ++k) expect_exact(d, top - k);
    for (int b = 0; b < 32; ++b) {
      const uint64_t p = uint64_t(1) << b;
      for (uint64_t x = p > 2 ? p - 2 : 0; x <= p + 2; ++x)
        if (x * d < (uint64_t(1) << 32)) expect_exact(d, static_cast<uint32_t>(x));
    }
  }
}

TEST(SmallDivisor, ZeroIsOne) {
  const SmallDivisor divisor(0);
  EXPECT_EQ(divisor.div(7), 7u);
  EXPECT_EQ(divisor.mod(7), 0u);
}

}  // namespace
