#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <vector>

#include "epx/error.hpp"
#include "reference/layout.hpp"
#include "reference/test_data.hpp"

namespace {

using epx::reference::DispatchLayout;
using epx::reference::get_dispatch_layout;

TEST(ReferenceLayout, HandCheckedTwoRanksFourExperts) {
  // Experts 0,1 live on rank 0 and 2,3 on rank 1.
  const std::vector<int64_t> topk_idx = {
      0,  3,   // both ranks
      1,  0,   // rank 0 only, two experts there
      -1, -1,  // nowhere
      2,  3,   // rank 1 only
      2,  2,   // expert 2 listed twice: counts once
  };
  const DispatchLayout layout = get_dispatch_layout(topk_idx.data(), 5, 2, 4, 2);
  EXPECT_EQ(layout.num_tokens_per_rank, (std::vector<int>{2, 3}));
  EXPECT_EQ(layout.num_tokens_per_expert, (std::vector<int>{2, 1, 2, 2}));
  EXPECT_EQ(layout.is_token_in_rank, (std::vector<uint8_t>{1, 1, 1, 0, 0, 0, 0, 1, 0, 1}));
}

TEST(ReferenceLayout, EmptyAndSingleToken) {
  const DispatchLayout empty = get_dispatch_layout(nullptr, 0, 8, 16, 4);
  EXPECT_EQ(empty.num_tokens_per_rank, (std::vector<int>{0, 0, 0, 0}));
  EXPECT_EQ(empty.num_tokens_per_expert, std::vector<int>(16, 0));
  EXPECT_TRUE(empty.is_token_in_rank.empty());

  const std::vector<int64_t> one = {15, -1, 4};
  const DispatchLayout single = get_dispatch_layout(one.data(), 1, 3, 16, 4);
  EXPECT_EQ(single.num_tokens_per_rank, (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(single.is_token_in_rank, (std::vector<uint8_t>{0, 1, 0, 1}));
  EXPECT_EQ(single.num_tokens_per_expert[15], 1);
  EXPECT_EQ(single.num_tokens_per_expert[4], 1);
}

TEST(ReferenceLayout, RejectsBadArguments) {
  const std::vector<int64_t> ids = {0, 4};
  EXPECT_THROW(get_dispatch_layout(ids.data(), 1, 2, 4, 2), epx::Error);  // id == E
  const std::vector<int64_t> negative = {-2, 1};
  EXPECT_THROW(get_dispatch_layout(negative.data(), 1, 2, 4, 2), epx::Error);
  const std::vector<int64_t> fine = {0, 1};
  EXPECT_THROW(get_dispatch_layout(fine.data(), 1, 2, 6, 4), epx::Error);   // E % R != 0
  EXPECT_THROW(get_dispatch_layout(fine.data(), -1, 2, 4, 2), epx::Error);  // T < 0
  EXPECT_THROW(get_dispatch_layout(fine.data(), 1, -1, 4, 2), epx::Error);  // K < 0
  EXPECT_THROW(get_dispatch_layout(fine.data(), 1, 2, 4, 0), epx::Error);   // R < 1
  EXPECT_THROW(get_dispatch_layout(nullptr, 1, 2, 4, 2), epx::Error);       // null ids
  EXPECT_NO_THROW(get_dispatch_layout(fine.data(), 1, 2, 4, 2));
}

// Counts against a brute force that goes through (rank, token) pairs instead of (token, k).
void expect_layout_consistent(const std::vector<int64_t>& ids, int num_tokens, int num_topk, int num_experts,
                              int num_ranks) {
  const DispatchLayout layout = get_dispatch_layout(ids.data(), num_tokens, num_topk, num_experts, num_ranks);
  const int experts_per_rank = num_experts / num_ranks;
  std::vector<int> per_rank(num_ranks, 0);
  std::vector<int> per_expert(num_experts, 0);
  for (int t = 0; t < num_tokens; ++t) {
    std::set<int64_t> experts;
    for (int k = 0; k < num_topk; ++k) {
      if (ids[t * num_topk + k] >= 0) experts.insert(ids[t * num_topk + k]);
    }
    for (int64_t e : experts) ++per_expert[e];
    for (int r = 0; r < num_ranks; ++r) {
      bool in_rank = false;
      for (int64_t e : experts) in_rank = in_rank || e / experts_per_rank == r;
      ASSERT_EQ(layout.is_token_in_rank[t * num_ranks + r], in_rank ? 1 : 0)
          << "token " << t << " rank " << r;
      per_rank[r] += in_rank ? 1 : 0;
    }
  }
  EXPECT_EQ(layout.num_tokens_per_rank, per_rank);
  EXPECT_EQ(layout.num_tokens_per_expert, per_expert);
}

TEST(ReferenceLayout, RandomRoutingMatchesBruteForce) {
  const std::vector<int64_t> ids = epx::reference::random_topk_idx(11, 300, 8, 64);
  expect_layout_consistent(ids, 300, 8, 64, 8);
}

TEST(ReferenceLayout, UnbalancedRoutingMatchesBruteForce) {
  const auto routing = epx::reference::make_unbalanced_routing(12, {200, 150, 90, 60}, 6, 32, 4);
  for (int s = 0; s < 4; ++s)
    expect_layout_consistent(routing[s], static_cast<int>(routing[s].size() / 6), 6, 32, 4);
  // The corners the generator promises: rank 3 sends nothing, rank 0 receives nothing, expert 31 is cold.
  for (int s = 0; s < 4; ++s) {
    const int num_tokens = static_cast<int>(routing[s].size() / 6);
    const DispatchLayout layout = get_dispatch_layout(routing[s].data(), num_tokens, 6, 32, 4);
    EXPECT_EQ(layout.num_tokens_per_rank[0], 0);
    EXPECT_EQ(layout.num_tokens_per_expert[31], 0);
    if (s == 3) {
      EXPECT_EQ(layout.num_tokens_per_rank, (std::vector<int>{0, 0, 0, 0}));
    }
  }
}

TEST(ReferenceTestData, RandomTopkHasNoDuplicatesAndCoversExperts) {
  const std::vector<int64_t> ids = epx::reference::random_topk_idx(5, 500, 8, 16);
  std::vector<int> hits(16, 0);
  for (int t = 0; t < 500; ++t) {
    std::set<int64_t> seen;
    for (int k = 0; k < 8; ++k) {
      const int64_t e = ids[t * 8 + k];
      ASSERT_GE(e, 0);
      ASSERT_LT(e, 16);
      ASSERT_TRUE(seen.insert(e).second) << "duplicate expert in token " << t;
      ++hits[e];
    }
  }
  for (int e = 0; e < 16; ++e) EXPECT_GT(hits[e], 150) << "expert " << e;
  EXPECT_EQ(ids, epx::reference::random_topk_idx(5, 500, 8, 16));  // seeded
  EXPECT_NE(ids, epx::reference::random_topk_idx(6, 500, 8, 16));
  // More picks than experts: the extra entries are -1.
  const std::vector<int64_t> few = epx::reference::random_topk_idx(5, 3, 6, 4);
  for (int t = 0; t < 3; ++t) {
    std::set<int64_t> seen(few.begin() + t * 6, few.begin() + t * 6 + 6);
    EXPECT_EQ(seen, (std::set<int64_t>{-1, 0, 1, 2, 3}));
  }
}

TEST(ReferenceTestData, HotExpertsDominate) {
  epx::reference::RoutingSpec spec;
  spec.num_tokens = 1000;
  spec.num_topk = 4;
  spec.num_experts = 64;
  spec.hot_experts = {7, 9};
  spec.hot_probability = 0.9;
  const std::vector<int64_t> ids = epx::reference::make_topk_idx(spec, 3);
  int hot_tokens = 0;
  for (int t = 0; t < 1000; ++t) {
    bool hot = false;
    for (int k = 0; k < 4; ++k) hot = hot || ids[t * 4 + k] == 7 || ids[t * 4 + k] == 9;
    hot_tokens += hot ? 1 : 0;
  }
  EXPECT_GT(hot_tokens, 950);
}

TEST(ReferenceTestData, StampRoundTrips) {
  const int hidden = 16;
  const std::vector<uint16_t> x = epx::reference::random_bf16_tokens(9, 300, hidden, 5);
  for (int t = 0; t < 300; ++t) {
    const epx::reference::Stamp stamp = epx::reference::read_stamp(&x[t * hidden], hidden);
    EXPECT_EQ(stamp.src_rank, 5);
    EXPECT_EQ(stamp.token_idx, t);
  }
  const std::vector<uint16_t> unstamped =
      epx::reference::random_bf16_tokens(9, 4, hidden, 5, epx::reference::TokenValues::kUniform, false);
  EXPECT_EQ(epx::reference::read_stamp(unstamped.data(), hidden).src_rank, -1);
}

}  // namespace
