#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "cpu/bf16_values.hpp"
#include "epx/error.hpp"
#include "formats/bf16.hpp"
#include "reference/layout.hpp"
#include "reference/normal.hpp"
#include "reference/test_data.hpp"

namespace {

using namespace epx::reference;

using epx::test::bf16_values;
using epx::test::float_values;

// ---- Hand-checked: 2 ranks, 4 experts (0,1 on rank 0; 2,3 on rank 1), hidden 4, top-2 ----

NormalDispatchParams small_params() {
  NormalDispatchParams params;
  params.num_ranks = 2;
  params.num_experts = 4;
  params.hidden = 4;
  params.num_topk = 2;
  return params;
}

std::vector<NormalDispatchRankInput> small_inputs() {
  std::vector<NormalDispatchRankInput> inputs(2);
  inputs[0].num_tokens = 3;
  inputs[0].x = bf16_values({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12});
  inputs[0].topk_idx = {0, 3, 1, -1, 2, 3};
  inputs[0].topk_weights = {0.5f, 0.25f, 1.0f, 0.75f, 0.125f, 0.5f};
  inputs[1].num_tokens = 2;
  inputs[1].x = bf16_values({-1, -2, -3, -4, 13, 14, 15, 16});
  inputs[1].topk_idx = {3, 1, -1, -1};
  inputs[1].topk_weights = {0.25f, 0.75f, 1.0f, 1.0f};
  return inputs;
}

TEST(ReferenceNormal, HandCheckedDispatch) {
  NormalDispatchParams params = small_params();
  params.expert_alignment = 2;
  const NormalDispatchResult result = normal_dispatch(params, small_inputs());
  ASSERT_EQ(result.ranks.size(), 2u);

  const NormalDispatchRankOutput& r0 = result.ranks[0];
  EXPECT_EQ(r0.num_recv_tokens, 3);
  EXPECT_EQ(r0.num_rows, 3);
  EXPECT_EQ(float_values(r0.recv_x), (std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8, -1, -2, -3, -4}));
  EXPECT_EQ(r0.recv_topk_idx, (std::vector<int64_t>{0, -1, 1, -1, -1, 1}));
  EXPECT_EQ(r0.recv_topk_weights, (std::vector<float>{0.5f, 0, 1.0f, 0, 0, 0.75f}));
  EXPECT_EQ(r0.recv_src_rank, (std::vector<int>{0, 0, 1}));
  EXPECT_EQ(r0.recv_src_token_idx, (std::vector<int>{0, 1, 0}));
  EXPECT_EQ(r0.num_recv_tokens_per_rank, (std::vector<int>{2, 1}));
  EXPECT_EQ(r0.recv_rank_prefix, (std::vector<int>{0, 2, 3}));
  EXPECT_EQ(r0.num_recv_tokens_per_expert_list, (std::vector<int>{2, 2}));  // raw {1, 2}

  const NormalDispatchRankOutput& r1 = result.ranks[1];
  EXPECT_EQ(r1.num_recv_tokens, 3);
  EXPECT_EQ(float_values(r1.recv_x), (std::vector<float>{1, 2, 3, 4, 9, 10, 11, 12, -1, -2, -3, -4}));
  EXPECT_EQ(r1.recv_topk_idx, (std::vector<int64_t>{-1, 1, 0, 1, 1, -1}));
  EXPECT_EQ(r1.recv_topk_weights, (std::vector<float>{0, 0.25f, 0.125f, 0.5f, 0.25f, 0}));
  EXPECT_EQ(r1.recv_src_rank, (std::vector<int>{0, 0, 1}));
  EXPECT_EQ(r1.recv_src_token_idx, (std::vector<int>{0, 2, 0}));
  EXPECT_EQ(r1.num_recv_tokens_per_rank, (std::vector<int>{2, 1}));
  EXPECT_EQ(r1.num_recv_tokens_per_expert_list, (std::vector<int>{2, 4}));  // raw {1, 3}

