// The split of a within-node combine's work between its two blocks (src/kernels/combine_warp_roles.hpp): the
// sender block's reducing warps, the batches both parts take, and a simulation of one queue with two
// reducers that shows every schedule finishing.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "kernels/combine_warp_roles.hpp"

namespace epx::kernels {
namespace {

TEST(CombineWarpRoles, EveryPeerKeepsASendingWarp) {
  EXPECT_EQ(combine_sender_roles(16, 1, 4).reduce, 0);
  EXPECT_EQ(combine_sender_roles(16, 2, 0).reduce, 0);
  for (const int ranks : {2, 3, 4, 8}) {
    for (int requested = -1; requested <= 20; ++requested) {
      const CombineSenderRoles roles = combine_sender_roles(16, ranks, requested);
      SCOPED_TRACE(::testing::Message() << ranks << " ranks, " << requested << " asked");
      EXPECT_EQ(roles.send + roles.reduce, 16);
      EXPECT_GE(roles.send / (ranks - 1), 1);
      EXPECT_GE(roles.reduce, 0);
      if (requested >= 0) {
        EXPECT_EQ(roles.reduce, std::min(requested, 16 - (ranks - 1)));
      }
    }
  }
}

// A quarter with one peer; otherwise only what the peers' equal groups leave.
TEST(CombineWarpRoles, DefaultKeepsThePeersGroups) {
  EXPECT_EQ(combine_sender_roles(16, 2, -1).reduce, 4);
  EXPECT_EQ(combine_sender_roles(16, 3, -1).reduce, 0);
  EXPECT_EQ(combine_sender_roles(16, 4, -1).reduce, 1);
  EXPECT_EQ(combine_sender_roles(16, 8, -1).reduce, 2);
}

TEST(CombineBatches, EachBatchFitsTheQueueAndTheyAlternate) {
  for (const int queue : {1, 2, 7, 16, 63, 64, 128, 256, 1024}) {
    for (const int second : {0, 1, 4, 9}) {
      const CombineBatches b = combine_batches(queue, 16, second);
      SCOPED_TRACE(::testing::Message() << "queue " << queue << ", second part " << second << " warps");
      EXPECT_GE(b.per_warp, 1);
      EXPECT_LE(b.per_warp, kMaxCombineTokensPerWarp);
      EXPECT_LE(b.size[0], queue);
      EXPECT_LE(b.size[1], queue);
      EXPECT_GE(b.size[0], 1);
      EXPECT_EQ(b.size[1] == 0, second == 0);
      if (queue >= 64) {
        EXPECT_LE(b.size[0], queue / 4);  // room for the sender while a batch is reduced
      }
      EXPECT_EQ(b.start(0, 0), 0);
      EXPECT_EQ(b.start(1, 0), b.size[0]);
      EXPECT_EQ(b.start(0, 3), 3 * b.cycle());
      EXPECT_EQ(b.start(1, 2), 2 * b.cycle() + b.size[0]);
    }
  }
}

// One source's queue of `queue` records to a rank whose two parts reduce alternate batches of a channel's
// tokens (a random subset of which the source holds a copy of, each one record in token order). The source
// writes a record when it fits above the smaller of the parts' words (records before each part's next
// batch); a part finishes a batch once all of its records were written. Steps are taken in random order:
// every schedule ends with all tokens reduced (no deadlock) and no record overwritten before it was used.
TEST(CombineBatches, TwoReducersNeverDeadlock) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int queue = 1 + static_cast<int>(rng() % 96);
    const int second = static_cast<int>(rng() % 6);
    const int tokens = static_cast<int>(rng() % 400);
    const double held = (rng() % 4) / 3.0;  // the fraction of tokens the source holds copies of
    const CombineBatches b = combine_batches(queue, 16, second);
    std::vector<int> entry(tokens, -1);
    int records = 0;
    for (int t = 0; t < tokens; ++t) {
      if (std::uniform_real_distribution<double>(0, 1)(rng) < held) entry[t] = records++;
    }
    // Records before token `t` (the word a part whose next batch starts at t publishes).
    const auto records_before = [&](int t) {
      int n = 0;
      for (int u = 0; u < std::min(t, tokens); ++u) n += entry[u] >= 0;
      return n;
    };
    const int parts = second > 0 ? 2 : 1;
    int next_batch[2] = {0, 0};  // index k of each part's next batch
    int word[2] = {0, records_before(b.start(1, 0))};
    if (parts == 1) word[1] = records;  // no second reducer: only head counts
    int written = 0;
    std::vector<int> used(records, 0);
    int stuck = 0;
    while (true) {
      bool all_done = true;
      std::vector<int> can;  // 0, 1: a part's next batch; 2: the source writes one record
      for (int p = 0; p < parts; ++p) {
        const int start = b.start(p, next_batch[p]);
        if (start >= tokens) continue;
        all_done = false;
        const int end = std::min(tokens, start + b.size[p]);
        const int needed = records_before(end);
        if (needed <= written) can.push_back(p);
      }
      if (all_done) break;
      if (written < records && written < std::min(word[0], word[1]) + queue) can.push_back(2);
      ASSERT_FALSE(can.empty()) << "deadlock: queue " << queue << ", second " << second << ", tokens "
                                << tokens << ", written " << written;
      const int step = can[rng() % can.size()];
      if (step == 2) {
        // The slot of record `written` held record written - queue: it must have been used by then.
        if (written >= queue) {
          ASSERT_EQ(used[written - queue], 1);
        }
        ++written;
        continue;
      }
      const int start = b.start(step, next_batch[step]);
      for (int t = start; t < std::min(tokens, start + b.size[step]); ++t) {
        if (entry[t] >= 0) used[entry[t]] = 1;
      }
      ++next_batch[step];
      word[step] = records_before(b.start(step, next_batch[step]));
      ASSERT_LT(++stuck, 100000);
    }
    EXPECT_EQ(written, records);
  }
}

}  // namespace
}  // namespace epx::kernels
