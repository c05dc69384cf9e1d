#include <gtest/gtest.h>

#include <vector>

#include "core/direct_ranks.hpp"

namespace {

using epx::direct_ranks;

// 4 ranks as 2 nodes of 2 (ranks 0-1, 2-3).
constexpr uint64_t kNode0 = 0b0011, kNode1 = 0b1100;

TEST(DirectRanks, EveryRankWhereAllMapEachOther) {
  const std::vector<uint64_t> maps(4, 0b1111);  // one host: P2P everywhere
  EXPECT_EQ(direct_ranks(maps, 0, kNode0, false), 0b1111u);
  EXPECT_EQ(direct_ranks(maps, 3, kNode1, false), 0b1111u);
}

TEST(DirectRanks, TheNodeAloneWithPutsOnlyOrWithoutAMapping) {
  const std::vector<uint64_t> maps(4, 0b1111);
  EXPECT_EQ(direct_ranks(maps, 1, kNode0, true), kNode0);
  const std::vector<uint64_t> nodes_only{kNode0, kNode0, kNode1, kNode1};  // a NIC between the nodes
  EXPECT_EQ(direct_ranks(nodes_only, 2, kNode1, false), kNode1);
}

// A mapping one way only (rank 2 maps rank 0, not the other way): neither stores into the other, so each
// reads the other's rows as the other sends them.
TEST(DirectRanks, OneWayMappingsArePuts) {
  const std::vector<uint64_t> maps{kNode0, kNode0, kNode1 | 0b0001, kNode1};
  EXPECT_EQ(direct_ranks(maps, 2, kNode1, false), kNode1);
  EXPECT_EQ(direct_ranks(maps, 0, kNode0, false), kNode0);
  for (int r = 0; r < 4; ++r) {
    const uint64_t node = r < 2 ? kNode0 : kNode1;
    for (int q = 0; q < 4; ++q) {
      const uint64_t q_node = q < 2 ? kNode0 : kNode1;
      EXPECT_EQ((direct_ranks(maps, r, node, false) >> q) & 1u,
                (direct_ranks(maps, q, q_node, false) >> r) & 1u)
          << r << " " << q;
    }
  }
}

}  // namespace