  EXPECT_EQ(result.handle.num_tokens, (std::vector<int>{3, 2}));
  EXPECT_EQ(result.handle.num_rows, (std::vector<int>{3, 3}));
  EXPECT_EQ(result.handle.recv_row[0], (std::vector<int>{0, 0, 1, -1, -1, 1}));
  EXPECT_EQ(result.handle.recv_row[1], (std::vector<int>{2, 2, -1, -1}));
}

TEST(ReferenceNormal, HandCheckedCombineWithBias) {
  const NormalDispatchResult dispatch = normal_dispatch(small_params(), small_inputs());
  std::vector<NormalCombineRankInput> inputs(2);
  for (int r = 0; r < 2; ++r) {
    inputs[r].x = dispatch.ranks[r].recv_x;  // identity experts
    inputs[r].topk_weights = dispatch.ranks[r].recv_topk_weights;
  }
  NormalCombineParams params{2, 0};
  std::vector<NormalCombineRankOutput> out = normal_combine(dispatch.handle, params, inputs);
  EXPECT_EQ(float_values(out[0].combined_x), (std::vector<float>{2, 4, 6, 8, 5, 6, 7, 8, 9, 10, 11, 12}));
  EXPECT_EQ(out[0].combined_topk_weights, (std::vector<float>{0.5f, 0.25f, 1.0f, 0.0f, 0.125f, 0.5f}));
  EXPECT_EQ(float_values(out[1].combined_x), (std::vector<float>{-2, -4, -6, -8, 0, 0, 0, 0}));
  EXPECT_EQ(out[1].combined_topk_weights, (std::vector<float>{0.25f, 0.75f, 0.0f, 0.0f}));

  // Biases are added after the copies; a token sent nowhere gets the biases alone.
  inputs[0].bias0 = bf16_values(std::vector<float>(12, 1.0f));
  inputs[0].bias1 = bf16_values(std::vector<float>(12, 0.5f));
  inputs[1].bias0 = bf16_values({0, 0, 0, 0, 1, 2, 3, 4});
  inputs[1].bias1 = bf16_values(std::vector<float>(8, -0.25f));
  params = NormalCombineParams{0, 2};
  out = normal_combine(dispatch.handle, params, inputs);
  EXPECT_EQ(float_values(out[0].combined_x),
            (std::vector<float>{3.5, 5.5, 7.5, 9.5, 6.5, 7.5, 8.5, 9.5, 10.5, 11.5, 12.5, 13.5}));
  EXPECT_TRUE(out[0].combined_topk_weights.empty());
  EXPECT_EQ(float_values(out[1].combined_x),
            (std::vector<float>{-2.25, -4.25, -6.25, -8.25, 0.75, 1.75, 2.75, 3.75}));
}

// Sums start at -0.0f (the identity of float addition): a token with one source is that source bit for
// bit (a lone -0.0 and NaN payloads included), -0.0 + -0.0 stays -0.0, and a token with no source is +0.0.
TEST(ReferenceNormal, CombineSignedZerosAndSingleSources) {
  NormalDispatchParams params = small_params();
  params.hidden = 2;
  std::vector<NormalDispatchRankInput> inputs(2);
  // Rank 0: token 0 to rank 0 only, token 1 to both ranks, token 2 nowhere.
  inputs[0].num_tokens = 3;
  inputs[0].x = std::vector<uint16_t>(6, 0);
  inputs[0].topk_idx = {0, -1, 1, 2, -1, -1};
  inputs[0].topk_weights = {1, 0, 1, 1, 0, 0};
  inputs[1].num_tokens = 0;
  const NormalDispatchResult dispatch = normal_dispatch(params, inputs);
  std::vector<NormalCombineRankInput> combine_inputs(2);
  const uint16_t kNegZero = 0x8000, kNanPayload = 0x7FA5, kSignalingNan = 0xFF81;
  // Rank 0 holds tokens 0 and 1 (rows 0, 1); rank 1 holds token 1 (row 0).
  combine_inputs[0].x = {kNegZero, kNanPayload, kNegZero, kSignalingNan};
  combine_inputs[1].x = {kNegZero, epx::float_to_bf16(1.0f)};
  std::vector<NormalCombineRankOutput> out =
      normal_combine(dispatch.handle, NormalCombineParams{0, 0}, combine_inputs);
  EXPECT_EQ(out[0].combined_x[0], kNegZero);     // one source: -0.0 stays
  EXPECT_EQ(out[0].combined_x[1], kNanPayload);  // one source: the NaN's payload stays
  EXPECT_EQ(out[0].combined_x[2], kNegZero);     // -0.0 + -0.0
  EXPECT_EQ(out[0].combined_x[4], 0u);           // no source: +0.0
  EXPECT_EQ(out[0].combined_x[5], 0u);

  // With one bias, the token sent nowhere has one source: the bias row, bit for bit.
  combine_inputs[0].bias0 = {0, 0, 0, 0, kNegZero, kSignalingNan};
  out = normal_combine(dispatch.handle, NormalCombineParams{0, 1}, combine_inputs);
  EXPECT_EQ(out[0].combined_x[4], kNegZero);
  EXPECT_EQ(out[0].combined_x[5], kSignalingNan);
}

