// Normal mode across nodes on virtual nodes (BufferOptions::ranks_per_node below the group size): every token
// crosses the network to a node once (NVSHMEM), its rail peer there forwards it over NVLink; combine reduces
// inside each node first. Bit-exact against reference::internode_dispatch / internode_combine (the received
// rows are normal_dispatch's). Ranks may share one GPU (EPX_TEST_RANKS_PER_GPU).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "expect_error.hpp"
#include "run_ranks.hpp"
#include "test_normal_harness.hpp"

namespace {

using epx::TokenFormat;
using epx::test::DeviceArray;
using epx::test::expect_error;
using epx::test::NormalCase;
using epx::test::NormalRouteBy;
using epx::test::NormalRouting;

constexpr TokenFormat kBf16 = TokenFormat::kBf16;
constexpr TokenFormat kFp8 = TokenFormat::kFp8;

void run_case(const NormalCase& c) {
  epx::test::run_ranks(c.num_ranks,
                       [&](epx::Bootstrap& bootstrap) { epx::test::NormalRunner(c, bootstrap).run(); });
}

// (ranks, ranks per node): 2 x 1, 2 x 2 and 4 x 1.
struct NodeSplit {
  int num_ranks;
  int ranks_per_node;
};

class NormalNodes : public ::testing::TestWithParam<NodeSplit> {};
INSTANTIATE_TEST_SUITE_P(Normal, NormalNodes,
                         ::testing::Values(NodeSplit{2, 1}, NodeSplit{4, 2}, NodeSplit{4, 1}),
                         [](const ::testing::TestParamInfo<NodeSplit>& info) {
                           const int nodes = info.param.num_ranks / info.param.ranks_per_node;
                           return std::to_string(nodes) + "NodesOf" +
                                  std::to_string(info.param.ranks_per_node);
                         });

NormalCase node_case(const NodeSplit& split, uint64_t seed) {
  NormalCase c;
  c.num_ranks = split.num_ranks;
  c.ranks_per_node = split.ranks_per_node;
  c.hidden = 2048;
  c.num_experts = 8 * split.num_ranks;
  c.num_topk = 4;
  c.num_tokens = {333, 64};
  c.num_sms = {6};
  c.seed = seed;
  return c;
}

// A Buffer sized for the case's checked calls.
epx::BufferOptions node_buffer_options(const NormalCase& c) {
  epx::BufferOptions options;
  options.num_nvl_bytes = epx::test::normal_buffer_bytes(c);
  options.num_rdma_bytes = epx::test::normal_rdma_buffer_bytes(c);
  options.ranks_per_node = c.ranks_per_node;
  options.wait_timeout_s = 20.0;
  return options;
}

// A bare dispatch_notify of T tokens of `hidden`, each to every rank (no top-k, no per-expert counts).
struct BareNotify {
  DeviceArray x, in_rank, per_expert;
  epx::DispatchInput in;
  BareNotify(const NormalCase& c, int num_tokens, int hidden)
      : x(size_t(num_tokens) * hidden * 2),
        in_rank(size_t(num_tokens) * c.num_ranks),
        per_expert(size_t(c.num_experts) * sizeof(int)) {
    const std::vector<uint8_t> every_rank(size_t(num_tokens) * c.num_ranks, 1);
    EPX_CUDA_CHECK(cudaMemcpy(in_rank.get(), every_rank.data(), every_rank.size(), cudaMemcpyHostToDevice));
    EPX_CUDA_CHECK(cudaMemset(per_expert.get(), 0, size_t(c.num_experts) * sizeof(int)));
    in.x = x.get();
    in.num_tokens = num_tokens;
    in.hidden = hidden;
    in.num_experts = c.num_experts;
    in.is_token_in_rank = in_rank.get<bool>();
    in.num_tokens_per_expert = per_expert.get<int>();
  }
};

// BF16 and FP8, expert alignment, weights and biases, two iterations of every setting.
TEST_P(NormalNodes, FormatsAndAlignment) {
  NormalCase c = node_case(GetParam(), 301);
  c.formats = {kBf16, kFp8};
  c.hidden = 4096;
  c.expert_alignments = {1, 128};
  c.num_biases = {1, 2};
  c.num_iterations = 4;
  run_case(c);
}

// Without top-k (is_token_in_rank only), cached re-dispatch, and the token counts 0, 1 and odd.
TEST_P(NormalNodes, WithoutTopkCachedAndOddCounts) {
  NormalCase c = node_case(GetParam(), 302);
  c.num_tokens = {0, 1, 333, 77};
  c.route_by = {NormalRouteBy::kTopk, NormalRouteBy::kRankMapCounts, NormalRouteBy::kRankMap};
  c.cached = {true, false};
  c.formats = {kBf16, kFp8};
  c.combine_weights = {true, false};
  c.num_iterations = 4;
  run_case(c);
}

// Every token to rank 0's experts (one node receives nothing), and unbalanced routing with a silent rank.
TEST_P(NormalNodes, SkewedRouting) {
  NormalCase c = node_case(GetParam(), 303);
  c.routing = NormalRouting::kOneRank;
  c.num_tokens = {2000, 333, 0};
  c.cached = {false, true};
  c.num_iterations = 3;
  run_case(c);
  NormalCase u = node_case(GetParam(), 304);
  u.routing = NormalRouting::kUnbalanced;
  u.num_tokens = {1000, 10};
  u.num_iterations = 2;
  run_case(u);
}

// Queues at the extremes: one-token network queues and chunks, sub-queues of one record per node.
TEST_P(NormalNodes, OneTokenQueues) {
  NormalCase c = node_case(GetParam(), 305);
  c.num_tokens = {150, 77};
  c.chunk_tokens = 1;
  c.queue_tokens = GetParam().num_ranks / GetParam().ranks_per_node;
  c.rdma_chunk_tokens = 1;
  c.rdma_queue_tokens = 1;
  c.num_sms = {2, 4};
  c.formats = {kBf16, kFp8};
  c.num_iterations = 2;
  run_case(c);
}

// The path a NIC takes (send ring, then the transport's put-with-signal per chunk) on GPUs whose peers it
// could write directly (EPX_INTERNODE_PUTS=1: no rail peer mapped): the ring wrapping mid-chunk, both
// formats, cached.
TEST_P(NormalNodes, NetworkPutsInsteadOfStores) {
  struct PutsOnly {
    PutsOnly() { setenv("EPX_INTERNODE_PUTS", "1", 1); }
    ~PutsOnly() { unsetenv("EPX_INTERNODE_PUTS"); }
  } puts_only;
  NormalCase c = node_case(GetParam(), 308);
  c.num_tokens = {333, 1, 0};
  c.rdma_chunk_tokens = 5;
  c.rdma_queue_tokens = 12;
  c.formats = {kBf16, kFp8};
  c.cached = {false, true};
  c.num_iterations = 2;
  run_case(c);
}

// A batch far above one queue's worth per channel.
TEST_P(NormalNodes, SixteenThousandTokens) {
  NormalCase c = node_case(GetParam(), 306);
  c.num_tokens = {16384};
  c.hidden = 1024;
  c.num_sms = {8};
  c.same_inputs = true;
  run_case(c);
}

// What normal mode cannot run across nodes is refused by dispatch_notify before anything launches, naming the
// argument, its value and the rule: the worst-case mode, NVLink queues with less than one record per source
// node, queues that do not fit the symmetric or the NVLink buffer. Every rank makes the same calls; the
// checked dispatches and combines that follow run on the same Buffer. (Node layouts the Buffer refuses at
// construction, more than 8 ranks per node or more than 15 nodes: cpu/test_normal_nodes.cpp.)
TEST_P(NormalNodes, RefusedCallsLeaveTheBufferUsable) {
  NormalCase c = node_case(GetParam(), 307);
  c.num_tokens = {64, 5};
  c.num_iterations = 2;
  epx::test::run_ranks(c.num_ranks, [&](epx::Bootstrap& bootstrap) {
    epx::Buffer buffer(bootstrap, node_buffer_options(c));
    const int num_nodes = c.num_ranks / c.ranks_per_node;
    const int T = 4, R = c.num_ranks;
    BareNotify bare(c, T, c.hidden);
    epx::DispatchInput& in = bare.in;
    const epx::StreamOrder order{};
    const auto notify = [&] { epx::dispatch_notify(buffer, in, order); };

    in.num_worst_tokens = T * R;
    expect_error(notify, "invalid num_worst_tokens = " + std::to_string(T * R) + ": must be 0 across nodes");
    in.num_worst_tokens = 0;

    // The case's own config (its queues fit the buffer sized for it; the default config's need not).
    const epx::Config config = epx::test::normal_config(c, c.num_sms.front());
    buffer.set_config(config);
    epx::Config bad = config;
    bad.num_max_nvl_chunked_send_tokens = 1;
    bad.num_max_nvl_chunked_recv_tokens = num_nodes - 1;
    buffer.set_config(bad);
    expect_error(notify, "invalid num_max_nvl_chunked_recv_tokens = " + std::to_string(num_nodes - 1) +
                             ": must be >= the number of nodes (" + std::to_string(num_nodes) + ")");
    bad = config;
    bad.num_max_rdma_chunked_recv_tokens = config.num_max_rdma_chunked_recv_tokens * 64;
    buffer.set_config(bad);
    expect_error(notify,
                 "invalid num_rdma_bytes = " + std::to_string(buffer.num_rdma_bytes()) + ": must be >= ");
    if (c.ranks_per_node > 1) {  // nodes of one rank forward nothing over NVLink
      bad = config;
      bad.num_max_nvl_chunked_recv_tokens = config.num_max_nvl_chunked_recv_tokens * 64;
      buffer.set_config(bad);
      expect_error(notify,
                   "invalid num_nvl_bytes = " + std::to_string(buffer.num_nvl_bytes()) + ": must be >= ");
    }
    buffer.set_config(config);
    epx::test::NormalRunner(c, buffer).run();
  });
}

// One rank dispatches rows of another hidden size: its count messages carry its shape fingerprint, so every
// rank's dispatch_notify raises the shape error (no timeout), and after reset() the Buffer runs checked
// calls.
TEST_P(NormalNodes, ShapesThatDifferFailOnEveryRank) {
  NormalCase c = node_case(GetParam(), 309);
  c.num_tokens = {64, 5};
  c.num_iterations = 2;
  epx::test::run_ranks(c.num_ranks, [&](epx::Bootstrap& bootstrap) {
    epx::Buffer buffer(bootstrap, node_buffer_options(c));
    buffer.set_config(epx::test::normal_config(c, c.num_sms.front()));
    const bool last = bootstrap.rank() == c.num_ranks - 1;
    const BareNotify bare(c, 4, last ? c.hidden / 2 : c.hidden);
    const auto start = std::chrono::steady_clock::now();
    // "peer P called with hidden = ..." from its own check, or "... called with other shapes" from a peer's
    // abort.
    expect_error([&] { epx::dispatch_notify(buffer, bare.in, epx::StreamOrder{}); }, "called with");
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (seconds > 10.0) throw std::runtime_error("the shape check waited " + std::to_string(seconds) + " s");
    buffer.reset();
    epx::test::NormalRunner(c, buffer).run();
  });
}

// One Buffer serves normal mode across nodes and low-latency mode (sized with the larger of the two hints, as
// SGLang sizes DeepEP's). Normal calls, then low-latency calls, then normal calls again, then low-latency
// calls again, every result checked against the reference. A low-latency call right after normal-mode calls
// is refused until clean_low_latency_buffer(); normal mode needs nothing after low-latency calls.
TEST_P(NormalNodes, MixedWithLowLatencyCalls) {
  NormalCase c = node_case(GetParam(), 308);
  c.num_tokens = {333, 1};
  c.formats = {kBf16, kFp8};
  c.num_iterations = 2;
  epx::test::LowLatencyCase l = epx::test::small_low_latency_case(c.num_ranks);
  l.ranks_per_node = c.ranks_per_node;
  l.use_fp8 = true;
  l.num_iterations = 2;
  epx::test::run_ranks(c.num_ranks, [&](epx::Bootstrap& bootstrap) {
    epx::BufferOptions options = node_buffer_options(c);
    options.num_rdma_bytes =
        std::max(options.num_rdma_bytes,
                 epx::get_low_latency_rdma_size_hint(l.num_max_tokens, l.hidden, l.num_ranks, l.num_experts));
    epx::Buffer buffer(bootstrap, options);
    const epx::StreamOrder order{};
    const auto clean = [&] {
      epx::clean_low_latency_buffer(buffer, l.num_max_tokens, l.hidden, l.num_experts, order);
    };
    for (int round = 0; round < 2; ++round) {
      epx::test::NormalRunner(c, buffer).run();
      expect_error([&] { epx::test::LowLatencyRunner(l, buffer).run(); },
                   "after normal-mode calls across nodes: they share the symmetric buffer");
      clean();
      epx::test::LowLatencyRunner(l, buffer).run();
    }
    EPX_CUDA_CHECK(cudaDeviceSynchronize());
  });
}

}  // namespace
