// Low-latency dispatch + combine against the reference, one named case per test: formats, hooks and ordering,
// routing and sizes, the pre-reduced combine, many calls and graphs. Test names read
// <Section>/LowLatency.Run/<Case>, e.g. Formats/LowLatency.Run/Fp8TwoRanks (a gtest filter for the whole
// file: *LowLatency.Run*). A case skips where there are fewer GPUs than its ranks.
#include <gtest/gtest.h>

#include <algorithm>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "test_low_latency_harness.hpp"

namespace {

using epx::test::LowLatencyCase;

using epx::test::run_low_latency_case;
using epx::test::small_low_latency_case;

struct NamedCase {
  std::string name;  // the test name's last part
  LowLatencyCase c;
};

void PrintTo(const NamedCase& named_case, std::ostream* os) {
  *os << named_case.name;
}

// `base` changed by `adjust`, under `name`.
template <typename Adjust>
NamedCase named(std::string name, LowLatencyCase base, Adjust adjust) {
  adjust(base);
  return {std::move(name), std::move(base)};
}

std::string ranks_name(int num_ranks) {
  switch (num_ranks) {
    case 1:
      return "OneRank";
    case 2:
      return "TwoRanks";
    case 4:
      return "FourRanks";
    default:
      return std::to_string(num_ranks) + "Ranks";
  }
}

// The decode benchmark shape: 128 tokens per rank, hidden 7168, top-8 of 288 experts, FP8.
LowLatencyCase default_shape(int num_ranks) {
  LowLatencyCase c;
  c.num_ranks = num_ranks;
  c.num_max_tokens = 128;
  c.hidden = 7168;
  c.num_experts = 288;
  c.num_topk = 8;
  c.use_fp8 = true;
  return c;
}

class LowLatency : public ::testing::TestWithParam<NamedCase> {};

TEST_P(LowLatency, Run) {
  run_low_latency_case(GetParam().c);
}

std::string case_name(const ::testing::TestParamInfo<NamedCase>& info) {
  return info.param.name;
}

// ---- Formats ----

std::vector<NamedCase> format_cases() {
  std::vector<NamedCase> cases;
  cases.push_back(
      named("Bf16TwoRanks", small_low_latency_case(2), [](LowLatencyCase& c) { c.num_iterations = 3; }));
  cases.push_back(named("Fp8TwoRanks", small_low_latency_case(2), [](LowLatencyCase& c) {
    c.use_fp8 = true;
    c.num_iterations = 3;
  }));
  cases.push_back(named("Fp8RoundScaleFourRanks", small_low_latency_case(4), [](LowLatencyCase& c) {
    c.use_fp8 = true;
    c.round_scale = true;
  }));
  cases.push_back(named("Fp8Ue8m0FourRanks", small_low_latency_case(4), [](LowLatencyCase& c) {
    c.use_fp8 = c.round_scale = c.use_ue8m0 = true;
    c.hidden = 2048;
  }));
  cases.push_back(named("Ue8m0PartialLastWord", small_low_latency_case(2), [](LowLatencyCase& c) {
    c.use_fp8 = c.round_scale = c.use_ue8m0 = true;
    c.hidden = 2688;  // 21 groups: the last packed word holds one scale
  }));
  // LogFMT asked within the node: every row coded over NVLink.
  cases.push_back(named("LogfmtCombineFourRanks", small_low_latency_case(4), [](LowLatencyCase& c) {
    c.use_fp8 = true;
    c.use_logfmt = c.logfmt_within_node = true;
    c.num_iterations = 2;
  }));
  // LogFMT alone within one node: every row stays within the node, so the combine is the BF16 one (the
  // reference codes nothing), default and pre-reduced.
  for (const bool pre_reduce : {false, true}) {
    const std::string name =
        std::string("LogfmtWithinOneNodeIsTheBf16Combine") + (pre_reduce ? "PreReduced" : "");
    cases.push_back(named(name, small_low_latency_case(4), [&](LowLatencyCase& c) {
      c.use_fp8 = true;
      c.use_logfmt = true;
      c.pre_reduce = pre_reduce;
      c.num_iterations = 2;
    }));
  }
  // Top-16 of hidden 7168: a token's 16 returned rows x 56 groups exceed the receive's table of group
  // constants (512 entries), so it decodes in two windows of groups.
  cases.push_back(
      named("LogfmtTopSixteenWideRowsTwoTableWindows", small_low_latency_case(2), [](LowLatencyCase& c) {
        c.hidden = 7168;
        c.num_topk = 16;
        c.num_experts = 32;
        c.num_max_tokens = 8;
        c.use_logfmt = c.logfmt_within_node = true;
        c.num_iterations = 2;
      }));
  cases.push_back(
      named("DefaultShapeFp8FourRanks", default_shape(4), [](LowLatencyCase& c) { c.stats = true; }));
  return cases;
}
INSTANTIATE_TEST_SUITE_P(Formats, LowLatency, ::testing::ValuesIn(format_cases()), case_name);

// ---- Hooks, zero copy, ordering ----

std::vector<NamedCase> hook_cases() {
  std::vector<NamedCase> cases;
  cases.push_back(named("HooksTwoRanks", small_low_latency_case(2), [](LowLatencyCase& c) {
    c.use_fp8 = true;
    c.dispatch_hook = c.combine_hook = true;
    c.num_iterations = 3;
  }));
  cases.push_back(named("TwoPendingHooksFourRanks", small_low_latency_case(4), [](LowLatencyCase& c) {
    c.dispatch_hook = c.combine_hook = true;
    c.pending_pairs = true;
    c.batch = 4;
    c.num_iterations = 4;
  }));
  cases.push_back(named("ZeroCopyCombine", small_low_latency_case(4), [](LowLatencyCase& c) {
    c.zero_copy = true;
    c.batch = 3;
    c.num_iterations = 3;
  }));
  cases.push_back(named("ZeroCopyWithHooksAndLogfmt", small_low_latency_case(2), [](LowLatencyCase& c) {
    c.zero_copy = c.combine_hook = c.dispatch_hook = c.use_logfmt = c.logfmt_within_node = true;
    c.num_iterations = 2;
  }));
  cases.push_back(named("AsyncFinishEvents", small_low_latency_case(2), [](LowLatencyCase& c) {
    c.async_finish = true;
    c.num_iterations = 2;
  }));
  return cases;
}
INSTANTIATE_TEST_SUITE_P(Hooks, LowLatency, ::testing::ValuesIn(hook_cases()), case_name);

// ---- Routing and sizes ----

// Two ranks, many tokens of small rows, duplicate listings and dropped entries, two calls: the routing's
// cases.
LowLatencyCase many_tokens_case(int num_max_tokens, std::vector<int> num_tokens) {
  LowLatencyCase c = small_low_latency_case(2);
  c.num_max_tokens = num_max_tokens;
  c.hidden = 256;
  c.num_tokens = std::move(num_tokens);
  c.duplicates = true;
  c.drop_probability = 0.1;
  c.num_iterations = 2;
  return c;
}

std::vector<NamedCase> routing_cases() {
  std::vector<NamedCase> cases;
  cases.push_back(named("TokenCountsZeroOneAndMax", small_low_latency_case(4), [](LowLatencyCase& c) {
    c.num_tokens = {0, 1, c.num_max_tokens, 5};
    c.drop_probability = 0.2;
    c.use_fp8 = true;
    c.stats = true;
    c.num_iterations = 2;
  }));
  cases.push_back(
      named("AllRanksEmpty", small_low_latency_case(2), [](LowLatencyCase& c) { c.num_tokens = {0}; }));
  cases.push_back(named("UnbalancedRoutingAndDuplicates", small_low_latency_case(4), [](LowLatencyCase& c) {
    c.unbalanced = true;
    c.duplicates = true;
    c.use_fp8 = true;
    c.stats = true;
    c.num_iterations = 2;
  }));
  // Hidden sizes by top-k; the i-th case alternates FP8 (every 2nd) and LogFMT (every 3rd) with its own seed.
  int i = 0;
  for (const int hidden : {2048, 4096, 8192, 2688}) {
    for (const int topk : {1, 8, 9}) {
      const std::string name = "Hidden" + std::to_string(hidden) + "Top" + std::to_string(topk);
      cases.push_back(named(name, small_low_latency_case(2), [&](LowLatencyCase& c) {
        c.hidden = hidden;
        c.num_topk = topk;
        c.num_experts = 16;
        c.num_max_tokens = 8;
        c.use_fp8 = i % 2 == 0;
        c.use_logfmt = c.logfmt_within_node = i % 3 == 0;
        c.seed = 100 + i++;
      }));
    }
  }
  // More tokens than blocks: a block sends several tokens; the routing block lists all of them.
  cases.push_back(named("MoreTokensThanBlocks", many_tokens_case(300, {300, 133}), [](LowLatencyCase& c) {
    c.use_fp8 = true;
    c.stats = true;
  }));
  // The routing block's warps over several rounds of entries (top-8 of 300 tokens: 2,400 entries, five rounds
  // of 32 a warp), and a top-k that does not divide a warp (top-3).
  cases.push_back(named("RoutingManyRounds", many_tokens_case(300, {300, 257}), [](LowLatencyCase& c) {
    c.num_topk = 8;
    c.num_experts = 64;
    c.use_fp8 = true;
  }));
  cases.push_back(
      named("RoutingTopkThree", many_tokens_case(200, {199, 11}), [](LowLatencyCase& c) { c.num_topk = 3; }));
  cases.push_back(named("TopkSixteenManyExperts", small_low_latency_case(4), [](LowLatencyCase& c) {
    c.num_topk = 16;
    c.num_experts = 256;
    c.use_fp8 = true;
  }));
  // More (local expert, source) pairs than a block has threads: the combine's pair scan takes its block-wide
  // path (scan_pair_ranges), and the dispatch receive's pollers scan more counts than they have threads.
  cases.push_back(named("MorePairsThanThreads", small_low_latency_case(2), [](LowLatencyCase& c) {
    c.num_experts = 640;
    c.duplicates = true;
    c.drop_probability = 0.1;
    c.num_iterations = 2;
  }));
  return cases;
}
INSTANTIATE_TEST_SUITE_P(Routing, LowLatency, ::testing::ValuesIn(routing_cases()), case_name);

// ---- Pre-reduced combine (the dispatch carries the weights; one row per token and rank returns) ----

std::vector<NamedCase> pre_reduce_cases() {
  std::vector<NamedCase> cases;
  for (const int num_ranks : {1, 2, 4}) {
    cases.push_back(
        named("Bf16" + ranks_name(num_ranks), small_low_latency_case(num_ranks), [&](LowLatencyCase& c) {
          c.pre_reduce = true;
          c.num_iterations = 2;
          c.seed = 40 + num_ranks;
        }));
  }
  cases.push_back(named("Fp8LogfmtFourRanks", small_low_latency_case(4), [](LowLatencyCase& c) {
    c.use_fp8 = true;
    c.use_logfmt = c.logfmt_within_node = true;
    c.pre_reduce = true;
    c.num_iterations = 2;
  }));
  // 0 and 1 tokens, -1 ids, a rank whose experts get nothing, duplicate listings (a row weighted twice),
  // top-9.
  cases.push_back(named("OddCountsUnbalancedDuplicates", small_low_latency_case(4), [](LowLatencyCase& c) {
    c.num_tokens = {0, 1, c.num_max_tokens, 5};
    c.unbalanced = true;
    c.duplicates = true;
    c.drop_probability = 0.2;
    c.num_topk = 9;
    c.hidden = 2688;
    c.use_fp8 = true;
    c.pre_reduce = true;
    c.num_iterations = 3;
  }));
  int i = 0;
  for (const int hidden : {128, 1024, 7168}) {
    for (const bool logfmt : {false, true}) {
      const std::string name = "Hidden" + std::to_string(hidden) + (logfmt ? "Logfmt" : "Bf16");
      cases.push_back(named(name, small_low_latency_case(2), [&](LowLatencyCase& c) {
        c.hidden = hidden;
        c.num_topk = 8;
        c.num_experts = 16;
        c.num_max_tokens = 8;
        c.use_logfmt = c.logfmt_within_node = logfmt;
        c.pre_reduce = true;
        c.seed = 300 + i++;
      }));
    }
  }
  // The decode benchmark shape; on one rank every listing is local, eight rows summed per token.
  for (const int num_ranks : {1, 4}) {
    cases.push_back(named("DefaultShape" + ranks_name(num_ranks), default_shape(num_ranks),
                          [](LowLatencyCase& c) { c.pre_reduce = true; }));
  }
  cases.push_back(named("GraphHooksZeroCopyLogfmt", small_low_latency_case(4), [](LowLatencyCase& c) {
    c.dispatch_hook = c.combine_hook = c.zero_copy = c.use_logfmt = c.logfmt_within_node = true;
    c.pre_reduce = true;
    c.num_iterations = 3;
    c.graph = true;
  }));
  cases.push_back(named("BackToBackWithPendingHooks", small_low_latency_case(2), [](LowLatencyCase& c) {
    c.dispatch_hook = c.combine_hook = true;
    c.pending_pairs = true;
    c.pre_reduce = true;
    c.batch = 4;
    c.num_iterations = 8;
  }));
  return cases;
}
INSTANTIATE_TEST_SUITE_P(PreReduce, LowLatency, ::testing::ValuesIn(pre_reduce_cases()), case_name);

// ---- Many calls, graphs ----

std::vector<NamedCase> many_call_cases() {
  std::vector<NamedCase> cases;
  cases.push_back(named("ThousandBackToBackCalls", small_low_latency_case(4), [](LowLatencyCase& c) {
    c.num_max_tokens = 8;
    c.hidden = 256;
    c.num_topk = 3;
    c.num_tokens = {8, 3, 0, 7};
    c.use_fp8 = true;
    c.stats = true;
    c.batch = 10;
    c.num_iterations = 1000;
  }));
  cases.push_back(named("GraphCaptureReplay", small_low_latency_case(2), [](LowLatencyCase& c) {
    c.use_fp8 = true;
    c.stats = true;
    c.num_iterations = 5;
    c.graph = true;
  }));
  cases.push_back(named("GraphCaptureReplayHooksZeroCopy", small_low_latency_case(4), [](LowLatencyCase& c) {
    c.dispatch_hook = c.combine_hook = c.zero_copy = true;
    c.num_iterations = 4;
    c.graph = true;
  }));
  return cases;
}
INSTANTIATE_TEST_SUITE_P(ManyCalls, LowLatency, ::testing::ValuesIn(many_call_cases()), case_name);

// ---- A clean of another shape ----

// A clean restarts the use numbers but zeroes only its own shape's count words and index lists: calls of the
// first shape after a clean of another must not take words its calls before the clean left (their tags carry
// the clean count). Token counts drawn per call, so list lengths change from call to call and a list's later
// slots keep older calls' entries.
TEST(LowLatencyClean, FirstShapeAfterAnotherShapesClean) {
  LowLatencyCase c = small_low_latency_case(2);
  c.num_max_tokens = 32;
  c.num_topk = 6;
  c.random_num_tokens = true;
  c.num_iterations = 8;
  c.seed = 131;
  epx::test::run_ranks(c.num_ranks, [c](epx::Bootstrap& bootstrap) {
    epx::BufferOptions options;
    options.num_rdma_bytes =
        std::max(epx::get_low_latency_rdma_size_hint(c.num_max_tokens, c.hidden, c.num_ranks, c.num_experts),
                 epx::get_low_latency_rdma_size_hint(8, 256, c.num_ranks, 2 * c.num_ranks));
    options.wait_timeout_s = 20.0;
    epx::Buffer buffer(bootstrap, options);
    epx::test::LowLatencyRunner(c, buffer).run();
    epx::clean_low_latency_buffer(buffer, 8, 256, 2 * c.num_ranks, epx::StreamOrder{});
    LowLatencyCase again = c;
    again.seed = 132;
    epx::test::LowLatencyRunner(again, buffer).run();
  });
}

}  // namespace
