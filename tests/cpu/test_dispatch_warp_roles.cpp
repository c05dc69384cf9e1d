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
  // Into the output window every sender warp sends at 2 ranks up to 168 in all (14 of 16 in each of 12
  // blocks, 11 in each of 16); with more ranks the leftover warps still copy.
  EXPECT_EQ(default_sender_own_warps(16, 2, true, 4), 0);
  EXPECT_EQ(default_sender_own_warps(16, 2, true, 8), 0);
  EXPECT_EQ(default_sender_own_warps(16, 2, true, 12), 2);
  EXPECT_EQ(default_sender_own_warps(16, 2, true, 16), 5);
  EXPECT_EQ(default_sender_own_warps(16, 2, true, 64), 13);
  EXPECT_EQ(default_sender_own_warps(16, 4, true, 16), 1);
  for (const int ranks : {3, 4, 5, 6, 7, 8}) {
    const SenderWarpRoles roles = sender_warp_roles(16, ranks, default_sender_own_warps(16, ranks));
    EXPECT_EQ(roles.send / (ranks - 1), 16 / (ranks - 1)) << ranks << " ranks";
  }
}

// By default the receiver's split is an equal share per rank (leftovers idle), except BF16 rows with 2
// ranks: a quarter of the warps on own rows, the other 12 on the arrived rows.
TEST(DispatchWarpRoles, ReceiverDefaultIsAnEqualShareButForBf16AtTwoRanks) {
  for (const int ranks : {2, 3, 4, 5, 6, 7, 8}) {
    for (const bool scaled : {false, true}) {
      const ReceiverWarpRoles roles = receiver_warp_roles(
          16, ranks, default_receiver_own_warps(16, ranks, scaled), default_sender_own_warps(16, ranks));
      const int own = ranks == 2 && !scaled ? 4 : 16 / ranks;
      EXPECT_EQ(roles.own, own) << ranks << " ranks, scaled " << scaled;
      EXPECT_EQ(roles.per_source, (16 - own) / (ranks - 1)) << ranks << " ranks, scaled " << scaled;
    }
  }
  EXPECT_EQ(receiver_warp_roles(16, 1, default_receiver_own_warps(16, 1, false), 0).own, 16);
  EXPECT_EQ(receiver_warp_roles(16, 1, -1, 0).per_source, 0);
}

// Asked for: the own warps are bounded so that every source keeps a warp and someone copies own rows (a
// receiver warp, unless the sender block has own-row warps); the sources share the rest equally and never
// more warps than the block has.
TEST(DispatchWarpRoles, ReceiverKeepsEverySourceAWarp) {
  for (const int ranks : {2, 3, 4, 8}) {
    for (const int sender_own : {0, 4}) {
      for (int requested = -1; requested <= 20; ++requested) {
        const ReceiverWarpRoles roles = receiver_warp_roles(16, ranks, requested, sender_own);
        SCOPED_TRACE(::testing::Message()
                     << ranks << " ranks, " << requested << " asked, sender " << sender_own);
        EXPECT_GE(roles.own + sender_own, 1);
        EXPECT_GE(roles.own, sender_own > 0 ? 0 : 1);
        EXPECT_GE(roles.per_source, 1);
        EXPECT_LE(roles.own + roles.per_source * (ranks - 1), 16);
        if (requested >= (sender_own > 0 ? 0 : 1) && requested <= 16 - (ranks - 1)) {
          EXPECT_EQ(roles.own, requested);
        }
      }
    }
  }
  EXPECT_EQ(receiver_warp_roles(16, 2, 4, 4).per_source, 12);
  // None on the receiver: all 16 warps receive from the one peer; the sender's own-row warps copy every own
  // row.
  EXPECT_EQ(receiver_warp_roles(16, 2, 0, 4).own, 0);
  EXPECT_EQ(receiver_warp_roles(16, 2, 0, 4).per_source, 16);
  // Without sender own-row warps a receiver warp still copies them.
  EXPECT_EQ(receiver_warp_roles(16, 2, 0, 0).own, 1);
}

}  // namespace
}  // namespace epx::kernels
