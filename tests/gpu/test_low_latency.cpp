#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "epx/local_launcher.hpp"
#include "gpu/device_info.hpp"
#include "run_ranks.hpp"
#include "test_low_latency_harness.hpp"

namespace {

using epx::test::LowLatencyCase;
using epx::test::run_with_both_combine_orders;

using epx::test::run_low_latency_case;
using epx::test::small_low_latency_case;

// ---- Formats ----

TEST(LowLatency, Bf16TwoRanks) {
  LowLatencyCase c = small_low_latency_case(2);
  c.num_iterations = 3;
  run_low_latency_case(c);
}

TEST(LowLatency, Fp8TwoRanks) {
  LowLatencyCase c = small_low_latency_case(2);
  c.use_fp8 = true;
  c.num_iterations = 3;
  run_low_latency_case(c);
}

TEST(LowLatency, Fp8RoundScaleFourRanks) {
  LowLatencyCase c = small_low_latency_case(4);
  c.use_fp8 = true;
  c.round_scale = true;
  run_low_latency_case(c);
}

TEST(LowLatency, Fp8Ue8m0FourRanks) {
  LowLatencyCase c = small_low_latency_case(4);
  c.use_fp8 = c.round_scale = c.use_ue8m0 = true;
  c.hidden = 2048;
  run_low_latency_case(c);
}

TEST(LowLatency, Ue8m0PartialLastWord) {
  LowLatencyCase c = small_low_latency_case(2);
  c.use_fp8 = c.round_scale = c.use_ue8m0 = true;
  c.hidden = 2688;  // 21 groups: the last packed word holds one scale
  run_low_latency_case(c);
}

// LogFMT asked within the node: every row coded over NVLink.
TEST(LowLatency, LogfmtCombineFourRanks) {
  LowLatencyCase c = small_low_latency_case(4);
  c.use_fp8 = true;
  c.use_logfmt = c.logfmt_within_node = true;
  c.num_iterations = 2;
  run_low_latency_case(c);
}

// LogFMT alone within one node: every row stays within the node, so the combine is the BF16 one (the
// reference codes nothing), default and pre-reduced.
TEST(LowLatency, LogfmtWithinOneNodeIsTheBf16Combine) {
  LowLatencyCase c = small_low_latency_case(4);
  c.use_fp8 = true;
  c.use_logfmt = true;
  c.num_iterations = 2;
  run_with_both_combine_orders(c, run_low_latency_case);
}

// Top-16 of hidden 7168: a token's 16 returned rows x 56 groups exceed the receive's table of group
// constants (512 entries), so it decodes in two windows of groups.
TEST(LowLatency, LogfmtTopSixteenWideRowsTwoTableWindows) {
  LowLatencyCase c = small_low_latency_case(2);
  c.hidden = 7168;
  c.num_topk = 16;
  c.num_experts = 32;
  c.num_max_tokens = 8;
  c.use_logfmt = c.logfmt_within_node = true;
  c.num_iterations = 2;
  run_low_latency_case(c);
}

// The decode benchmark shape: 128 tokens per rank, hidden 7168, top-8 of 288 experts, 4 ranks.
TEST(LowLatency, DefaultShapeFp8FourRanks) {
  LowLatencyCase c;
  c.num_ranks = 4;
  c.num_max_tokens = 128;
  c.hidden = 7168;
  c.num_experts = 288;
  c.num_topk = 8;
  c.use_fp8 = true;
  c.stats = true;
  run_low_latency_case(c);
}

// ---- Hooks, zero copy, ordering ----

TEST(LowLatency, HooksTwoRanks) {
  LowLatencyCase c = small_low_latency_case(2);
  c.use_fp8 = true;
  c.dispatch_hook = c.combine_hook = true;
  c.num_iterations = 3;
  run_low_latency_case(c);
}

TEST(LowLatency, TwoPendingHooksFourRanks) {
  LowLatencyCase c = small_low_latency_case(4);
  c.dispatch_hook = c.combine_hook = true;
  c.pending_pairs = true;
  c.batch = 4;
  c.num_iterations = 4;
  run_low_latency_case(c);
}

TEST(LowLatency, ZeroCopyCombine) {
  LowLatencyCase c = small_low_latency_case(4);
  c.zero_copy = true;
  c.batch = 3;
  c.num_iterations = 3;
  run_low_latency_case(c);
}

TEST(LowLatency, ZeroCopyWithHooksAndLogfmt) {
  LowLatencyCase c = small_low_latency_case(2);
  c.zero_copy = c.combine_hook = c.dispatch_hook = c.use_logfmt = c.logfmt_within_node = true;
  c.num_iterations = 2;
  run_low_latency_case(c);
}

TEST(LowLatency, AsyncFinishEvents) {
  LowLatencyCase c = small_low_latency_case(2);
  c.async_finish = true;
  c.num_iterations = 2;
  run_low_latency_case(c);
}

// ---- Routing and sizes ----

TEST(LowLatency, TokenCountsZeroOneAndMax) {
  LowLatencyCase c = small_low_latency_case(4);
  c.num_tokens = {0, 1, c.num_max_tokens, 5};
  c.drop_probability = 0.2;
  c.use_fp8 = true;
  c.stats = true;
  c.num_iterations = 2;
  run_low_latency_case(c);
}

TEST(LowLatency, AllRanksEmpty) {
  LowLatencyCase c = small_low_latency_case(2);
  c.num_tokens = {0};
  run_low_latency_case(c);
}

TEST(LowLatency, UnbalancedRoutingAndDuplicates) {
  LowLatencyCase c = small_low_latency_case(4);
  c.unbalanced = true;
  c.duplicates = true;
  c.use_fp8 = true;
  c.stats = true;
  c.num_iterations = 2;
  run_low_latency_case(c);
}

TEST(LowLatency, HiddenSizesAndTopk) {
  const int hiddens[] = {2048, 4096, 8192, 2688};
  const int topks[] = {1, 8, 9};
  int i = 0;
  for (int hidden : hiddens) {
    for (int topk : topks) {
      LowLatencyCase c = small_low_latency_case(2);
      c.hidden = hidden;
      c.num_topk = topk;
      c.num_experts = 16;
      c.num_max_tokens = 8;
      c.use_fp8 = i % 2 == 0;
      c.use_logfmt = c.logfmt_within_node = i % 3 == 0;
      c.seed = 100 + i++;
      SCOPED_TRACE("hidden " + std::to_string(hidden) + " top-k " + std::to_string(topk));
      run_low_latency_case(c);
    }
  }
}

// More tokens than blocks: a block sends several tokens; the routing block lists all of them.
TEST(LowLatency, MoreTokensThanBlocks) {
  LowLatencyCase c = small_low_latency_case(2);
  c.num_max_tokens = 300;
  c.hidden = 256;
  c.num_tokens = {300, 133};
  c.duplicates = true;
  c.drop_probability = 0.1;
  c.use_fp8 = true;
  c.stats = true;
  c.num_iterations = 2;
  run_low_latency_case(c);
}

TEST(LowLatency, TopkSixteenManyExperts) {
  LowLatencyCase c = small_low_latency_case(4);
  c.num_topk = 16;
  c.num_experts = 256;
  c.use_fp8 = true;
  run_low_latency_case(c);
}

// ---- Pre-reduced combine (the dispatch carries the weights; one row per token and rank returns) ----

TEST(LowLatency, PreReduceBf16OneTwoFourRanks) {
  for (const int num_ranks : {1, 2, 4}) {
    LowLatencyCase c = small_low_latency_case(num_ranks);
    c.pre_reduce = true;
    c.num_iterations = 2;
    c.seed = 40 + num_ranks;
    SCOPED_TRACE(std::to_string(num_ranks) + " ranks");
    run_low_latency_case(c);
  }
}

TEST(LowLatency, PreReduceFp8LogfmtFourRanks) {
  LowLatencyCase c = small_low_latency_case(4);
  c.use_fp8 = true;
  c.use_logfmt = c.logfmt_within_node = true;
  c.pre_reduce = true;
  c.num_iterations = 2;
  run_low_latency_case(c);
}

// 0 and 1 tokens, -1 ids, a rank whose experts get nothing, duplicate listings (a row weighted twice), top-9.
TEST(LowLatency, PreReduceOddCountsUnbalancedDuplicates) {
  LowLatencyCase c = small_low_latency_case(4);
  c.num_tokens = {0, 1, c.num_max_tokens, 5};
  c.unbalanced = true;
  c.duplicates = true;
  c.drop_probability = 0.2;
  c.num_topk = 9;
  c.hidden = 2688;
  c.use_fp8 = true;
  c.pre_reduce = true;
  c.num_iterations = 3;
  run_low_latency_case(c);
}

TEST(LowLatency, PreReduceHiddenSizesAndLogfmt) {
  int i = 0;
  for (const int hidden : {128, 1024, 7168}) {
    for (const bool logfmt : {false, true}) {
      LowLatencyCase c = small_low_latency_case(2);
      c.hidden = hidden;
      c.num_topk = 8;
      c.num_experts = 16;
      c.num_max_tokens = 8;
      c.use_logfmt = c.logfmt_within_node = logfmt;
      c.pre_reduce = true;
      c.seed = 300 + i++;
      SCOPED_TRACE("hidden " + std::to_string(hidden) + (logfmt ? " LogFMT" : " BF16"));
      run_low_latency_case(c);
    }
  }
}

// The decode benchmark shape on one rank: every listing local, eight rows summed per token.
TEST(LowLatency, PreReduceDefaultShapeOneAndFourRanks) {
  for (const int num_ranks : {1, 4}) {
    LowLatencyCase c;
    c.num_ranks = num_ranks;
    c.num_max_tokens = 128;
    c.hidden = 7168;
    c.num_experts = 288;
    c.num_topk = 8;
    c.use_fp8 = true;
    c.pre_reduce = true;
    SCOPED_TRACE(std::to_string(num_ranks) + " ranks");
    run_low_latency_case(c);
  }
}

TEST(LowLatency, PreReduceGraphHooksZeroCopyLogfmt) {
  LowLatencyCase c = small_low_latency_case(4);
  c.dispatch_hook = c.combine_hook = c.zero_copy = c.use_logfmt = c.logfmt_within_node = true;
  c.pre_reduce = true;
  c.num_iterations = 3;
  c.graph = true;
  run_low_latency_case(c);
}

TEST(LowLatency, PreReduceBackToBackWithPendingHooks) {
  LowLatencyCase c = small_low_latency_case(2);
  c.dispatch_hook = c.combine_hook = true;
  c.pending_pairs = true;
  c.pre_reduce = true;
  c.batch = 4;
  c.num_iterations = 8;
  run_low_latency_case(c);
}

// ---- Many calls, graphs ----

TEST(LowLatency, ThousandBackToBackCalls) {
  LowLatencyCase c = small_low_latency_case(4);
  c.num_max_tokens = 8;
  c.hidden = 256;
  c.num_topk = 3;
  c.num_tokens = {8, 3, 0, 7};
  c.use_fp8 = true;
  c.stats = true;
  c.batch = 10;
  c.num_iterations = 1000;
  run_low_latency_case(c);
}

TEST(LowLatency, GraphCaptureReplay) {
  LowLatencyCase c = small_low_latency_case(2);
  c.use_fp8 = true;
  c.stats = true;
  c.num_iterations = 5;
  c.graph = true;
  run_low_latency_case(c);
}

TEST(LowLatency, GraphCaptureReplayHooksZeroCopy) {
  LowLatencyCase c = small_low_latency_case(4);
  c.dispatch_hook = c.combine_hook = c.zero_copy = true;
  c.num_iterations = 4;
  c.graph = true;
  run_low_latency_case(c);
}

}  // namespace
