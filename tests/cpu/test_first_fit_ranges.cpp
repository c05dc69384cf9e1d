#include "core/first_fit_ranges.hpp"

#include <gtest/gtest.h>

namespace epx {
namespace {

TEST(FirstFitRanges, TakesTheLowestRangeThatFitsRoundedToTheAlignment) {
  FirstFitRanges ranges(4096 + 100, 512);  // the tail past the last whole 512 bytes is never handed out
  EXPECT_EQ(ranges.take(1), 0);
  EXPECT_EQ(ranges.take(512), 512);
  EXPECT_EQ(ranges.take(513), 1024);  // two units
  EXPECT_EQ(ranges.taken(), 512 + 512 + 1024);
  EXPECT_EQ(ranges.take(2049), -1);  // 2,048 left: 2,049 bytes take 2,560
  EXPECT_EQ(ranges.take(1536), 2048);
  EXPECT_EQ(ranges.take(1), 3584);
  EXPECT_EQ(ranges.take(1), -1);
  EXPECT_EQ(ranges.take(0), -1);
  EXPECT_EQ(ranges.take(-5), -1);
}

TEST(FirstFitRanges, RangesGivenBackMergeWithTheirFreeNeighbours) {
  FirstFitRanges ranges(4 * 512, 512);
  const int64_t a = ranges.take(512), b = ranges.take(512), c = ranges.take(512), d = ranges.take(512);
  EXPECT_EQ(ranges.take(1), -1);
  ranges.give_back(b);
  ranges.give_back(d);
  EXPECT_EQ(ranges.free_ranges(), 2u);
  EXPECT_EQ(ranges.take(1024), -1);  // two free units, apart
  ranges.give_back(c);               // joins b's and d's
  EXPECT_EQ(ranges.free_ranges(), 1u);
  EXPECT_EQ(ranges.take(1536), b);
  ranges.give_back(a);
  ranges.give_back(b);
  EXPECT_EQ(ranges.free_ranges(), 1u);
  EXPECT_EQ(ranges.taken(), 0);
  EXPECT_EQ(ranges.take(2048), 0);
}

TEST(FirstFitRanges, AnOffsetNotTakenIsIgnored) {
  FirstFitRanges ranges(2048, 512);
  const int64_t a = ranges.take(512);
  ranges.give_back(a + 512);  // never taken
  ranges.give_back(a);
  ranges.give_back(a);  // twice
  EXPECT_EQ(ranges.taken(), 0);
  EXPECT_EQ(ranges.free_ranges(), 1u);
  EXPECT_EQ(ranges.take(2048), 0);
}

TEST(FirstFitRanges, AnEmptySpanHasNothingToTake) {
  FirstFitRanges none(100, 512);
  EXPECT_EQ(none.take(1), -1);
  FirstFitRanges negative(-1, 512);
  EXPECT_EQ(negative.take(1), -1);
}

}  // namespace
}  // namespace epx