TEST(ReferenceNormal, CombineAccumulatesInFloatThenRoundsOnce) {
  // 256 + 1 + 1: BF16 cannot hold 257 but float can, so rounding after each add would give 256 twice
  // (ties to even), while one rounding at the end gives 258.
  NormalDispatchParams params = small_params();
  params.hidden = 1;
  std::vector<NormalDispatchRankInput> inputs(2);
  inputs[0].num_tokens = 1;
  inputs[0].x = bf16_values({1});
  inputs[0].topk_idx = {0, 2};
  inputs[0].topk_weights = {1, 1};
  inputs[1].num_tokens = 0;
  const NormalDispatchResult dispatch = normal_dispatch(params, inputs);
  std::vector<NormalCombineRankInput> combine(2);
  combine[0].x = bf16_values({256});
  combine[1].x = bf16_values({1});
  combine[0].bias0 = bf16_values({1});
  const std::vector<NormalCombineRankOutput> out =
      normal_combine(dispatch.handle, NormalCombineParams{0, 1}, combine);
  EXPECT_EQ(epx::bf16_to_float(out[0].combined_x[0]), 258.0f);
  EXPECT_TRUE(out[1].combined_x.empty());
}

TEST(ReferenceNormal, WorstCasePadding) {
  NormalDispatchParams params = small_params();
  params.num_worst_tokens = 5;
  const NormalDispatchResult result = normal_dispatch(params, small_inputs());
  for (int r = 0; r < 2; ++r) {
    const NormalDispatchRankOutput& out = result.ranks[r];
    EXPECT_EQ(out.num_recv_tokens, 3);
    EXPECT_EQ(out.num_rows, 5);
    EXPECT_EQ(out.recv_x.size(), 20u);
    EXPECT_TRUE(out.num_recv_tokens_per_expert_list.empty());
    for (int row = 3; row < 5; ++row) {
      EXPECT_EQ(out.recv_src_rank[row], -1);
      EXPECT_EQ(out.recv_src_token_idx[row], -1);
      for (int k = 0; k < 2; ++k) {
        EXPECT_EQ(out.recv_topk_idx[row * 2 + k], -1);
        EXPECT_EQ(out.recv_topk_weights[row * 2 + k], 0.0f);
      }
    }
  }
  EXPECT_EQ(result.handle.num_rows, (std::vector<int>{5, 5}));
  // Combine reads only the real rows (padding holds garbage on the GPU).
  std::vector<NormalCombineRankInput> combine(2);
  for (int r = 0; r < 2; ++r) {
    combine[r].x = result.ranks[r].recv_x;
    for (size_t i = 12; i < 20; ++i) combine[r].x[i] = epx::float_to_bf16(1000.0f);
  }
  const auto out = normal_combine(result.handle, NormalCombineParams{}, combine);
  EXPECT_EQ(float_values(out[0].combined_x), (std::vector<float>{2, 4, 6, 8, 5, 6, 7, 8, 9, 10, 11, 12}));

  params.num_worst_tokens = 2;  // fewer rows than a rank receives
  EXPECT_THROW(normal_dispatch(params, small_inputs()), epx::Error);
}

