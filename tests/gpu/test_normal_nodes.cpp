// Normal mode across nodes on virtual nodes (BufferOptions::ranks_per_node below the group size): every token
// crosses the network to a node once (NVSHMEM), its rail peer there forwards it over NVLink; combine reduces
// inside each node first. Bit-exact against reference::internode_dispatch / internode_combine (the received
// rows are normal_dispatch's). Ranks may share one GPU (EPX_TEST_RANKS_PER_GPU).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "run_ranks.hpp"
#include "test_normal_harness.hpp"

namespace {

using epx::TokenFormat;
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

// A batch far above one queue's worth per channel.
TEST_P(NormalNodes, SixteenThousandTokens) {
  NormalCase c = node_case(GetParam(), 306);
  c.num_tokens = {16384};
  c.hidden = 1024;
  c.num_sms = {8};
  c.same_inputs = true;
  run_case(c);
}

}  // namespace
