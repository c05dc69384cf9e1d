// Stress tests (docs/RELIABILITY.md, section 7): many calls on one Buffer, the settings of each call drawn at
// random, every result checked bit-exactly against the CPU reference. The number of calls comes from the
// environment, so the default run stays short and a long run needs no rebuild:
//   EPX_STRESS_LL_CALLS      low-latency round trips (default 200)
//   EPX_STRESS_NORMAL_CALLS  normal-mode calls (default 40)
//   EPX_STRESS_SEED          varies the random call sequences (default 0; concurrent runs take different
//   ones)
// Rank 0 prints the count, the wall time of the calls and the calls per second.

#include <gtest/gtest.h>
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "reference/test_data.hpp"
#include "run_ranks.hpp"
#include "test_low_latency_harness.hpp"
#include "test_normal_harness.hpp"

namespace {

using epx::TokenFormat;
using epx::reference::TestRng;
using epx::test::LowLatencyIssue;
using epx::test::NormalOrder;
using epx::test::NormalRouteBy;
using Clock = std::chrono::steady_clock;

// The count in environment variable `name`, `fallback` when unset, 0 when it is not a positive integer.
int calls_from_env(const char* name, int fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  char* end = nullptr;
  const long calls = std::strtol(value, &end, 10);
  return *end == '\0' && calls >= 1 && calls <= 100000000 ? static_cast<int>(calls) : 0;
}

// EPX_STRESS_SEED (0 when unset or not a number).
uint64_t stress_seed() {
  const char* value = std::getenv("EPX_STRESS_SEED");
  return value != nullptr ? std::strtoull(value, nullptr, 10) : 0;
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The reference allocates and frees large blocks in every call. By default glibc maps the largest afresh and
// hands freed memory back to the kernel, so each call faults its pages in again: 285 instead of 45 us of
// reference work per low-latency call at 4 ranks (measured on the CPU). A rank keeps its freed memory
// instead.
void keep_freed_memory() {
  mallopt(M_MMAP_THRESHOLD, 64 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
}

// One line from rank 0 (every rank makes the same calls).
void report(int rank, const char* mode, int num_calls, double seconds, const std::string& detail) {
  if (rank != 0) return;
  std::printf("[ STRESS   ] %s: %d calls in %.3f s, %.1f calls/s (%s)\n", mode, num_calls, seconds,
              num_calls / seconds, detail.c_str());
  std::fflush(stdout);
}

// ---- Low latency ----

// Small shapes keep the reference and the check cheap, which is most of a call's host time in a long run:
// hidden 256, 0..8 tokens per rank and call, 4 experts per rank, top-3 with 10% of the ids -1.
epx::test::LowLatencyCase stress_low_latency_case(int num_ranks, bool use_fp8) {
  epx::test::LowLatencyCase c;
  c.num_ranks = num_ranks;
  c.num_max_tokens = 8;
  c.hidden = 256;
  c.num_experts = 4 * num_ranks;
  c.num_topk = 3;
  c.random_num_tokens = true;
  c.drop_probability = 0.1;
  c.use_fp8 = use_fp8;
  c.seed = use_fp8 ? 71 : 72;
  return c;
}

const char* issue_name(LowLatencyIssue issue) {
  switch (issue) {
    case LowLatencyIssue::kEager:
      return "eager";
    case LowLatencyIssue::kHooks:
      return "hooks";
    case LowLatencyIssue::kGraph:
      return "graph replay";
  }
  return "?";
}

// Busy for `us` microseconds (a host that computes between calls; sleeping would round up to the scheduler's
// tick).
void host_delay(int us) {
  const Clock::time_point until = Clock::now() + std::chrono::microseconds(us);
  while (Clock::now() < until) {
  }
}

// Both formats interleave on one Buffer (a runner each, so each keeps its slot and graphs). The format must
// agree between ranks (the shape check compares it), so it comes from a generator every rank seeds alike. How
// a rank issues a call and how long it waits first need not agree: they come from a generator seeded with
// the rank, so one call is often an eager call on one rank, hooks on another and a graph replay on a third,
// and ranks reach it at different moments.
void stress_low_latency(epx::Bootstrap& bootstrap, int num_calls) {
  keep_freed_memory();
  const int rank = bootstrap.rank();
  const int num_ranks = bootstrap.num_ranks();
  const epx::test::LowLatencyCase bf16 = stress_low_latency_case(num_ranks, false);
  epx::BufferOptions options;
  options.num_rdma_bytes =
      epx::get_low_latency_rdma_size_hint(bf16.num_max_tokens, bf16.hidden, num_ranks, bf16.num_experts);
  options.wait_timeout_s = 20.0;
  epx::Buffer buffer(bootstrap, options);
  epx::test::LowLatencyRunner bf16_runner(bf16, buffer);
  epx::test::LowLatencyRunner fp8_runner(stress_low_latency_case(num_ranks, true), buffer);

  TestRng shared(1234 + 1000 * stress_seed());
  TestRng own(5678 + rank + 1000 * stress_seed());
  int num_fp8 = 0;
  int num_delayed = 0;
  int num_issued[3] = {0, 0, 0};
  const Clock::time_point start = Clock::now();
  for (int i = 0; i < num_calls; ++i) {
    const bool use_fp8 = shared.bernoulli(0.5);
    const auto issue = static_cast<LowLatencyIssue>(own.uniform_int(3));
    if (own.bernoulli(0.5)) {
      host_delay(static_cast<int>(own.uniform_int(201)));
      ++num_delayed;
    }
    try {
      (use_fp8 ? fp8_runner : bf16_runner).run_call(i, issue);
    } catch (const std::exception& error) {
      throw std::runtime_error(std::string(error.what()) + " (stress call " + std::to_string(i) + ": " +
                               (use_fp8 ? "FP8" : "BF16") + ", " + issue_name(issue) + ")");
    }
    num_fp8 += use_fp8 ? 1 : 0;
    ++num_issued[static_cast<int>(issue)];
  }
  const double seconds = seconds_since(start);
  report(rank, "low latency", num_calls, seconds,
         std::to_string(num_ranks) + " ranks, rank 0: " + std::to_string(num_issued[0]) + " eager, " +
             std::to_string(num_issued[1]) + " hooks, " + std::to_string(num_issued[2]) +
             " graph replays of " + std::to_string(bf16_runner.num_graphs() + fp8_runner.num_graphs()) +
             " graphs, " + std::to_string(num_fp8) + " FP8, " + std::to_string(num_delayed) + " delayed");
  buffer.destroy();
}

// ---- Normal mode ----

// 0 or 1, an odd count below 100, or anything up to 3000.
int draw_num_tokens(TestRng& rng) {
  switch (rng.uniform_int(3)) {
    case 0:
      return static_cast<int>(rng.uniform_int(2));
    case 1:
      return 2 * static_cast<int>(rng.uniform_int(50)) + 1;
    default:
      return static_cast<int>(rng.uniform_int(3001));
  }
}

template <typename T>
T pick(TestRng& rng, std::initializer_list<T> values) {
  return values.begin()[rng.uniform_int(static_cast<uint32_t>(values.size()))];
}

// NormalCase's per-call settings are lists (call i uses element i % size); lists as long as the run give
// every call its own draw. The parent process builds the case, so every rank gets the same one. Small
// shapes again: hidden 256, 4 experts per rank, top-3.
epx::test::NormalCase stress_normal_case(int num_ranks, int num_calls) {
  epx::test::NormalCase c;
  c.num_ranks = num_ranks;
  c.hidden = 256;
  c.num_experts = 4 * num_ranks;
  c.num_topk = 3;
  c.num_iterations = num_calls;
  c.gate_caller_stream = true;  // calls that must not wait for the device are checked not to
  c.seed = 73;
  c.num_tokens.clear();
  c.formats.clear();
  c.route_by.clear();
  c.expert_alignments.clear();
  c.worst_case.clear();
  c.cached.clear();
  c.num_sms.clear();
  c.num_biases.clear();
  c.combine_weights.clear();
  c.orders.clear();
  c.launch_receive.clear();
  TestRng rng(4321 + 1000 * stress_seed());
  for (int i = 0; i < num_calls; ++i) {
    c.num_tokens.push_back(draw_num_tokens(rng));  // rank r of call i: element (r + i) % size
    c.formats.push_back(pick(rng, {TokenFormat::kBf16, TokenFormat::kFp8}));
    c.route_by.push_back(pick(rng, {NormalRouteBy::kTopk, NormalRouteBy::kTopk, NormalRouteBy::kRankMapCounts,
                                    NormalRouteBy::kRankMap}));
    c.expert_alignments.push_back(pick(rng, {1, 1, 128}));
    c.worst_case.push_back(rng.bernoulli(0.3));
    c.cached.push_back(rng.bernoulli(0.3));
    c.num_sms.push_back(1 + static_cast<int>(rng.uniform_int(32)));
    c.num_biases.push_back(static_cast<int>(rng.uniform_int(3)));
    c.combine_weights.push_back(rng.bernoulli(0.5));
    c.orders.push_back(
        pick(rng, {NormalOrder::kSync, NormalOrder::kAsyncFinish, NormalOrder::kPreviousEvent}));
    c.launch_receive.push_back(rng.bernoulli(0.5));
  }
  return c;
}

// What the drawn calls hold, for the report.
std::string describe_normal_calls(const epx::test::NormalCase& c) {
  int num_fp8 = 0, num_worst = 0, num_cached = 0, max_tokens = 0;
  for (int i = 0; i < c.num_iterations; ++i) {
    num_fp8 += c.formats[i] == TokenFormat::kFp8 ? 1 : 0;
    num_worst += c.worst_case[i] ? 1 : 0;
    num_cached += c.cached[i] ? 1 : 0;
    max_tokens = std::max(max_tokens, c.num_tokens[i]);
  }
  return std::to_string(c.num_ranks) + " ranks, " + std::to_string(num_fp8) + " FP8, " +
         std::to_string(num_worst) + " worst-case, " + std::to_string(num_cached) +
         " with a cached re-dispatch, num_sms 1..32, up to " + std::to_string(max_tokens) + " tokens";
}

void stress_normal(epx::Bootstrap& bootstrap, const epx::test::NormalCase& c) {
  keep_freed_memory();
  epx::test::NormalRunner runner(c, bootstrap);  // its own Buffer, sized for the widest config
  const Clock::time_point start = Clock::now();
  runner.run();
  report(bootstrap.rank(), "normal", c.num_iterations, seconds_since(start), describe_normal_calls(c));
}

// 2 ranks, and 4 where the machine can start them (the 4-rank test skips otherwise): test names end in
// /TwoRanks or /FourRanks, e.g. Stress/StressRanks.LowLatency/TwoRanks.
class StressRanks : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(Stress, StressRanks, ::testing::Values(2, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return info.param == 2 ? std::string("TwoRanks") : std::string("FourRanks");
                         });

TEST_P(StressRanks, LowLatency) {
  const int num_calls = calls_from_env("EPX_STRESS_LL_CALLS", 200);
  ASSERT_GE(num_calls, 1) << "EPX_STRESS_LL_CALLS must be a positive number of calls";
  epx::test::run_ranks(GetParam(),
                       [&](epx::Bootstrap& bootstrap) { stress_low_latency(bootstrap, num_calls); });
}

TEST_P(StressRanks, Normal) {
  const int num_calls = calls_from_env("EPX_STRESS_NORMAL_CALLS", 40);
  ASSERT_GE(num_calls, 1) << "EPX_STRESS_NORMAL_CALLS must be a positive number of calls";
  const epx::test::NormalCase c = stress_normal_case(GetParam(), num_calls);
  epx::test::run_ranks(GetParam(), [&](epx::Bootstrap& bootstrap) { stress_normal(bootstrap, c); });
}

}  // namespace