TEST(ReferenceNormal, WithoutTopkUsesIsTokenInRank) {
  NormalDispatchParams params = small_params();
  params.with_topk = false;
  params.num_topk = 0;
  std::vector<NormalDispatchRankInput> inputs = small_inputs();
  for (int r = 0; r < 2; ++r) {
    const DispatchLayout layout =
        get_dispatch_layout(inputs[r].topk_idx.data(), inputs[r].num_tokens, 2, 4, 2);
    inputs[r].is_token_in_rank = layout.is_token_in_rank;
    inputs[r].topk_idx.clear();
    inputs[r].topk_weights.clear();
  }
  NormalDispatchResult result = normal_dispatch(params, inputs);
  EXPECT_EQ(float_values(result.ranks[1].recv_x),
            (std::vector<float>{1, 2, 3, 4, 9, 10, 11, 12, -1, -2, -3, -4}));
  EXPECT_TRUE(result.ranks[1].recv_topk_idx.empty());
  EXPECT_TRUE(result.ranks[1].recv_topk_weights.empty());
  EXPECT_TRUE(result.ranks[1].num_recv_tokens_per_expert_list.empty());

  // With the layout's expert counts the per-expert list comes back.
  const std::vector<NormalDispatchRankInput> with_topk = small_inputs();
  for (int r = 0; r < 2; ++r) {
    inputs[r].num_tokens_per_expert =
        get_dispatch_layout(with_topk[r].topk_idx.data(), with_topk[r].num_tokens, 2, 4, 2)
            .num_tokens_per_expert;
  }
  result = normal_dispatch(params, inputs);
  EXPECT_EQ(result.ranks[0].num_recv_tokens_per_expert_list, (std::vector<int>{1, 2}));
  EXPECT_EQ(result.ranks[1].num_recv_tokens_per_expert_list, (std::vector<int>{1, 3}));

  inputs[1].num_tokens_per_expert.clear();  // given by one rank only
  EXPECT_THROW(normal_dispatch(params, inputs), epx::Error);
  inputs[0].num_tokens_per_expert.clear();
  inputs[0].is_token_in_rank[0] = 2;
  EXPECT_THROW(normal_dispatch(params, inputs), epx::Error);
}

TEST(ReferenceNormal, Fp8PayloadCarriedUnchanged) {
  NormalDispatchParams params = small_params();
  params.hidden = 256;
  params.format = PayloadFormat::kFp8;
  std::vector<NormalDispatchRankInput> inputs = small_inputs();
  for (int r = 0; r < 2; ++r) {
    const Fp8Tokens tokens = random_fp8_tokens(40 + r, inputs[r].num_tokens, 256, r);
    inputs[r].x.clear();
    inputs[r].x_fp8 = tokens.x;
    inputs[r].x_scales = tokens.scales;
  }
  const NormalDispatchResult result = normal_dispatch(params, inputs);
  for (int d = 0; d < 2; ++d) {
    const NormalDispatchRankOutput& out = result.ranks[d];
    EXPECT_TRUE(out.recv_x.empty());
    ASSERT_EQ(out.recv_x_fp8.size(), 3u * 256);
    ASSERT_EQ(out.recv_x_scales.size(), 3u * 2);
    for (int row = 0; row < out.num_recv_tokens; ++row) {
      const NormalDispatchRankInput& src = inputs[out.recv_src_rank[row]];
      const int t = out.recv_src_token_idx[row];
      for (int c = 0; c < 256; ++c) ASSERT_EQ(out.recv_x_fp8[row * 256 + c], src.x_fp8[t * 256 + c]);
      for (int g = 0; g < 2; ++g) ASSERT_EQ(out.recv_x_scales[row * 2 + g], src.x_scales[t * 2 + g]);
    }
  }
  params.hidden = 200;  // FP8 needs whole scale groups
  EXPECT_THROW(normal_dispatch(params, inputs), epx::Error);
}

