// Low-latency dispatch/combine across nodes: the group is split into virtual nodes (BufferOptions::
// ranks_per_node) so traffic between them goes through the NVSHMEM transport while ranks of one node keep
// using NVLink stores. Same harness and CPU reference as test_low_latency.cpp.
#include <gtest/gtest.h>

#include <stdlib.h>

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>

#include "epx/local_launcher.hpp"
#include "epx/low_latency.hpp"
#include "expect_error.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/device_info.hpp"
#include "run_ranks.hpp"
#include "test_low_latency_harness.hpp"

namespace {

using epx::test::LowLatencyCase;
using epx::test::run_with_both_combine_orders;

// Runs `body` with one process per GPU; skips without enough GPUs or without the NVSHMEM transport.
void run_ranks(int num_ranks, const std::function<void(epx::Bootstrap&)>& body) {
  epx::test::run_ranks_across_nodes(num_ranks, body);
}

void run_case(const LowLatencyCase& c) {
  run_ranks(c.num_ranks, [&](epx::Bootstrap& bootstrap) { epx::test::LowLatencyRunner(c, bootstrap).run(); });
}

// `num_nodes` virtual nodes of `ranks_per_node` GPUs.
LowLatencyCase nodes_case(int num_nodes, int ranks_per_node) {
  LowLatencyCase c;
  c.num_ranks = num_nodes * ranks_per_node;
  c.ranks_per_node = ranks_per_node;
  c.num_max_tokens = 24;
  c.hidden = 512;
  c.num_experts = 8 * c.num_ranks;
  c.num_topk = 4;
  return c;
}

TEST(LowLatencyNodes, Bf16TwoNodesOfOne) {
  LowLatencyCase c = nodes_case(2, 1);
  c.num_iterations = 3;
  run_case(c);
}

TEST(LowLatencyNodes, Fp8Ue8m0LogfmtHooksZeroCopy) {
  LowLatencyCase c = nodes_case(2, 1);
  c.use_fp8 = c.round_scale = c.use_ue8m0 = true;
  c.use_logfmt = true;
  c.dispatch_hook = c.combine_hook = c.zero_copy = true;
  c.num_iterations = 3;
  run_case(c);
}

TEST(LowLatencyNodes, UnbalancedDuplicatesOddCounts) {
  LowLatencyCase c = nodes_case(2, 1);
  c.num_tokens = {0, 1, c.num_max_tokens, 7};
  c.unbalanced = true;
  c.duplicates = true;
  c.drop_probability = 0.2;
  c.num_topk = 9;
  c.hidden = 2688;
  c.use_logfmt = true;
  c.stats = true;
  c.num_iterations = 4;
  run_case(c);
}

// A pre-reduced combine to the other (virtual) node, BF16 or LogFMT, with top-k ids that repeat.
LowLatencyCase pre_reduce_case(bool logfmt, int num_iterations) {
  LowLatencyCase c = nodes_case(2, 1);
  c.duplicates = true;
  c.use_logfmt = logfmt;
  c.pre_reduce = true;
  c.num_iterations = num_iterations;
  return c;
}

// Partial rows summed, then sent whole to the other (virtual) node.
TEST(LowLatencyNodes, PreReduceOddCountsDuplicates) {
  for (const bool logfmt : {false, true}) {
    LowLatencyCase c = pre_reduce_case(logfmt, 3);
    c.num_tokens = {1, c.num_max_tokens, 0, 9};
    c.drop_probability = 0.1;
    c.zero_copy = logfmt;
    SCOPED_TRACE(logfmt ? "LogFMT, zero copy" : "BF16");
    run_case(c);
  }
}

TEST(LowLatencyNodes, DefaultShapeFp8) {
  LowLatencyCase c = nodes_case(2, 1);
  c.num_max_tokens = 128;
  c.hidden = 7168;
  c.num_experts = 288;
  c.num_topk = 8;
  c.use_fp8 = true;
  c.num_iterations = 2;
  run_case(c);
}

TEST(LowLatencyNodes, BackToBackCalls) {
  LowLatencyCase c = nodes_case(2, 1);
  c.num_max_tokens = 8;
  c.hidden = 256;
  c.num_topk = 3;
  c.num_tokens = {8, 3};
  c.use_fp8 = true;
  c.batch = 10;
  c.num_iterations = 200;
  run_case(c);
}

TEST(LowLatencyNodes, GraphCaptureReplayHooks) {
  LowLatencyCase c = nodes_case(2, 1);
  c.dispatch_hook = c.combine_hook = c.zero_copy = true;
  c.use_fp8 = true;
  c.num_iterations = 4;
  c.graph = true;
  run_case(c);
}

// A clean resets the signals collectively (barrier through NVSHMEM), and the buffer keeps working.
TEST(LowLatencyNodes, CleanThenReuse) {
  LowLatencyCase c = nodes_case(2, 1);
  c.num_iterations = 2;
  run_ranks(c.num_ranks, [&](epx::Bootstrap& bootstrap) {
    epx::BufferOptions options;
    options.num_rdma_bytes =
        epx::get_low_latency_rdma_size_hint(c.num_max_tokens, c.hidden, c.num_ranks, c.num_experts);
    options.ranks_per_node = c.ranks_per_node;
    options.wait_timeout_s = 20.0;
    epx::Buffer buffer(bootstrap, options);
    if (!buffer.spans_nodes()) throw std::runtime_error("the buffer should span 2 nodes");
    epx::test::LowLatencyRunner(c, buffer).run();
    epx::clean_low_latency_buffer(buffer, c.num_max_tokens, c.hidden, c.num_experts, epx::StreamOrder{});
    EPX_CUDA_CHECK(cudaDeviceSynchronize());
    LowLatencyCase again = c;
    again.seed = 7;
    epx::test::LowLatencyRunner(again, buffer).run();
    buffer.destroy();
  });
}

// The last rank dispatches tokens of another hidden size. The abort word reaches only the ranks of its node,
// so every rank must find the mismatch in the fingerprints its sources sent with their flags (put into the
// symmetric buffer by sources on other nodes, into the abort words by NVLink peers), or be released by a rank
// of its node that found it first: every rank's call raises the shape check's error well before the wait
// bound (nobody waits for a timeout). Then a collective reset() and a checked round trip.
void run_shapes_that_differ_across_nodes(int num_nodes, int ranks_per_node) {
  const LowLatencyCase c = nodes_case(num_nodes, ranks_per_node);
  constexpr int kOtherHidden = 1024;  // the last rank's (c.hidden on the others)
  constexpr double kWaitTimeoutS = 5.0;
  run_ranks(c.num_ranks, [&](epx::Bootstrap& bootstrap) {
    // EPX_WAIT_TIMEOUT_S overrides the option (the GPU scripts set it): this rank process takes the test's.
    setenv("EPX_WAIT_TIMEOUT_S", std::to_string(kWaitTimeoutS).c_str(), 1);
    const int rank = bootstrap.rank();
    epx::BufferOptions options;
    // The last rank lays out its buffer, and its writes into its peers, for its own hidden: every rank's
    // buffer holds the larger map.
    options.num_rdma_bytes =
        epx::get_low_latency_rdma_size_hint(c.num_max_tokens, kOtherHidden, c.num_ranks, c.num_experts);
    options.ranks_per_node = c.ranks_per_node;
    options.wait_timeout_s = kWaitTimeoutS;
    epx::Buffer buffer(bootstrap, options);
    if (!buffer.spans_nodes()) throw std::runtime_error("the buffer should span nodes");
    epx::test::LowLatencyRunner(c, buffer).run();  // agreeing fingerprints pass

    LowLatencyCase mine = c;
    if (rank == c.num_ranks - 1) mine.hidden = kOtherHidden;
    const auto start = std::chrono::steady_clock::now();
    // "peer P called with hidden = ..." (this rank's check), or "... called with other shapes" (released).
    epx::test::expect_error([&] { epx::test::LowLatencyRunner(mine, buffer).run(); }, "called with");
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (seconds >= kWaitTimeoutS)
      throw std::runtime_error("rank " + std::to_string(rank) + ": the shape check took " +
                               std::to_string(seconds) + " s (it must not wait for a timeout)");

    buffer.reset();
    epx::test::LowLatencyRunner(c, buffer).run();
    buffer.destroy();
  });
}

TEST(LowLatencyNodes, ShapesThatDifferFailOnEveryRankTwoNodesOfOne) {
  run_shapes_that_differ_across_nodes(2, 1);
}

TEST(LowLatencyNodes, RanksPerNodeMustDivideRanks) {
  run_ranks(2, [&](epx::Bootstrap& bootstrap) {
    epx::BufferOptions options;
    options.num_rdma_bytes = size_t(2) << 20;
    options.ranks_per_node = 3;
    epx::test::expect_error([&] { epx::Buffer buffer(bootstrap, options); }, "ranks_per_node");
  });
}

// Every rank of another node through the transport's puts (EPX_INTERNODE_PUTS=1, read when the Buffer is
// made: the path a NIC takes) on GPUs whose buffers the transport maps, where the kernels would store
// directly: both formats, LogFMT with hooks and zero copy, pre-reduced, odd counts.
struct PutsOnly {
  PutsOnly() { setenv("EPX_INTERNODE_PUTS", "1", 1); }
  ~PutsOnly() { unsetenv("EPX_INTERNODE_PUTS"); }
};

TEST(LowLatencyNodes, PutsInsteadOfStoresFp8LogfmtHooksZeroCopy) {
  const PutsOnly puts_only;
  LowLatencyCase c = nodes_case(2, 1);
  c.use_fp8 = true;
  c.use_logfmt = true;
  c.dispatch_hook = c.combine_hook = c.zero_copy = true;
  c.num_tokens = {1, c.num_max_tokens, 0, 9};
  c.num_iterations = 3;
  run_case(c);
}

TEST(LowLatencyNodes, PutsInsteadOfStoresPreReduce) {
  const PutsOnly puts_only;
  for (const bool logfmt : {false, true}) {
    SCOPED_TRACE(logfmt ? "LogFMT" : "BF16");
    run_case(pre_reduce_case(logfmt, 2));
  }
}

TEST(LowLatencyNodes, PutsInsteadOfStoresShapesThatDiffer) {
  const PutsOnly puts_only;
  run_shapes_that_differ_across_nodes(2, 1);
}

// ---- 4 GPUs as 2 nodes x 2: NVLink inside a node, NVSHMEM between nodes ----

TEST(LowLatencyNodes, Fp8TwoNodesOfTwo) {
  LowLatencyCase c = nodes_case(2, 2);
  c.use_fp8 = true;
  c.unbalanced = true;
  c.num_iterations = 3;
  run_with_both_combine_orders(c, run_case);
}

// Rows to the other node go packed and LogFMT-coded, rows within the node as BF16 groups.
TEST(LowLatencyNodes, LogfmtHooksZeroCopyTwoNodesOfTwo) {
  LowLatencyCase c = nodes_case(2, 2);
  c.use_logfmt = true;
  c.dispatch_hook = c.combine_hook = c.zero_copy = true;
  c.pending_pairs = true;
  c.num_iterations = 4;
  run_case(c);
}

// LogFMT asked within the node too: the rows within each node coded as well, default and pre-reduced.
TEST(LowLatencyNodes, LogfmtWithinNodesTwoNodesOfTwo) {
  LowLatencyCase c = nodes_case(2, 2);
  c.use_fp8 = true;
  c.use_logfmt = c.logfmt_within_node = true;
  c.duplicates = true;
  c.num_iterations = 3;
  run_with_both_combine_orders(c, run_case);
}

// Rank 3's node neighbour finds the mismatch over NVLink, ranks 0 and 1 across nodes.
TEST(LowLatencyNodes, ShapesThatDifferFailOnEveryRankTwoNodesOfTwo) {
  run_shapes_that_differ_across_nodes(2, 2);
}

// Puts to the other node beside stores within it, in one kernel: packed coded rows next to BF16 groups,
// shapes through the abort words and through remote_shapes, rows in one piece while node peers take stores.
TEST(LowLatencyNodes, PutsInsteadOfStoresLogfmtHooksZeroCopyTwoNodesOfTwo) {
  const PutsOnly puts_only;
  LowLatencyCase c = nodes_case(2, 2);
  c.use_logfmt = true;
  c.dispatch_hook = c.combine_hook = c.zero_copy = true;
  c.num_iterations = 3;
  run_with_both_combine_orders(c, run_case);
}

TEST(LowLatencyNodes, PutsInsteadOfStoresShapesThatDifferTwoNodesOfTwo) {
  const PutsOnly puts_only;
  run_shapes_that_differ_across_nodes(2, 2);
}

TEST(LowLatencyNodes, GraphReplayFourNodesOfOne) {
  LowLatencyCase c = nodes_case(4, 1);
  c.use_fp8 = true;
  c.num_iterations = 3;
  c.graph = true;
  run_case(c);
}

}  // namespace
