#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "epx/error.hpp"
#include "formats/bf16.hpp"
#include "formats/fp8.hpp"
#include "formats/ue8m0.hpp"
#include "reference/low_latency.hpp"
#include "reference/test_data.hpp"
#include "small_low_latency_params.hpp"

namespace {

using namespace epx::reference;

// ---- Hand-checked: 2 ranks, 4 experts (0,1 on rank 0; 2,3 on rank 1), M = 3, hidden 128, top-2 ----

constexpr int kHidden = 128;

LowLatencyParams small_params() {
  return epx::test_support::small_low_latency_params(kHidden);
}

// Token t of rank s holds the integer value (10 s + t + 1) in every channel (channel 0 negated).
std::vector<uint16_t> small_tokens(int src_rank, int num_tokens) {
  std::vector<uint16_t> x(static_cast<size_t>(num_tokens) * kHidden);
  for (int t = 0; t < num_tokens; ++t) {
    for (int c = 0; c < kHidden; ++c) {
      const float v = static_cast<float>(10 * src_rank + t + 1);
      x[t * kHidden + c] = epx::float_to_bf16(c == 0 ? -v : v);
    }
  }
  return x;
}

std::vector<LowLatencyDispatchRankInput> small_inputs() {
  std::vector<LowLatencyDispatchRankInput> inputs(2);
  inputs[0].num_tokens = 3;
  inputs[0].x = small_tokens(0, 3);
  inputs[0].topk_idx = {0, 3, 1, -1, 3, 2};
  inputs[1].num_tokens = 2;
  inputs[1].x = small_tokens(1, 2);
  inputs[1].topk_idx = {3, 0, 1, 1};  // token 1 lists expert 1 twice: one row
  return inputs;
}

TEST(ReferenceLowLatency, HandCheckedDispatchLayout) {
  LowLatencyDispatchOptions options;
  options.use_fp8 = false;
  std::vector<std::vector<int>> stats = {{5, 0}, {0, 7}};
  const auto out = low_latency_dispatch(small_params(), options, small_inputs(), &stats);
  ASSERT_EQ(out.size(), 2u);
  // Rank 0: expert 0 <- (0,0), (1,0); expert 1 <- (0,1), (1,1).
  EXPECT_EQ(out[0].recv_count, (std::vector<int>{2, 2}));
  EXPECT_EQ(out[0].recv_src_begin, (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(out[0].recv_src_count, (std::vector<int>{1, 1, 1, 1}));
  EXPECT_EQ(out[0].recv_src_rank, (std::vector<int>{0, 1, -1, -1, -1, -1, 0, 1, -1, -1, -1, -1}));
  EXPECT_EQ(out[0].recv_src_token_idx, (std::vector<int>{0, 0, -1, -1, -1, -1, 1, 1, -1, -1, -1, -1}));
  // Rank 1: expert 2 <- (0,2); expert 3 <- (0,0), (0,2), (1,0).
  EXPECT_EQ(out[1].recv_count, (std::vector<int>{1, 3}));
  EXPECT_EQ(out[1].recv_src_begin, (std::vector<int>{0, 1, 0, 2}));
  EXPECT_EQ(out[1].recv_src_count, (std::vector<int>{1, 0, 2, 1}));
  EXPECT_EQ(out[1].recv_src_rank, (std::vector<int>{0, -1, -1, -1, -1, -1, 0, 0, 1, -1, -1, -1}));
  EXPECT_EQ(out[1].recv_src_token_idx, (std::vector<int>{2, -1, -1, -1, -1, -1, 0, 2, 0, -1, -1, -1}));
  EXPECT_EQ(stats, (std::vector<std::vector<int>>{{7, 2}, {1, 10}}));

  // Payload: rows are the source rows unchanged; unused rows are zero.
  const int rows_per_expert = 6;
  const auto value = [&](int rank, int le, int row, int c) {
    return epx::bf16_to_float(
        out[rank].recv_x[(static_cast<size_t>(le) * rows_per_expert + row) * kHidden + c]);
  };
  EXPECT_EQ(value(1, 1, 0, 5), 1.0f);
  EXPECT_EQ(value(1, 1, 1, 5), 3.0f);
  EXPECT_EQ(value(1, 1, 2, 5), 11.0f);
  EXPECT_EQ(value(1, 1, 2, 0), -11.0f);
  EXPECT_EQ(value(0, 1, 1, 7), 12.0f);
  EXPECT_EQ(value(0, 1, 2, 7), 0.0f);

  const std::vector<std::vector<int64_t>> id_storage = {small_inputs()[0].topk_idx,
                                                        small_inputs()[1].topk_idx};
  const auto rows =
      low_latency_recv_rows(small_params(), {id_storage[0].data(), id_storage[1].data()}, {3, 2});
  EXPECT_EQ(rows[0], (std::vector<int>{0, 0, 0, -1, 1, 0}));
  EXPECT_EQ(rows[1], (std::vector<int>{2, 1, 1, 1}));
}

// The combine inputs of small_inputs() dispatched with `params` (BF16) through identity experts, with
// hand-picked weights (the -1 entry's weight is ignored).
std::vector<LowLatencyCombineRankInput> identity_combine_inputs(const LowLatencyParams& params) {
  LowLatencyDispatchOptions options;
  options.use_fp8 = false;
  const auto dispatch = low_latency_dispatch(params, options, small_inputs());
  std::vector<LowLatencyCombineRankInput> inputs(2);
  const std::vector<LowLatencyDispatchRankInput> tokens = small_inputs();
  for (int r = 0; r < 2; ++r) {
    inputs[r].num_tokens = tokens[r].num_tokens;
    inputs[r].x = dispatch[r].recv_x;  // identity experts
    inputs[r].topk_idx = tokens[r].topk_idx;
  }
  inputs[0].topk_weights = {0.5f, 0.25f, 2.0f, 100.0f, 0.125f, 1.0f};
  inputs[1].topk_weights = {1.0f, 0.5f, 0.25f, 0.5f};
  return inputs;
}

TEST(ReferenceLowLatency, HandCheckedCombine) {
  const auto out = low_latency_combine(small_params(), LowLatencyCombineOptions{},
                                       identity_combine_inputs(small_params()));
  const auto at = [&](int rank, int t, int c) {
    return epx::bf16_to_float(out[rank].combined_x[t * kHidden + c]);
  };
  EXPECT_EQ(at(0, 0, 3), 0.75f);   // (0.5 + 0.25) * 1
  EXPECT_EQ(at(0, 1, 3), 4.0f);    // 2 * 2, -1 skipped
  EXPECT_EQ(at(0, 2, 3), 3.375f);  // (0.125 + 1) * 3
  EXPECT_EQ(at(0, 2, 0), -3.375f);
  EXPECT_EQ(at(1, 0, 3), 16.5f);  // 1.5 * 11
  EXPECT_EQ(at(1, 1, 3), 9.0f);   // both listings of expert 1 weight the one row: 0.75 * 12
}

// Pre-reduced: each rank sums its own experts' weighted rows and rounds once to BF16; the owner adds the
// ranks' partials. Token (0, 0) lists expert 0 (rank 0, weight 1 + 2^-8) and expert 3 (rank 1, weight 2^-8)
// over rows of 1: the default rounds 1 + 2^-7 once (exact in BF16); pre-reduced, rank 0's partial
// 1 + 2^-8 rounds to 1 (a tie, to even) before 2^-8 is added, and 1 + 2^-8 rounds to 1 again.
TEST(ReferenceLowLatency, PreReducedCombineRoundsEachRanksPartial) {
  std::vector<LowLatencyCombineRankInput> inputs = identity_combine_inputs(small_params());
  inputs[0].topk_weights[0] = 1.0f + 1.0f / 256;
  inputs[0].topk_weights[1] = 1.0f / 256;
  LowLatencyCombineOptions pre;
  pre.pre_reduce = true;
  const auto in_order = low_latency_combine(small_params(), LowLatencyCombineOptions{}, inputs);
  const auto pre_reduced = low_latency_combine(small_params(), pre, inputs);
  const auto at = [&](const std::vector<epx::reference::LowLatencyCombineRankOutput>& out, int rank, int t,
                      int c) { return epx::bf16_to_float(out[rank].combined_x[t * kHidden + c]); };
  EXPECT_EQ(at(in_order, 0, 0, 3), 1.0f + 1.0f / 128);
  EXPECT_EQ(at(pre_reduced, 0, 0, 3), 1.0f);
  // Where every partial is exact in BF16 the two orders agree bit for bit (the other tokens).
  for (int rank = 0; rank < 2; ++rank) {
    for (int t = rank == 0 ? 1 : 0; t < inputs[rank].num_tokens; ++t) {
      for (int c = 0; c < kHidden; ++c) EXPECT_EQ(at(pre_reduced, rank, t, c), at(in_order, rank, t, c));
    }
  }
  // LogFMT codes the partial rows instead of the expert rows (within the format's error).
  pre.use_logfmt = true;
  pre.logfmt_within_node = true;
  LowLatencyParams params = small_params();
  params.hidden = 128;
  std::vector<LowLatencyCombineRankInput> wide = inputs;
  for (LowLatencyCombineRankInput& in : wide) {
    std::vector<uint16_t> x(in.x.size() / kHidden * 128);
    for (size_t row = 0; row < in.x.size() / kHidden; ++row)
      for (int c = 0; c < 128; ++c) x[row * 128 + c] = in.x[row * kHidden + c % kHidden];
    in.x = x;
  }
  const auto logfmt = low_latency_combine(params, pre, wide);
  EXPECT_NEAR(epx::bf16_to_float(logfmt[1].combined_x[3]), 16.5f, 16.5f * 0.02f);  // 11 + 0.5 * 11
}

TEST(ReferenceLowLatency, RejectsBadArguments) {
  LowLatencyDispatchOptions options;
  options.use_ue8m0 = true;  // without round_scale
  EXPECT_THROW(low_latency_dispatch(small_params(), options, small_inputs()), epx::Error);
  options = LowLatencyDispatchOptions{};
  LowLatencyParams params = small_params();
  params.num_max_dispatch_tokens_per_rank = 2;  // rank 0 has 3 tokens
  EXPECT_THROW(low_latency_dispatch(params, options, small_inputs()), epx::Error);
  params = small_params();
  params.hidden = 64;  // FP8 needs whole groups
  std::vector<LowLatencyDispatchRankInput> inputs = small_inputs();
  EXPECT_THROW(low_latency_dispatch(params, options, inputs), epx::Error);
  inputs[1].topk_idx[0] = 4;
  EXPECT_THROW(low_latency_dispatch(small_params(), options, inputs), epx::Error);
  inputs = small_inputs();
  inputs[0].x.pop_back();
  EXPECT_THROW(low_latency_dispatch(small_params(), options, inputs), epx::Error);
  std::vector<std::vector<int>> stats(2, std::vector<int>(3, 0));  // wrong L
  EXPECT_THROW(low_latency_dispatch(small_params(), options, small_inputs(), &stats), epx::Error);
}

// ---- Invariants on random shapes ----

struct RandomCase {
  int num_ranks;
  int num_experts;
  int hidden;
  int num_topk;
  int num_max_tokens;
  std::vector<int> num_tokens;
  bool unbalanced;
};

LowLatencyParams params_of(const RandomCase& c) {
  LowLatencyParams params;
  params.num_ranks = c.num_ranks;
  params.num_experts = c.num_experts;
  params.hidden = c.hidden;
  params.num_topk = c.num_topk;
  params.num_max_dispatch_tokens_per_rank = c.num_max_tokens;
  return params;
}

std::vector<LowLatencyDispatchRankInput> make_inputs(const RandomCase& c, uint64_t seed, TokenValues values) {
  const std::vector<std::vector<int64_t>> routing =
      make_routing(seed, c.num_tokens, c.num_topk, c.num_experts, c.num_ranks, c.unbalanced);
  std::vector<LowLatencyDispatchRankInput> inputs(c.num_ranks);
  for (int r = 0; r < c.num_ranks; ++r) {
    inputs[r].num_tokens = c.num_tokens[r];
    inputs[r].x = random_bf16_tokens(seed * 100 + 50 + r, c.num_tokens[r], c.hidden, r, values);
    inputs[r].topk_idx = routing[r];
  }
  return inputs;
}

bool lists_expert(const LowLatencyDispatchRankInput& in, int num_topk, int t, int64_t expert) {
  for (int k = 0; k < num_topk; ++k) {
    if (in.topk_idx[t * num_topk + k] == expert) return true;
  }
  return false;
}

void check_layout(const RandomCase& c, const std::vector<LowLatencyDispatchRankInput>& inputs,
                  const std::vector<LowLatencyDispatchRankOutput>& out) {
  const int num_local = c.num_experts / c.num_ranks;
  const int rows_per_expert = c.num_ranks * c.num_max_tokens;
  for (int d = 0; d < c.num_ranks; ++d) {
    for (int le = 0; le < num_local; ++le) {
      const int64_t expert = static_cast<int64_t>(d) * num_local + le;
      int row = 0;
      for (int s = 0; s < c.num_ranks; ++s) {
        // Rows of source s: exactly its tokens listing the expert, ascending, once each.
        ASSERT_EQ(out[d].recv_src_begin[le * c.num_ranks + s], row);
        int count = 0;
        for (int t = 0; t < c.num_tokens[s]; ++t) {
          if (!lists_expert(inputs[s], c.num_topk, t, expert)) continue;
          const size_t flat = static_cast<size_t>(le) * rows_per_expert + row;
          ASSERT_EQ(out[d].recv_src_rank[flat], s);
          ASSERT_EQ(out[d].recv_src_token_idx[flat], t);
          ++row;
          ++count;
        }
        ASSERT_EQ(out[d].recv_src_count[le * c.num_ranks + s], count);
      }
      ASSERT_EQ(out[d].recv_count[le], row);
      for (int r = row; r < rows_per_expert; ++r) {
        ASSERT_EQ(out[d].recv_src_rank[static_cast<size_t>(le) * rows_per_expert + r], -1);
        ASSERT_EQ(out[d].recv_src_token_idx[static_cast<size_t>(le) * rows_per_expert + r], -1);
      }
    }
  }
}

void check_bf16_dispatch_and_combine(const RandomCase& c, uint64_t seed) {
  const LowLatencyParams params = params_of(c);
  const std::vector<LowLatencyDispatchRankInput> inputs = make_inputs(c, seed, TokenValues::kSmallIntegers);
  LowLatencyDispatchOptions options;
  options.use_fp8 = false;
  const int num_local = c.num_experts / c.num_ranks;
  std::vector<std::vector<int>> stats(c.num_ranks, std::vector<int>(num_local, 0));
  const auto out = low_latency_dispatch(params, options, inputs, &stats);
  low_latency_dispatch(params, options, inputs, &stats);
  check_layout(c, inputs, out);
  const int rows_per_expert = c.num_ranks * c.num_max_tokens;
  for (int d = 0; d < c.num_ranks; ++d) {
    for (int le = 0; le < num_local; ++le) {
      EXPECT_EQ(stats[d][le], 2 * out[d].recv_count[le]);
      for (int row = 0; row < rows_per_expert; ++row) {
        const size_t flat = static_cast<size_t>(le) * rows_per_expert + row;
        const uint16_t* got = &out[d].recv_x[flat * c.hidden];
        if (row >= out[d].recv_count[le]) {
          ASSERT_EQ(got[0], 0) << "unused rows are zero in the reference";
          continue;
        }
        const Stamp stamp = read_stamp(got, c.hidden);
        ASSERT_EQ(stamp.src_rank, out[d].recv_src_rank[flat]);
        ASSERT_EQ(stamp.token_idx, out[d].recv_src_token_idx[flat]);
        const uint16_t* want = &inputs[stamp.src_rank].x[static_cast<size_t>(stamp.token_idx) * c.hidden];
        ASSERT_TRUE(std::equal(got, got + c.hidden, want));
      }
    }
  }

  // Identity experts: the weighted sum of x over the token's listings (exact: small integers, 1/16 weights).
  std::vector<LowLatencyCombineRankInput> combine(c.num_ranks);
  for (int r = 0; r < c.num_ranks; ++r) {
    combine[r].num_tokens = c.num_tokens[r];
    combine[r].x = out[r].recv_x;
    combine[r].topk_idx = inputs[r].topk_idx;
    combine[r].topk_weights = random_topk_weights(seed * 100 + 80 + r, c.num_tokens[r], c.num_topk);
  }
  const auto combined = low_latency_combine(params, LowLatencyCombineOptions{}, combine);
  for (int s = 0; s < c.num_ranks; ++s) {
    for (int t = 0; t < c.num_tokens[s]; ++t) {
      double weight_sum = 0;
      for (int k = 0; k < c.num_topk; ++k) {
        if (combine[s].topk_idx[t * c.num_topk + k] >= 0)
          weight_sum += combine[s].topk_weights[t * c.num_topk + k];
      }
      for (int ch = 0; ch < c.hidden; ++ch) {
        const double x = epx::bf16_to_float(inputs[s].x[static_cast<size_t>(t) * c.hidden + ch]);
        const float want = epx::bf16_to_float(epx::float_to_bf16(static_cast<float>(weight_sum * x)));
        ASSERT_EQ(epx::bf16_to_float(combined[s].combined_x[static_cast<size_t>(t) * c.hidden + ch]), want)
            << "rank " << s << " token " << t << " channel " << ch;
      }
    }
  }
}

const RandomCase kBalanced{4, 32, 256, 6, 16, {16, 0, 1, 9}, false};
const RandomCase kUnbalanced{4, 32, 384, 8, 40, {40, 33, 1, 20}, true};
const RandomCase kDeepSeekLike{2, 18, 512, 8, 12, {12, 7}, false};  // 9 local experts, top-8 of 18

TEST(ReferenceLowLatency, RandomBf16DispatchAndIdentityCombine) {
  check_bf16_dispatch_and_combine(kBalanced, 1);
  check_bf16_dispatch_and_combine(kUnbalanced, 2);
  check_bf16_dispatch_and_combine(kDeepSeekLike, 3);
  check_bf16_dispatch_and_combine(RandomCase{1, 4, 128, 2, 5, {5}, false}, 4);
}

// FP8: bytes and scales are quantize_fp8_row of the source row; dequantized within the format's bound.
void check_fp8_dispatch(const RandomCase& c, uint64_t seed, bool round_scale) {
  const LowLatencyParams params = params_of(c);
  const std::vector<LowLatencyDispatchRankInput> inputs = make_inputs(c, seed, TokenValues::kUniform);
  LowLatencyDispatchOptions options;
  options.round_scale = round_scale;
  const auto out = low_latency_dispatch(params, options, inputs);
  check_layout(c, inputs, out);
  const int num_local = c.num_experts / c.num_ranks;
  const int rows_per_expert = c.num_ranks * c.num_max_tokens;
  const int num_groups = c.hidden / 128;
  std::vector<uint8_t> want_q(c.hidden);
  std::vector<float> want_scales(num_groups);
  for (int d = 0; d < c.num_ranks; ++d) {
    EXPECT_TRUE(out[d].recv_x.empty());
    EXPECT_TRUE(out[d].recv_x_scales_ue8m0.empty());
    ASSERT_EQ(out[d].recv_x_scales.size(), static_cast<size_t>(num_local) * rows_per_expert * num_groups);
    for (int le = 0; le < num_local; ++le) {
      for (int row = 0; row < out[d].recv_count[le]; ++row) {
        const size_t flat = static_cast<size_t>(le) * rows_per_expert + row;
        const uint16_t* src = &inputs[out[d].recv_src_rank[flat]]
                                   .x[static_cast<size_t>(out[d].recv_src_token_idx[flat]) * c.hidden];
        epx::quantize_fp8_row(src, c.hidden, round_scale, want_q.data(), want_scales.data());
        for (int g = 0; g < num_groups; ++g) {
          const float scale =
              out[d].recv_x_scales[epx::ll_scale_index(le, row, g, rows_per_expert, num_groups)];
          ASSERT_EQ(scale, want_scales[g]);
          for (int i = 0; i < 128; ++i) {
            const int ch = g * 128 + i;
            const uint8_t q = out[d].recv_x_fp8[flat * c.hidden + ch];
            ASSERT_EQ(q, want_q[ch]);
            const float x = epx::bf16_to_float(src[ch]);
            const float bound = std::fabs(x) / 16.0f + scale / 1024.0f + 1e-6f * std::fabs(x);
            ASSERT_LE(std::fabs(epx::e4m3_to_float(q) * scale - x), bound) << "channel " << ch;
          }
        }
      }
    }
  }
}

TEST(ReferenceLowLatency, RandomFp8DispatchMatchesCast) {
  check_fp8_dispatch(kBalanced, 5, false);
  check_fp8_dispatch(kUnbalanced, 6, true);
}

TEST(ReferenceLowLatency, Ue8m0WordsDecodeToRoundedScales) {
  for (const RandomCase& c : {kUnbalanced, kDeepSeekLike, RandomCase{2, 4, 640, 2, 4, {4, 3}, false}}) {
    const LowLatencyParams params = params_of(c);
    const std::vector<LowLatencyDispatchRankInput> inputs = make_inputs(c, 7, TokenValues::kUniform);
    LowLatencyDispatchOptions options;
    options.round_scale = true;
    const auto floats = low_latency_dispatch(params, options, inputs);
    options.use_ue8m0 = true;
    const auto packed = low_latency_dispatch(params, options, inputs);
    const int num_local = c.num_experts / c.num_ranks;
    const int rows_per_expert = c.num_ranks * c.num_max_tokens;
    const int num_groups = c.hidden / 128;
    const int num_words = ll_num_ue8m0_words(c.hidden);
    EXPECT_EQ(num_words, (num_groups + 3) / 4);
    for (int d = 0; d < c.num_ranks; ++d) {
      EXPECT_TRUE(packed[d].recv_x_scales.empty());
      EXPECT_EQ(packed[d].recv_x_fp8, floats[d].recv_x_fp8);
      ASSERT_EQ(packed[d].recv_x_scales_ue8m0.size(),
                static_cast<size_t>(num_local) * rows_per_expert * num_words);
      for (int le = 0; le < num_local; ++le) {
        for (int row = 0; row < packed[d].recv_count[le]; ++row) {
          for (int g = 0; g < num_words * 4; ++g) {
            const uint32_t word =
                packed[d]
                    .recv_x_scales_ue8m0[epx::ll_scale_index(le, row, g / 4, rows_per_expert, num_words)];
            const uint8_t byte = epx::unpack_ue8m0x4(word, g % 4);
            if (g >= num_groups) {
              ASSERT_EQ(byte, 0) << "padding byte";
              continue;
            }
            const float scale =
                floats[d].recv_x_scales[epx::ll_scale_index(le, row, g, rows_per_expert, num_groups)];
            ASSERT_EQ(epx::pow2_scale_from_ue8m0(byte), scale);
          }
        }
      }
    }
  }
}

// Combine inputs whose expert outputs are the BF16 dispatch's received rows of `inputs`, with random weights
// (seeded weight_seed + rank).
std::vector<LowLatencyCombineRankInput> bf16_dispatched_combine_inputs(
    const RandomCase& c, const std::vector<LowLatencyDispatchRankInput>& inputs, int weight_seed) {
  LowLatencyDispatchOptions options;
  options.use_fp8 = false;
  const auto dispatch = low_latency_dispatch(params_of(c), options, inputs);
  std::vector<LowLatencyCombineRankInput> combine(c.num_ranks);
  for (int r = 0; r < c.num_ranks; ++r) {
    combine[r].num_tokens = c.num_tokens[r];
    combine[r].x = dispatch[r].recv_x;
    combine[r].topk_idx = inputs[r].topk_idx;
    combine[r].topk_weights = random_topk_weights(weight_seed + r, c.num_tokens[r], c.num_topk);
  }
  return combine;
}

// LogFMT: each expert output row is round-tripped through the wire format before weighting; the result
// stays within the format's relative bound of the BF16 combine.
TEST(ReferenceLowLatency, LogfmtCombineWithinBound) {
  for (const RandomCase& c : {kBalanced, kUnbalanced}) {
    const LowLatencyParams params = params_of(c);
    const std::vector<LowLatencyDispatchRankInput> inputs = make_inputs(c, 8, TokenValues::kUniform);
    const std::vector<LowLatencyCombineRankInput> combine = bf16_dispatched_combine_inputs(c, inputs, 90);
    const auto exact = low_latency_combine(params, LowLatencyCombineOptions{}, combine);
    const auto logfmt = low_latency_combine(
        params, LowLatencyCombineOptions{.use_logfmt = true, .logfmt_within_node = true}, combine);
    bool any_difference = false;
    for (int s = 0; s < c.num_ranks; ++s) {
      for (int t = 0; t < c.num_tokens[s]; ++t) {
        for (int ch = 0; ch < c.hidden; ++ch) {
          // Sum of |w x| bounds the error of every term; the two BF16 roundings add a relative 2^-8 each.
          double magnitude = 0;
          for (int k = 0; k < c.num_topk; ++k) {
            if (combine[s].topk_idx[t * c.num_topk + k] < 0) continue;
            magnitude += combine[s].topk_weights[t * c.num_topk + k] *
                         std::fabs(epx::bf16_to_float(inputs[s].x[static_cast<size_t>(t) * c.hidden + ch]));
          }
          const size_t i = static_cast<size_t>(t) * c.hidden + ch;
          const double a = epx::bf16_to_float(exact[s].combined_x[i]);
          const double b = epx::bf16_to_float(logfmt[s].combined_x[i]);
          any_difference = any_difference || a != b;
          ASSERT_LE(std::fabs(a - b), magnitude * (0.023 + 2.0 / 256.0) + 1e-30)
              << "rank " << s << " token " << t << " channel " << ch;
          if (ch < kStampChannels) {
            ASSERT_EQ(a, b) << "the stamped group holds values >= 1 and travels as BF16";
          }
        }
      }
    }
    EXPECT_TRUE(any_difference) << "LogFMT should be lossy on values below 1";
  }
}

// LogFMT codes only the rows that cross nodes: within one node the combine is the BF16 one, and across
// nodes of two ranks a token whose experts all lie on its own node matches the BF16 combine, one whose
// experts all lie on the other node the combine coded on every link.
TEST(ReferenceLowLatency, LogfmtCodesTheRowsThatCrossNodes) {
  const RandomCase c{4, 32, 256, 2, 40, {40, 33, 1, 20}, false};  // top-2: many tokens on one node
  ASSERT_EQ(c.num_ranks % 2, 0);
  const LowLatencyParams params = params_of(c);
  const std::vector<LowLatencyDispatchRankInput> inputs = make_inputs(c, 8, TokenValues::kUniform);
  const std::vector<LowLatencyCombineRankInput> combine = bf16_dispatched_combine_inputs(c, inputs, 70);
  const auto exact = low_latency_combine(params, LowLatencyCombineOptions{}, combine);
  const auto everywhere = low_latency_combine(
      params, LowLatencyCombineOptions{.use_logfmt = true, .logfmt_within_node = true}, combine);
  const auto one_node = low_latency_combine(params, LowLatencyCombineOptions{.use_logfmt = true}, combine);
  const int half = c.num_ranks / 2;
  const auto two_nodes = low_latency_combine(
      params, LowLatencyCombineOptions{.use_logfmt = true, .ranks_per_node = half}, combine);
  const int num_local = c.num_experts / c.num_ranks;
  int own_node_tokens = 0;
  int other_node_tokens = 0;
  for (int s = 0; s < c.num_ranks; ++s) {
    EXPECT_EQ(one_node[s].combined_x, exact[s].combined_x) << "rank " << s;
    for (int t = 0; t < c.num_tokens[s]; ++t) {
      bool own = true;
      bool other = true;
      for (int k = 0; k < c.num_topk; ++k) {
        const int64_t expert = combine[s].topk_idx[t * c.num_topk + k];
        if (expert < 0) continue;
        const bool same_node = expert / num_local / half == s / half;
        own = own && same_node;
        other = other && !same_node;
      }
      const auto row = [&](const std::vector<LowLatencyCombineRankOutput>& out) {
        return std::vector<uint16_t>(out[s].combined_x.begin() + static_cast<ptrdiff_t>(t) * c.hidden,
                                     out[s].combined_x.begin() + static_cast<ptrdiff_t>(t + 1) * c.hidden);
      };
      if (own) {
        EXPECT_EQ(row(two_nodes), row(exact)) << "rank " << s << " token " << t;
        ++own_node_tokens;
      } else if (other) {
        EXPECT_EQ(row(two_nodes), row(everywhere)) << "rank " << s << " token " << t;
        ++other_node_tokens;
      }
    }
  }
  EXPECT_GT(own_node_tokens, 0);
  EXPECT_GT(other_node_tokens, 0);
  EXPECT_THROW(
      low_latency_combine(params, LowLatencyCombineOptions{.use_logfmt = true, .ranks_per_node = 3}, combine),
      epx::Error);
}

// ---- Rank masks: a masked rank's experts receive nothing, and combine leaves its contribution out ----

TEST(ReferenceLowLatencyMasks, MaskedRankSendsAndReceivesNothing) {
  LowLatencyDispatchOptions options;
  options.use_fp8 = false;
  LowLatencyParams params = small_params();
  params.masked_ranks = {1};
  std::vector<std::vector<int>> stats = {{0, 0}, {0, 0}};
  const auto out = low_latency_dispatch(params, options, small_inputs(), &stats);
  // Rank 0 keeps only its own tokens: expert 0 <- (0,0); expert 1 <- (0,1). Rank 1's tokens are left out.
  EXPECT_EQ(out[0].recv_count, (std::vector<int>{1, 1}));
  EXPECT_EQ(out[0].recv_src_begin, (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(out[0].recv_src_count, (std::vector<int>{1, 0, 1, 0}));
  EXPECT_EQ(out[0].recv_src_rank, (std::vector<int>{0, -1, -1, -1, -1, -1, 0, -1, -1, -1, -1, -1}));
  EXPECT_EQ(out[0].recv_src_token_idx, (std::vector<int>{0, -1, -1, -1, -1, -1, 1, -1, -1, -1, -1, -1}));
  // The masked rank's experts receive nothing.
  EXPECT_EQ(out[1].recv_count, (std::vector<int>{0, 0}));
  EXPECT_EQ(out[1].recv_src_count, (std::vector<int>{0, 0, 0, 0}));
  EXPECT_EQ(stats, (std::vector<std::vector<int>>{{1, 1}, {0, 0}}));

  const std::vector<std::vector<int64_t>> ids = {small_inputs()[0].topk_idx, small_inputs()[1].topk_idx};
  const auto rows = low_latency_recv_rows(params, {ids[0].data(), ids[1].data()}, {3, 2});
  EXPECT_EQ(rows[0], (std::vector<int>{0, -1, 0, -1, -1, -1}));  // entries on rank 1 count as -1
  EXPECT_EQ(rows[1], (std::vector<int>{-1, -1, -1, -1}));        // the masked source sends nothing
}

TEST(ReferenceLowLatencyMasks, CombineLeavesTheMaskedRankOut) {
  LowLatencyParams params = small_params();
  params.masked_ranks = {1};
  const auto out = low_latency_combine(params, LowLatencyCombineOptions{}, identity_combine_inputs(params));
  const auto at = [&](int rank, int t, int c) {
    return epx::bf16_to_float(out[rank].combined_x[t * kHidden + c]);
  };
  EXPECT_EQ(at(0, 0, 3), 0.5f);  // expert 3 (rank 1) left out: 0.5 * 1
  EXPECT_EQ(at(0, 1, 3), 4.0f);  // 2 * 2
  EXPECT_EQ(at(0, 2, 3), 0.0f);  // both experts on the masked rank: like two -1 entries
  EXPECT_EQ(at(1, 0, 3), 0.0f);  // the masked rank takes no part: its outputs are empty
  EXPECT_EQ(at(1, 1, 3), 0.0f);
}

// Masking equals rewriting the routing: the masked source with no tokens' routes, entries on masked ranks -1.
TEST(ReferenceLowLatencyMasks, MaskEqualsRewrittenRouting) {
  const RandomCase c = kUnbalanced;
  LowLatencyParams params = params_of(c);
  params.masked_ranks = {0, 2};
  const std::vector<LowLatencyDispatchRankInput> inputs = make_inputs(c, 11, TokenValues::kUniform);
  std::vector<LowLatencyDispatchRankInput> rewritten = inputs;
  const int num_local = c.num_experts / c.num_ranks;
  for (int s = 0; s < c.num_ranks; ++s) {
    for (int64_t& id : rewritten[s].topk_idx) {
      if (ll_is_masked(params, s) || (id >= 0 && ll_is_masked(params, static_cast<int>(id / num_local))))
        id = -1;
    }
  }
  LowLatencyDispatchOptions options;
  options.use_fp8 = false;
  const auto masked = low_latency_dispatch(params, options, inputs);
  const auto want = low_latency_dispatch(params_of(c), options, rewritten);
  for (int d = 0; d < c.num_ranks; ++d) {
    EXPECT_EQ(masked[d].recv_count, want[d].recv_count) << "rank " << d;
    EXPECT_EQ(masked[d].recv_src_begin, want[d].recv_src_begin) << "rank " << d;
    EXPECT_EQ(masked[d].recv_src_rank, want[d].recv_src_rank) << "rank " << d;
    EXPECT_EQ(masked[d].recv_src_token_idx, want[d].recv_src_token_idx) << "rank " << d;
    EXPECT_EQ(masked[d].recv_x, want[d].recv_x) << "rank " << d;
  }
  params.masked_ranks = {4};
  EXPECT_THROW(low_latency_dispatch(params, options, inputs), epx::Error);
}

}  // namespace