TEST(ReferenceNormal, RejectsBadInputs) {
  NormalDispatchParams params = small_params();
  std::vector<NormalDispatchRankInput> inputs = small_inputs();
  inputs[0].topk_idx[0] = 4;
  EXPECT_THROW(normal_dispatch(params, inputs), epx::Error);
  inputs = small_inputs();
  inputs[1].x.pop_back();
  EXPECT_THROW(normal_dispatch(params, inputs), epx::Error);
  inputs = small_inputs();
  inputs[0].is_token_in_rank = {1, 1, 1, 1, 1, 1};  // contradicts topk_idx
  EXPECT_THROW(normal_dispatch(params, inputs), epx::Error);
  inputs = small_inputs();
  inputs.pop_back();
  EXPECT_THROW(normal_dispatch(params, inputs), epx::Error);
  params.expert_alignment = 0;
  EXPECT_THROW(normal_dispatch(params, small_inputs()), epx::Error);
  params = small_params();
  params.num_experts = 5;
  EXPECT_THROW(normal_dispatch(params, small_inputs()), epx::Error);

  const NormalDispatchResult dispatch = normal_dispatch(small_params(), small_inputs());
  std::vector<NormalCombineRankInput> combine(2);
  combine[0].x.resize(12);
  combine[1].x.resize(11);
  EXPECT_THROW(normal_combine(dispatch.handle, NormalCombineParams{}, combine), epx::Error);
  combine[1].x.resize(12);
  EXPECT_NO_THROW(normal_combine(dispatch.handle, NormalCombineParams{}, combine));
  EXPECT_THROW(normal_combine(dispatch.handle, NormalCombineParams{0, 3}, combine), epx::Error);
  EXPECT_THROW(normal_combine(dispatch.handle, NormalCombineParams{2, 0}, combine), epx::Error);
}

// ---- Invariants on random shapes ----

struct RandomCase {
  int num_ranks;
  int num_experts;
  int hidden;
  int num_topk;
  std::vector<int> num_tokens;
  bool unbalanced;
};

std::vector<NormalDispatchRankInput> make_inputs(const RandomCase& c, uint64_t seed) {
  const std::vector<std::vector<int64_t>> routing =
      make_routing(seed, c.num_tokens, c.num_topk, c.num_experts, c.num_ranks, c.unbalanced);
  std::vector<NormalDispatchRankInput> inputs(c.num_ranks);
  for (int r = 0; r < c.num_ranks; ++r) {
    inputs[r].num_tokens = c.num_tokens[r];
    inputs[r].x = random_bf16_tokens(seed * 100 + 50 + r, c.num_tokens[r], c.hidden, r);
    inputs[r].topk_idx = routing[r];
    inputs[r].topk_weights = random_topk_weights(seed * 100 + 70 + r, c.num_tokens[r], c.num_topk);
  }
  return inputs;
}

