// The split of a within-node dispatch's sender block between sending and own rows
// (src/kernels/dispatch_warp_roles.hpp).
#include <gtest/gtest.h>

#include "kernels/dispatch_warp_roles.hpp"

namespace epx::kernels {
namespace {

TEST(DispatchWarpRoles, NoneUnlessAskedAndNoneWithOneRank) {
  for (const int ranks : {1, 2, 8}) {
    const SenderWarpRoles roles = sender_warp_roles(16, ranks, 0);
    EXPECT_EQ(roles.send, 16);
    EXPECT_EQ(roles.own, 0);
  }
  EXPECT_EQ(sender_warp_roles(16, 1, 4).own, 0);
  EXPECT_EQ(sender_warp_roles(16, 2, -3).own, 0);
  EXPECT_EQ(sender_warp_roles(16, 2, 4).own, 4);
}

TEST(DispatchWarpRoles, EveryPeerKeepsASendingWarp) {
  for (const int ranks : {2, 3, 4, 8}) {
    for (int requested = 0; requested <= 20; ++requested) {
      const SenderWarpRoles roles = sender_warp_roles(16, ranks, requested);
      SCOPED_TRACE(::testing::Message() << ranks << " ranks, " << requested << " asked");
      EXPECT_EQ(roles.send + roles.own, 16);
      EXPECT_GE(roles.send / (ranks - 1), 1);
      EXPECT_EQ(roles.own, requested < 16 - (ranks - 1) ? requested : 16 - (ranks - 1));
    }
  }
}

// The default leaves every peer its group: a quarter of the warps with one peer, otherwise only the warps
// left over when the peers' groups are equal.
TEST(DispatchWarpRoles, DefaultKeepsThePeersGroups) {
  EXPECT_EQ(default_sender_own_warps(16, 1), 0);
  EXPECT_EQ(default_sender_own_warps(16, 2), 4);
  EXPECT_EQ(default_sender_own_warps(16, 3), 0);
  EXPECT_EQ(default_sender_own_warps(16, 4), 1);
  EXPECT_EQ(default_sender_own_warps(16, 8), 2);
  for (const int ranks : {3, 4, 5, 6, 7, 8}) {
    const SenderWarpRoles roles = sender_warp_roles(16, ranks, default_sender_own_warps(16, ranks));
    EXPECT_EQ(roles.send / (ranks - 1), 16 / (ranks - 1)) << ranks << " ranks";
  }
}

}  // namespace
}  // namespace epx::kernels
