#include <gtest/gtest.h>

#include <random>

#include "kernels/window_cut.hpp"

namespace {

using epx::kernels::tokens_within_room;
using epx::kernels::window_bits;

TEST(WindowCut, WindowBitsAreTheTokensBelowTheWidth) {
  EXPECT_EQ(window_bits(0), 0u);
  EXPECT_EQ(window_bits(1), 1u);
  EXPECT_EQ(window_bits(5), 0b11111u);
  EXPECT_EQ(window_bits(31), 0x7fffffffu);
  EXPECT_EQ(window_bits(32), ~0u);
}

TEST(WindowCut, TakesEverythingThereIsRoomFor) {
  EXPECT_EQ(tokens_within_room(0u, 0, 32), 32);
  EXPECT_EQ(tokens_within_room(0b1011u, 3, 32), 32);
  EXPECT_EQ(tokens_within_room(0b1011u, 3, 4), 4);
}

TEST(WindowCut, StopsRightBeforeTheFirstTokenPastTheRoom) {
  EXPECT_EQ(tokens_within_room(0b1011u, 0, 32), 0);  // token 0 is needed, no room
  EXPECT_EQ(tokens_within_room(0b1010u, 0, 32), 1);  // token 0 passes freely
  EXPECT_EQ(tokens_within_room(0b1011u, 2, 32), 3);  // tokens 0 and 1 fit, 3 does not
  EXPECT_EQ(tokens_within_room(1u << 31, 0, 32), 31);
}

// Random windows: what is taken fits the room, and one token more would not.
TEST(WindowCut, IsTheLongestPrefixThatFits) {
  std::mt19937 random(7);
  for (int trial = 0; trial < 20000; ++trial) {
    const int full = 1 + static_cast<int>(random() % 32);
    const unsigned needs =
        static_cast<unsigned>(random()) & static_cast<unsigned>(random()) & window_bits(full);
    const int room = static_cast<int>(random() % 34);
    const int taken = tokens_within_room(needs, room, full);
    ASSERT_GE(taken, 0);
    ASSERT_LE(taken, full);
    ASSERT_LE(__builtin_popcount(needs & window_bits(taken)), room) << needs << " " << room << " " << full;
    if (taken < full) {
      ASSERT_GT(__builtin_popcount(needs & window_bits(taken + 1)), room) << needs << " " << room;
    }
  }
}

}  // namespace