void check_random_case(const RandomCase& c, uint64_t seed, int expert_alignment) {
  const std::vector<NormalDispatchRankInput> inputs = make_inputs(c, seed);
  NormalDispatchParams params;
  params.num_ranks = c.num_ranks;
  params.num_experts = c.num_experts;
  params.hidden = c.hidden;
  params.num_topk = c.num_topk;
  params.expert_alignment = expert_alignment;
  const NormalDispatchResult result = normal_dispatch(params, inputs);
  const int experts_per_rank = c.num_experts / c.num_ranks;
  const int hidden = c.hidden;
  const int num_topk = c.num_topk;

  std::vector<DispatchLayout> layouts;
  for (int s = 0; s < c.num_ranks; ++s) {
    layouts.push_back(get_dispatch_layout(inputs[s].topk_idx.data(), c.num_tokens[s], num_topk, c.num_experts,
                                          c.num_ranks));
  }
  for (int d = 0; d < c.num_ranks; ++d) {
    const NormalDispatchRankOutput& out = result.ranks[d];
    int expected_rows = 0;
    for (int s = 0; s < c.num_ranks; ++s) {
      EXPECT_EQ(out.num_recv_tokens_per_rank[s], layouts[s].num_tokens_per_rank[d]);
      expected_rows += layouts[s].num_tokens_per_rank[d];
    }
    ASSERT_EQ(out.num_recv_tokens, expected_rows);
    // Rows: exactly the tokens with an expert here, ordered by (source rank, token index), each stamped
    // with where it came from.
    int row = 0;
    for (int s = 0; s < c.num_ranks; ++s) {
      EXPECT_EQ(out.recv_rank_prefix[s], row);
      for (int t = 0; t < c.num_tokens[s]; ++t) {
        if (!layouts[s].is_token_in_rank[t * c.num_ranks + d]) continue;
        ASSERT_EQ(out.recv_src_rank[row], s);
        ASSERT_EQ(out.recv_src_token_idx[row], t);
        const Stamp stamp = read_stamp(&out.recv_x[static_cast<size_t>(row) * hidden], hidden);
        ASSERT_EQ(stamp.src_rank, s);
        ASSERT_EQ(stamp.token_idx, t);
        for (int k = 0; k < num_topk; ++k) {
          const int64_t expert = inputs[s].topk_idx[t * num_topk + k];
          const bool here = expert >= 0 && expert / experts_per_rank == d;
          ASSERT_EQ(out.recv_topk_idx[row * num_topk + k], here ? expert - d * experts_per_rank : -1);
          ASSERT_EQ(out.recv_topk_weights[row * num_topk + k],
                    here ? inputs[s].topk_weights[t * num_topk + k] : 0.0f);
        }
        ++row;
      }
    }
    // Per-expert counts: rows listing the expert, rounded up to the alignment.
    for (int e = 0; e < experts_per_rank; ++e) {
      int listed = 0;
      for (int r = 0; r < out.num_recv_tokens; ++r) {
        bool has = false;
        for (int k = 0; k < num_topk; ++k) has = has || out.recv_topk_idx[r * num_topk + k] == e;
        listed += has ? 1 : 0;
      }
      const int aligned = out.num_recv_tokens_per_expert_list[e];
      EXPECT_EQ(aligned % expert_alignment, 0);
      EXPECT_GE(aligned, listed);
      EXPECT_LT(aligned - listed, expert_alignment);
    }
  }

  // Identity experts: every token comes back times the number of ranks it went to (exact: small integers),
  // and the weights come back where the id was kept.
  std::vector<NormalCombineRankInput> combine(c.num_ranks);
  for (int d = 0; d < c.num_ranks; ++d) {
    combine[d].x = result.ranks[d].recv_x;
    combine[d].topk_weights = result.ranks[d].recv_topk_weights;
  }
  const std::vector<NormalCombineRankOutput> out =
      normal_combine(result.handle, NormalCombineParams{num_topk, 0}, combine);
  for (int s = 0; s < c.num_ranks; ++s) {
    for (int t = 0; t < c.num_tokens[s]; ++t) {
      int copies = 0;
      for (int d = 0; d < c.num_ranks; ++d) copies += layouts[s].is_token_in_rank[t * c.num_ranks + d];
      for (int ch = 0; ch < hidden; ++ch) {
        const float x = epx::bf16_to_float(inputs[s].x[static_cast<size_t>(t) * hidden + ch]);
        ASSERT_EQ(epx::bf16_to_float(out[s].combined_x[static_cast<size_t>(t) * hidden + ch]), x * copies)
            << "rank " << s << " token " << t << " channel " << ch;
      }
      for (int k = 0; k < num_topk; ++k) {
        const bool kept = inputs[s].topk_idx[t * num_topk + k] >= 0;
        EXPECT_EQ(out[s].combined_topk_weights[t * num_topk + k],
                  kept ? inputs[s].topk_weights[t * num_topk + k] : 0.0f);
      }
    }
  }

  // Worst-case mode: the same real rows, then padding; combine gives the same result.
  int max_rows = 0;
  for (const NormalDispatchRankOutput& o : result.ranks) max_rows = std::max(max_rows, o.num_recv_tokens);
  params.num_worst_tokens = max_rows + 3;
  const NormalDispatchResult worst = normal_dispatch(params, inputs);
  std::vector<NormalCombineRankInput> worst_combine(c.num_ranks);
  for (int d = 0; d < c.num_ranks; ++d) {
    const NormalDispatchRankOutput& w = worst.ranks[d];
    const NormalDispatchRankOutput& n = result.ranks[d];
    ASSERT_EQ(w.num_rows, max_rows + 3);
    ASSERT_EQ(w.num_recv_tokens, n.num_recv_tokens);
    EXPECT_TRUE(std::equal(n.recv_x.begin(), n.recv_x.end(), w.recv_x.begin()));
    EXPECT_TRUE(std::equal(n.recv_topk_idx.begin(), n.recv_topk_idx.end(), w.recv_topk_idx.begin()));
    for (int r = n.num_recv_tokens; r < w.num_rows; ++r) EXPECT_EQ(w.recv_src_rank[r], -1);
    worst_combine[d].x = w.recv_x;
  }
  const auto worst_out = normal_combine(worst.handle, NormalCombineParams{}, worst_combine);
  for (int s = 0; s < c.num_ranks; ++s) EXPECT_EQ(worst_out[s].combined_x, out[s].combined_x);
}

