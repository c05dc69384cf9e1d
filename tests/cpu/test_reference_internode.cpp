#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cpu/bf16_values.hpp"
#include "epx/error.hpp"
#include "reference/internode.hpp"
#include "reference/layout.hpp"
#include "reference/normal.hpp"
#include "reference/test_data.hpp"

// The across-nodes reference: what arrives equals the one-node reference, tokens cross to a node once, and
// combine reduces inside each node (rounding that partial once) before summing the nodes.
namespace {

using namespace epx::reference;

using epx::test::bf16_values;
using epx::test::float_values;

void expect_same_outputs(const NormalDispatchResult& got, const NormalDispatchResult& want) {
  ASSERT_EQ(got.ranks.size(), want.ranks.size());
  for (size_t d = 0; d < want.ranks.size(); ++d) {
    const NormalDispatchRankOutput& a = got.ranks[d];
    const NormalDispatchRankOutput& b = want.ranks[d];
    EXPECT_EQ(a.num_recv_tokens, b.num_recv_tokens) << "rank " << d;
    EXPECT_EQ(a.num_rows, b.num_rows) << "rank " << d;
    EXPECT_EQ(a.recv_x, b.recv_x) << "rank " << d;
    EXPECT_EQ(a.recv_x_fp8, b.recv_x_fp8) << "rank " << d;
    EXPECT_EQ(a.recv_x_scales, b.recv_x_scales) << "rank " << d;
    EXPECT_EQ(a.recv_topk_idx, b.recv_topk_idx) << "rank " << d;
    EXPECT_EQ(a.recv_topk_weights, b.recv_topk_weights) << "rank " << d;
    EXPECT_EQ(a.num_recv_tokens_per_expert_list, b.num_recv_tokens_per_expert_list) << "rank " << d;
    EXPECT_EQ(a.recv_src_rank, b.recv_src_rank) << "rank " << d;
    EXPECT_EQ(a.recv_src_token_idx, b.recv_src_token_idx) << "rank " << d;
  }
  EXPECT_EQ(got.handle.recv_row, want.handle.recv_row);
  EXPECT_EQ(got.handle.num_rows, want.handle.num_rows);
}

// ---- Hand-checked: 4 ranks as 2 nodes of 2, one expert per rank, hidden 2 ----

NormalDispatchParams four_rank_params(int num_topk) {
  NormalDispatchParams params;
  params.num_ranks = 4;
  params.num_experts = 4;
  params.hidden = 2;
  params.num_topk = num_topk;
  return params;
}

TEST(ReferenceInternode, HandCheckedRoutesCrossToANodeOnce) {
  std::vector<NormalDispatchRankInput> inputs(4);
  inputs[0].num_tokens = 4;
  inputs[0].x = bf16_values({1, 1, 2, 2, 3, 3, 4, 4});
  // Token 0: ranks 2 and 3 (node 1 only, once); token 1: ranks 0 and 3 (both nodes); token 2: nowhere;
  // token 3: rank 1 (its own node only).
  inputs[0].topk_idx = {2, 3, 0, 3, -1, -1, 1, -1};
  inputs[0].topk_weights = {0.5f, 0.5f, 0.25f, 0.75f, 1, 1, 1, 1};
  inputs[3].num_tokens = 1;
  inputs[3].x = bf16_values({5, 5});
  inputs[3].topk_idx = {0, 1};  // ranks 0 and 1: node 0, local ranks 0 and 1
  inputs[3].topk_weights = {0.5f, 0.5f};
  for (int r : {1, 2}) inputs[r].num_tokens = 0;
  const InternodeDispatchResult result = internode_dispatch(four_rank_params(2), 2, inputs);

  ASSERT_EQ(result.routes.size(), 4u);
  ASSERT_EQ(result.routes[0].size(), 2u);
  auto route_list = [](const std::vector<InternodeRoute>& routes) {
    std::vector<std::pair<int, uint32_t>> list;
    for (const InternodeRoute& route : routes) list.emplace_back(route.token_idx, route.rank_mask);
    return list;
  };
  using Routes = std::vector<std::pair<int, uint32_t>>;
  EXPECT_EQ(route_list(result.routes[0][0]), (Routes{{1, 0b01}, {3, 0b10}}));
  EXPECT_EQ(route_list(result.routes[0][1]), (Routes{{0, 0b11}, {1, 0b10}}));
  EXPECT_EQ(route_list(result.routes[3][0]), (Routes{{0, 0b11}}));
  EXPECT_TRUE(result.routes[3][1].empty());
  EXPECT_TRUE(result.routes[1][0].empty() && result.routes[2][1].empty());

  // What arrives is the one-node reference's.
  expect_same_outputs(result.normal, normal_dispatch(four_rank_params(2), inputs));
  EXPECT_EQ(float_values(result.normal.ranks[3].recv_x), (std::vector<float>{1, 1, 2, 2}));
  EXPECT_EQ(result.normal.ranks[3].recv_src_token_idx, (std::vector<int>{0, 1}));

  // The layout counts what crosses: per destination node, a token once.
  const DispatchLayout layout = get_dispatch_layout(inputs[0].topk_idx.data(), 4, 2, 4, 4, 2);
  EXPECT_EQ(layout.num_tokens_per_rdma_rank, (std::vector<int>{2, 2}));
  EXPECT_EQ(layout.num_tokens_per_rank, (std::vector<int>{1, 1, 1, 2}));
}

// Rank 0's one token goes to ranks 0, 1 (node 0) and 2 (node 1); the experts return x on channel 0 of
// 256, 1 and 2. BF16 holds every even number in [256, 512) but no odd one.
struct CombineCase {
  NormalDispatchResult dispatch;
  std::vector<NormalCombineRankInput> inputs;
};

CombineCase rounding_case(float bias) {
  std::vector<NormalDispatchRankInput> tokens(4);
  tokens[0].num_tokens = 1;
  tokens[0].x = bf16_values({1, 1});
  tokens[0].topk_idx = {0, 1, 2};
  tokens[0].topk_weights = {0.5f, 0.25f, 0.125f};
  for (int r = 1; r < 4; ++r) tokens[r].num_tokens = 0;
  CombineCase c{normal_dispatch(four_rank_params(3), tokens), std::vector<NormalCombineRankInput>(4)};
  const std::vector<std::vector<float>> rows = {{256, 1}, {1, 1}, {2, 0.5f}, {}};
  for (int r = 0; r < 4; ++r) {
    c.inputs[r].x = bf16_values(rows[r]);
    c.inputs[r].topk_weights = c.dispatch.ranks[r].recv_topk_weights;
  }
  c.inputs[0].bias0 = bf16_values({bias, 0});
  return c;
}

std::vector<float> combined(const CombineCase& c, int ranks_per_node, int num_biases) {
  const NormalCombineParams params{3, num_biases};
  const auto out = ranks_per_node == 0
                       ? normal_combine(c.dispatch.handle, params, c.inputs)
                       : internode_combine(c.dispatch.handle, ranks_per_node, params, c.inputs);
  EXPECT_EQ(out[0].combined_topk_weights, (std::vector<float>{0.5f, 0.25f, 0.125f}));
  return float_values(out[0].combined_x);
}

TEST(ReferenceInternode, HandCheckedCombineRoundsEachNodesPartialOnce) {
  const CombineCase c = rounding_case(-1);
  // One node (all in float): 256 + 1 + 2 = 259, rounded to 260.
  EXPECT_EQ(combined(c, 0, 0), (std::vector<float>{260, 2.5f}));
  // 2 x 2: node 0's partial 257 crosses as 256; + node 1's 2 = 258.
  EXPECT_EQ(combined(c, 2, 0), (std::vector<float>{258, 2.5f}));
  // Nodes of one rank: every partial is one BF16 row, so nothing is lost: the one-node result.
  EXPECT_EQ(combined(c, 1, 0), (std::vector<float>{260, 2.5f}));
  // One node of 4: the partial 259 rounds to 260, as the one-node reference does without biases.
  EXPECT_EQ(combined(c, 4, 0), (std::vector<float>{260, 2.5f}));

  // A bias of -1 comes after the nodes' partials.
  EXPECT_EQ(combined(c, 0, 1), (std::vector<float>{258, 2.5f}));  // 259 - 1
  EXPECT_EQ(combined(c, 2, 1), (std::vector<float>{256, 2.5f}));  // 256 + 2 - 1 = 257, rounded to 256
  EXPECT_EQ(combined(c, 1, 1), (std::vector<float>{258, 2.5f}));  // = the one-node reference
  EXPECT_EQ(combined(c, 4, 1), (std::vector<float>{260, 2.5f}));  // 260 - 1 = 259, rounded to 260
}

TEST(ReferenceInternode, TokensSentNowhereGetTheBiasesAlone) {
  std::vector<NormalDispatchRankInput> tokens(4);
  for (int r = 0; r < 4; ++r) tokens[r].num_tokens = 0;
  tokens[1].num_tokens = 1;
  tokens[1].x = bf16_values({3, 4});
  tokens[1].topk_idx = {-1, -1};
  tokens[1].topk_weights = {1, 1};
  const NormalDispatchResult dispatch = normal_dispatch(four_rank_params(2), tokens);
  std::vector<NormalCombineRankInput> inputs(4);
  inputs[1].bias0 = bf16_values({0.5f, -2});
  inputs[1].bias1 = bf16_values({0.25f, 1});
  const auto out = internode_combine(dispatch.handle, 2, NormalCombineParams{2, 2}, inputs);
  EXPECT_EQ(float_values(out[1].combined_x), (std::vector<float>{0.75f, -1}));
  EXPECT_EQ(out[1].combined_topk_weights, (std::vector<float>{0, 0}));
}

// ---- Random cases: every split against the one-node reference ----

struct Split {
  int num_ranks;
  int ranks_per_node;
};

std::vector<NormalDispatchRankInput> random_inputs(const NormalDispatchParams& params, uint64_t seed,
                                                   bool unbalanced) {
  std::vector<int> num_tokens;
  for (int r = 0; r < params.num_ranks; ++r) num_tokens.push_back(r % 3 == 1 ? 1 : 37 + 11 * r);
  num_tokens[0] = 0;  // a rank with no tokens
  const std::vector<std::vector<int64_t>> routing =
      make_routing(seed, num_tokens, params.num_topk, params.num_experts, params.num_ranks, unbalanced);
  std::vector<NormalDispatchRankInput> inputs(params.num_ranks);
  for (int r = 0; r < params.num_ranks; ++r) {
    NormalDispatchRankInput& in = inputs[r];
    in.num_tokens = num_tokens[r];
    if (params.format == PayloadFormat::kFp8) {
      Fp8Tokens fp8 = random_fp8_tokens(seed * 31 + r, in.num_tokens, params.hidden, r);
      in.x_fp8 = std::move(fp8.x);
      in.x_scales = std::move(fp8.scales);
    } else {
      in.x = random_bf16_tokens(seed * 31 + r, in.num_tokens, params.hidden, r);
    }
    in.topk_idx = routing[r];
    in.topk_weights = random_topk_weights(seed * 37 + r, in.num_tokens, params.num_topk);
    if (!params.with_topk) {
      in.is_token_in_rank = get_dispatch_layout(in.topk_idx.data(), in.num_tokens, params.num_topk,
                                                params.num_experts, params.num_ranks)
                                .is_token_in_rank;
      in.topk_idx.clear();
      in.topk_weights.clear();
    }
  }
  return inputs;
}

TEST(ReferenceInternode, DispatchDeliversWhatTheOneNodeReferenceDelivers) {
  const std::vector<Split> splits = {{2, 1}, {4, 2}, {4, 1}, {4, 4}, {8, 2}, {16, 8}};
  uint64_t seed = 1;
  for (const Split& split : splits) {
    for (PayloadFormat format : {PayloadFormat::kBf16, PayloadFormat::kFp8}) {
      for (bool with_topk : {true, false}) {
        for (bool unbalanced : {false, true}) {
          NormalDispatchParams params;
          params.num_ranks = split.num_ranks;
          params.num_experts = 4 * split.num_ranks;
          params.hidden = 256;
          params.format = format;
          params.num_topk = 6;
          params.with_topk = with_topk;
          params.expert_alignment = 4;
          const std::vector<NormalDispatchRankInput> inputs = random_inputs(params, ++seed, unbalanced);
          SCOPED_TRACE(::testing::Message() << split.num_ranks << " ranks, nodes of " << split.ranks_per_node
                                            << ", seed " << seed);
          const InternodeDispatchResult result = internode_dispatch(params, split.ranks_per_node, inputs);
          expect_same_outputs(result.normal, normal_dispatch(params, inputs));

          // Routes: each token once per node that holds one of its experts, with exactly those ranks.
          const int num_nodes = split.num_ranks / split.ranks_per_node;
          for (int s = 0; s < split.num_ranks; ++s) {
            std::vector<std::vector<int>> rows_of(num_nodes);
            for (int n = 0; n < num_nodes; ++n) {
              ASSERT_EQ(result.routes[s].size(), size_t(num_nodes));
              size_t next = 0;
              for (int t = 0; t < inputs[s].num_tokens; ++t) {
                uint32_t mask = 0;
                for (int j = 0; j < split.ranks_per_node; ++j) {
                  const int d = n * split.ranks_per_node + j;
                  if (result.normal.handle.recv_row[s][size_t(t) * split.num_ranks + d] >= 0) mask |= 1u << j;
                }
                if (mask == 0) continue;
                ASSERT_LT(next, result.routes[s][n].size());
                EXPECT_EQ(result.routes[s][n][next].token_idx, t);
                EXPECT_EQ(result.routes[s][n][next].rank_mask, mask);
                ++next;
              }
              EXPECT_EQ(next, result.routes[s][n].size());
            }
            if (with_topk && split.ranks_per_node < split.num_ranks) {
              const DispatchLayout layout =
                  get_dispatch_layout(inputs[s].topk_idx.data(), inputs[s].num_tokens, 6, params.num_experts,
                                      split.num_ranks, split.ranks_per_node);
              ASSERT_EQ(layout.num_tokens_per_rdma_rank.size(), size_t(num_nodes));
              for (int n = 0; n < num_nodes; ++n)
                EXPECT_EQ(layout.num_tokens_per_rdma_rank[n], int(result.routes[s][n].size()));
            }
          }
        }
      }
    }
  }
}

// Expert outputs of every rank: its received rows scaled by a per-rank factor, so copies differ.
std::vector<NormalCombineRankInput> expert_outputs(const NormalDispatchResult& dispatch, int num_topk,
                                                   bool with_biases, TokenValues values, uint64_t seed) {
  std::vector<NormalCombineRankInput> inputs(dispatch.ranks.size());
  for (size_t r = 0; r < inputs.size(); ++r) {
    const NormalDispatchRankOutput& out = dispatch.ranks[r];
    const int hidden = dispatch.handle.hidden;
    inputs[r].x = random_bf16_tokens(seed * 7 + r, out.num_rows, hidden, int(r), values, false);
    if (num_topk > 0) inputs[r].topk_weights = out.recv_topk_weights;
    if (with_biases) {
      const int num_tokens = dispatch.handle.num_tokens[r];
      inputs[r].bias0 = random_bf16_tokens(seed * 11 + r, num_tokens, hidden, int(r), values, false);
      inputs[r].bias1 = random_bf16_tokens(seed * 13 + r, num_tokens, hidden, int(r), values, false);
    }
  }
  return inputs;
}

TEST(ReferenceInternode, CombineAgainstTheOneNodeReference) {
  const std::vector<Split> splits = {{2, 1}, {4, 2}, {4, 1}, {8, 4}, {8, 2}, {16, 8}};
  uint64_t seed = 100;
  for (const Split& split : splits) {
    for (bool unbalanced : {false, true}) {
      NormalDispatchParams params;
      params.num_ranks = split.num_ranks;
      params.num_experts = 2 * split.num_ranks;
      params.hidden = 128;
      params.num_topk = 4;
      const NormalDispatchResult dispatch =
          normal_dispatch(params, random_inputs(params, ++seed, unbalanced));
      const NormalHandle& handle = dispatch.handle;
      SCOPED_TRACE(::testing::Message() << split.num_ranks << " ranks, nodes of " << split.ranks_per_node);

      // Uniform values: rounding shows. Nodes of one rank and, without biases, one node are the one-node
      // reference bit for bit.
      const auto uniform = expert_outputs(dispatch, 4, true, TokenValues::kUniform, seed);
      const NormalCombineParams with_all{4, 2};
      const auto one_node = normal_combine(handle, with_all, uniform);
      const auto singles = internode_combine(handle, 1, with_all, uniform);
      const auto plain = internode_combine(handle, split.num_ranks, NormalCombineParams{4, 0}, uniform);
      const auto plain_one_node = normal_combine(handle, NormalCombineParams{4, 0}, uniform);
      for (int r = 0; r < split.num_ranks; ++r) {
        EXPECT_EQ(singles[r].combined_x, one_node[r].combined_x) << "rank " << r;
        EXPECT_EQ(singles[r].combined_topk_weights, one_node[r].combined_topk_weights);
        EXPECT_EQ(plain[r].combined_x, plain_one_node[r].combined_x) << "rank " << r;
      }
      // Small integers: every partial is exact in BF16, so any split gives the one-node result; the
      // weights come back whole whatever the split.
      const auto exact = expert_outputs(dispatch, 4, true, TokenValues::kSmallIntegers, seed);
      const auto want = normal_combine(handle, with_all, exact);
      const auto got = internode_combine(handle, split.ranks_per_node, with_all, exact);
      for (int r = 0; r < split.num_ranks; ++r) {
        EXPECT_EQ(got[r].combined_x, want[r].combined_x) << "rank " << r;
        EXPECT_EQ(got[r].combined_topk_weights, want[r].combined_topk_weights) << "rank " << r;
      }
    }
  }
}

TEST(ReferenceInternode, RejectsBadNodeSplits) {
  std::vector<NormalDispatchRankInput> inputs(4);
  for (NormalDispatchRankInput& in : inputs) in.num_tokens = 0;
  const NormalDispatchParams params = four_rank_params(2);
  EXPECT_THROW(internode_dispatch(params, 3, inputs), epx::Error);
  EXPECT_THROW(internode_dispatch(params, 0, inputs), epx::Error);
  const NormalDispatchResult dispatch = normal_dispatch(params, inputs);
  EXPECT_THROW(
      internode_combine(dispatch.handle, 3, NormalCombineParams{}, std::vector<NormalCombineRankInput>(4)),
      epx::Error);
  EXPECT_THROW(get_dispatch_layout(nullptr, 0, 2, 4, 4, 3), epx::Error);
  EXPECT_THROW(get_dispatch_layout(nullptr, 0, 2, 4, 4, -1), epx::Error);
  EXPECT_TRUE(get_dispatch_layout(nullptr, 0, 2, 4, 4).num_tokens_per_rdma_rank.empty());
  EXPECT_TRUE(get_dispatch_layout(nullptr, 0, 2, 4, 4, 4).num_tokens_per_rdma_rank.empty());
  EXPECT_EQ(get_dispatch_layout(nullptr, 0, 2, 4, 4, 1).num_tokens_per_rdma_rank,
            (std::vector<int>{0, 0, 0, 0}));
}

}  // namespace
