// Rank masks in low-latency mode (docs/RELIABILITY.md, section 4): a masked rank sits calls out while the
// others run without it, bit-exact against the reference with that rank masked; masks change between calls
// and between CUDA graph replays; with enable_shrink a rank that skips a call is masked by the others'
// timed-out waits and they finish without it. Runs on one GPU with EPX_TEST_RANKS_PER_GPU=2 (or 4).

#include <gtest/gtest.h>

#include <stdlib.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

#include "epx/error.hpp"
#include "epx/low_latency.hpp"
#include "expect_error.hpp"
#include "run_ranks.hpp"
#include "test_low_latency_harness.hpp"

namespace {

using epx::test::LowLatencyCase;

using epx::test::run_low_latency_case;
using epx::test::small_low_latency_case;

void require(bool condition, int rank, const std::string& what) {
  if (!condition) throw std::runtime_error("rank " + std::to_string(rank) + ": " + what);
}

// Cases that run at 2 and 4 ranks: test names end in /TwoRanks or /FourRanks, e.g.
// LowLatencyMasks/LowLatencyMaskRanks.MaskedRank/FourRanks (a gtest filter for the whole file:
// LowLatencyMasks*). The two runs differ on purpose (masks, formats, hooks); the test body says how.
class LowLatencyMaskRanks : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(LowLatencyMasks, LowLatencyMaskRanks, ::testing::Values(2, 4),
                         epx::test::rank_count_name);

// ---- A masked rank sits out; the others match the reference with it masked ----

// Four ranks: FP8, a rank in the middle masked.
TEST_P(LowLatencyMaskRanks, MaskedRank) {
  LowLatencyCase c = small_low_latency_case(GetParam());
  if (GetParam() == 2) {
    c.masks = {{1}};
    c.num_iterations = 3;
  } else {
    c.use_fp8 = true;
    c.masks = {{2}};
    c.num_iterations = 2;
  }
  run_low_latency_case(c);
}

// Up to 32 top-k entries per rank the routing runs in one warp (route_few_entries): 0 to 4 tokens of top-8
// with duplicate listings and -1 ids, a rank masked, then none.
TEST_P(LowLatencyMaskRanks, FewEntriesDuplicatesMasked) {
  LowLatencyCase c = small_low_latency_case(GetParam());
  c.num_tokens = {1, 4, 0, 3};
  c.duplicates = true;
  c.drop_probability = 0.2;
  c.use_fp8 = true;
  c.masks = {{GetParam() - 1}, {}};
  c.num_iterations = 2;
  run_low_latency_case(c);
}

TEST(LowLatencyMasks, TwoMaskedRanksHooksLogfmtFourRanks) {
  LowLatencyCase c = small_low_latency_case(4);
  c.use_fp8 = true;
  c.use_logfmt = c.logfmt_within_node = true;
  c.dispatch_hook = c.combine_hook = true;
  c.unbalanced = true;
  c.masks = {{0, 3}};
  c.num_iterations = 2;
  run_low_latency_case(c);
}

// The pre-reduced combine leaves a masked rank's partial rows out like its experts.
TEST(LowLatencyMasks, PreReduceMaskedRanksFourRanks) {
  LowLatencyCase c = small_low_latency_case(4);
  c.duplicates = true;
  c.pre_reduce = true;
  c.masks = {{1}, {}, {0, 2}};
  c.num_iterations = 3;
  run_low_latency_case(c);
}

// ---- Masking and unmasking between calls (unmasking cleans every rank's buffer) ----

// Four ranks: FP8 and zero-copy combine, two ranks masked at once.
TEST_P(LowLatencyMaskRanks, MaskAndUnmaskBetweenCalls) {
  LowLatencyCase c = small_low_latency_case(GetParam());
  if (GetParam() == 2) {
    c.masks = {{}, {1}, {1}, {}, {0}, {}};
    c.num_iterations = 6;
  } else {
    c.use_fp8 = true;
    c.zero_copy = true;
    c.masks = {{}, {3}, {1, 3}, {}, {0}};
    c.num_iterations = 5;
  }
  run_low_latency_case(c);
}

// ---- CUDA graphs: the kernels read the mask when they run ----

// Four ranks: FP8 and hooks, two ranks masked at once.
TEST_P(LowLatencyMaskRanks, GraphReplayWithMaskChanges) {
  LowLatencyCase c = small_low_latency_case(GetParam());
  c.graph = true;
  if (GetParam() == 2) {
    c.masks = {{}, {1}, {}, {0}};
    c.num_iterations = 4;
  } else {
    c.use_fp8 = true;
    c.dispatch_hook = c.combine_hook = true;
    c.masks = {{}, {2}, {2}, {}, {0, 1}};
    c.num_iterations = 5;
  }
  run_low_latency_case(c);
}

// ---- The mask calls ----

void run_mask_calls(epx::Bootstrap& bootstrap) {
  const LowLatencyCase c = small_low_latency_case(bootstrap.num_ranks());
  epx::BufferOptions options;
  options.num_rdma_bytes =
      epx::get_low_latency_rdma_size_hint(c.num_max_tokens, c.hidden, c.num_ranks, c.num_experts);
  epx::Buffer buffer(bootstrap, options);
  const int rank = buffer.rank();
  const int last = c.num_ranks - 1;
  cudaStream_t stream = nullptr;
  EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const epx::StreamOrder order{stream, nullptr, false};
  epx::test::DeviceArray status(sizeof(int) * c.num_ranks);
  const auto query = [&] {
    epx::low_latency_query_mask_buffer(buffer, status.get<int>(), order);
    buffer.synchronize(stream);
    return status.download<int>(c.num_ranks);
  };
  require(query() == std::vector<int>(c.num_ranks, 0), rank, "a new Buffer masks nobody");
  epx::low_latency_update_mask_buffer(buffer, last, true, order);
  epx::low_latency_update_mask_buffer(buffer, 0, true, order);
  std::vector<int> want(c.num_ranks, 0);
  want[0] = want[last] = 1;
  require(query() == want, rank, "query after masking 0 and the last rank");
  require(epx::read_low_latency_mask(buffer).masked == ((1ull << last) | 1ull), rank,
          "read_low_latency_mask");
  epx::low_latency_update_mask_buffer(buffer, 0, false, order);
  want[0] = 0;
  require(query() == want, rank, "query after unmasking 0");
  epx::low_latency_clean_mask_buffer(buffer, order);
  require(query() == std::vector<int>(c.num_ranks, 0), rank, "query after the clean");
  epx::test::expect_error([&] { epx::low_latency_update_mask_buffer(buffer, c.num_ranks, true, order); },
                          "invalid rank_to_mask = " + std::to_string(c.num_ranks) + ": must be < num_ranks");
  epx::test::expect_error([&] { epx::low_latency_update_mask_buffer(buffer, -1, true, order); },
                          "invalid rank_to_mask = -1: must be >= 0");
  epx::test::expect_error([&] { epx::low_latency_query_mask_buffer(buffer, nullptr, order); },
                          "invalid mask_status = null");
  // reset() unmasks every rank, as after construction.
  epx::low_latency_update_mask_buffer(buffer, last, true, order);
  buffer.synchronize(stream);
  buffer.reset();
  require(query() == std::vector<int>(c.num_ranks, 0), rank, "query after reset()");
  cudaStreamDestroy(stream);
}

TEST(LowLatencyMasks, MaskCallsTwoRanks) {
  epx::test::run_ranks(2, run_mask_calls);
}

// ---- enable_shrink: a rank that skips a call is masked, the others finish without it ----

constexpr double kShrinkTimeoutS = 1.0;

void run_shrink(epx::Bootstrap& bootstrap, bool use_hooks) {
  // EPX_WAIT_TIMEOUT_S overrides the option (the GPU scripts set it): each rank process sets the test's
  // bound.
  setenv("EPX_WAIT_TIMEOUT_S", std::to_string(kShrinkTimeoutS).c_str(), 1);
  LowLatencyCase c = small_low_latency_case(bootstrap.num_ranks());
  c.use_fp8 = true;
  c.dispatch_hook = c.combine_hook = use_hooks;
  epx::BufferOptions options;
  options.num_rdma_bytes =
      epx::get_low_latency_rdma_size_hint(c.num_max_tokens, c.hidden, c.num_ranks, c.num_experts);
  options.wait_timeout_s = kShrinkTimeoutS;
  options.enable_shrink = true;
  epx::Buffer buffer(bootstrap, options);
  require(buffer.enable_shrink(), buffer.rank(), "enable_shrink() reports the option");
  epx::test::LowLatencyRunner runner(c, buffer);
  const int rank = buffer.rank();
  const int skipper = c.num_ranks - 1;
  const uint64_t skipper_bit = 1ull << skipper;

  runner.run_iteration(0, {}, true);  // a good round trip with every rank
  bootstrap.barrier();

  // The last rank skips a dispatch and combine: the others' dispatch receive times out on it, masks it and
  // completes with its traffic dropped; their combine leaves it out without waiting.
  const auto start = std::chrono::steady_clock::now();
  runner.run_iteration(1, {skipper}, rank != skipper);
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const epx::LowLatencyMaskBits bits = epx::read_low_latency_mask(buffer);
  buffer.check();  // no abort: nothing raised, on any rank
  require(!buffer.is_aborted(), rank, "the Buffer is not aborted");
  if (rank != skipper) {
    require(elapsed < kShrinkTimeoutS + 1.0, rank, "finished after " + std::to_string(elapsed) + " s");
    require(bits.masked == skipper_bit, rank, "masked bits " + std::to_string(bits.masked));
    require(bits.masked_by_timeout == skipper_bit, rank,
            "masked_by_timeout bits " + std::to_string(bits.masked_by_timeout));
    // The next call leaves the masked rank out without waiting for it.
    const auto again = std::chrono::steady_clock::now();
    runner.run_iteration(2, {skipper}, true);
    const double next = std::chrono::duration<double>(std::chrono::steady_clock::now() - again).count();
    require(next < kShrinkTimeoutS, rank, "the call after the mask took " + std::to_string(next) + " s");
  } else {
    require(bits.masked == 0, rank, "the skipping rank masks nobody");
  }
  bootstrap.barrier();

  // The rank comes back: every rank unmasks it and cleans (collective), then all run again.
  epx::low_latency_clean_mask_buffer(buffer, epx::StreamOrder{runner.stream(), nullptr, false});
  epx::clean_low_latency_buffer(buffer, c.num_max_tokens, c.hidden, c.num_experts,
                                epx::StreamOrder{runner.stream(), nullptr, false});
  buffer.synchronize(runner.stream());
  require(epx::read_low_latency_mask(buffer).masked == 0, rank, "unmasked after the clean");
  runner.run_iteration(3, {}, true);
}

// Four ranks: with hooks.
TEST_P(LowLatencyMaskRanks, ShrinkMasksARankThatSkipsACall) {
  const bool use_hooks = GetParam() != 2;
  epx::test::run_ranks(GetParam(), [&](epx::Bootstrap& bootstrap) { run_shrink(bootstrap, use_hooks); });
}

}  // namespace