TEST(ReferenceNormal, RandomBalancedInvariants) {
  check_random_case(RandomCase{4, 32, 256, 4, {37, 0, 1, 64}, false}, 1, 1);
  check_random_case(RandomCase{8, 64, 128, 8, {50, 17, 3, 1, 0, 44, 9, 30}, false}, 2, 4);
  check_random_case(RandomCase{1, 8, 128, 3, {20}, false}, 3, 1);
}

TEST(ReferenceNormal, RandomUnbalancedInvariants) {
  check_random_case(RandomCase{4, 32, 256, 6, {80, 1, 0, 40}, true}, 4, 128);
  check_random_case(RandomCase{2, 8, 128, 2, {30, 25}, true}, 5, 3);
}

// The bench shape: 4 ranks x 4096 tokens x 7168 hidden, top-8 of 256: the oracle of GPU tests at full size.
// Its time is printed, not asserted (a timed assertion failed under the sanitizers on a busy 2-core machine:
// speed belongs in benchmarks).
TEST(ReferenceNormal, LargeDispatchCombineAtBenchShape) {
  const int num_ranks = 4, num_tokens = 4096, hidden = 7168, num_topk = 8, num_experts = 256;
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  std::vector<NormalDispatchRankInput> inputs(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    inputs[r].num_tokens = num_tokens;
    inputs[r].x = random_bf16_tokens(900 + r, num_tokens, hidden, r);
    inputs[r].topk_idx = random_topk_idx(910 + r, num_tokens, num_topk, num_experts);
    inputs[r].topk_weights = random_topk_weights(920 + r, num_tokens, num_topk);
  }
  const auto generated = Clock::now();
  NormalDispatchParams params;
  params.num_ranks = num_ranks;
  params.num_experts = num_experts;
  params.hidden = hidden;
  params.num_topk = num_topk;
  NormalDispatchResult result = normal_dispatch(params, inputs);
  const auto dispatched = Clock::now();
  std::vector<NormalCombineRankInput> combine(num_ranks);
  for (int d = 0; d < num_ranks; ++d) {
    combine[d].x = std::move(result.ranks[d].recv_x);  // identity experts, no copy
    combine[d].topk_weights = std::move(result.ranks[d].recv_topk_weights);
  }
  const std::vector<NormalCombineRankOutput> out =
      normal_combine(result.handle, NormalCombineParams{num_topk, 0}, combine);
  const auto combined = Clock::now();
  const auto seconds = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
  std::printf("reference 4x4096x7168 top-8/256: inputs %.2f s, dispatch %.2f s, combine %.2f s\n",
              seconds(generated - start), seconds(dispatched - generated), seconds(combined - dispatched));

  // Spot checks: row counts and a few tokens.
  for (int s = 0; s < num_ranks; ++s) {
    const DispatchLayout layout =
        get_dispatch_layout(inputs[s].topk_idx.data(), num_tokens, num_topk, num_experts, num_ranks);
    for (int t = 0; t < num_tokens; t += 511) {
      int copies = 0;
      for (int d = 0; d < num_ranks; ++d) copies += layout.is_token_in_rank[t * num_ranks + d];
      for (int ch = 0; ch < hidden; ch += 97) {
        ASSERT_EQ(epx::bf16_to_float(out[s].combined_x[static_cast<size_t>(t) * hidden + ch]),
                  epx::bf16_to_float(inputs[s].x[static_cast<size_t>(t) * hidden + ch]) * copies);
      }
    }
  }
}

}  // namespace
