// epx-bench's option rules (bench/bench_options.hpp) and the network bytes of a run across nodes
// (bench/bench_bytes.hpp, docs/BENCHMARKS.md): every bad value names its flag, its value and the rule.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "bench/bench_bytes.hpp"
#include "bench/bench_options.hpp"
#include "cpu/error_message.hpp"
#include "epx/error.hpp"
#include "reference/layout.hpp"

namespace {

using epx::bench::BenchOptions;

using epx::test::error_of;

TEST(BenchOptions, RanksPerNodeMustDivideTheRanks) {
  BenchOptions o;
  o.num_ranks = 4;
  for (int ranks_per_node : {0, 1, 2, 4}) {
    o.ranks_per_node = ranks_per_node;
    EXPECT_EQ(error_of([&] { epx::bench::validate_options(o); }), "") << ranks_per_node;
  }
  o.ranks_per_node = 3;
  EXPECT_EQ(error_of([&] { epx::bench::validate_options(o); }),
            "invalid --ranks-per-node = 3: must divide --ranks (4): nodes are equal blocks of ranks");
  o.ranks_per_node = -1;
  EXPECT_EQ(error_of([&] { epx::bench::validate_options(o); }),
            "invalid --ranks-per-node = -1: must be >= 0 (0: one node)");
  // Without --ranks the count is the visible GPUs', checked when it is known.
  o.num_ranks = 0;
  o.ranks_per_node = 3;
  EXPECT_EQ(error_of([&] { epx::bench::validate_options(o); }), "");
  EXPECT_EQ(
      error_of([&] { epx::bench::check_ranks_per_node("--ranks-per-node", 3, 8, "the visible GPUs"); }),
      "invalid --ranks-per-node = 3: must divide the visible GPUs (8): nodes are equal blocks of ranks");
}

TEST(BenchOptions, RanksPerGpuIsAtLeastOne) {
  BenchOptions o;
  o.ranks_per_gpu = 4;
  EXPECT_EQ(error_of([&] { epx::bench::validate_options(o); }), "");
  o.ranks_per_gpu = 0;
  EXPECT_EQ(error_of([&] { epx::bench::validate_options(o); }), "invalid --ranks-per-gpu = 0: must be >= 1");
}

TEST(BenchOptions, LowLatencyNodesFollowTheSameRule) {
  BenchOptions o;
  o.num_ranks = 4;
  o.ll_ranks_per_node = 3;
  EXPECT_EQ(error_of([&] { epx::bench::validate_options(o); }),
            "invalid --ll-ranks-per-node = 3: must divide --ranks (4): nodes are equal blocks of ranks");
}

TEST(BenchOptions, NormalNodesAreOneNodeUnlessTheFlagSplitsTheRanks) {
  BenchOptions o;
  EXPECT_EQ(epx::bench::normal_ranks_per_node(o, 4), 4);
  o.ranks_per_node = 4;
  EXPECT_EQ(epx::bench::normal_ranks_per_node(o, 4), 4);
  o.ranks_per_node = 2;
  EXPECT_EQ(epx::bench::normal_ranks_per_node(o, 4), 2);
  o.ranks_per_node = 1;
  EXPECT_EQ(epx::bench::normal_ranks_per_node(o, 2), 1);
}

// Without a GPU the CPU reference run names the GPU-only flags it ignores: those set away from their
// defaults.
TEST(BenchOptions, GpuOnlyFlagsSet) {
  BenchOptions o;
  EXPECT_TRUE(epx::bench::gpu_only_flags_set(o).empty());
  o.num_tokens = 16;  // the shape: the CPU reference runs it
  o.json = true;
  EXPECT_TRUE(epx::bench::gpu_only_flags_set(o).empty());
  o.tune = true;
  o.seed = 7;
  o.num_sms = {8, 16};
  EXPECT_EQ(epx::bench::gpu_only_flags_set(o), (std::vector<std::string>{"--num-sms", "--tune", "--seed"}));
}

// Each mode's table header names that mode's shape, with each count in the number it takes ("1 rank").
TEST(BenchOptions, HeadersNameEachModesShape) {
  BenchOptions o;
  EXPECT_EQ(
      epx::bench::normal_header(o, 4),
      "normal mode: 4 ranks, 4096 tokens/rank, hidden 7168, top-8 of 256 experts (GB/s = rows received x "
      "row bytes / time; verified before timing)");
  EXPECT_EQ(
      epx::bench::low_latency_header(o, 4),
      "low-latency mode: 4 ranks, 128 tokens/rank, hidden 7168, top-8 of 288 experts (GB/s = selections x "
      "bytes per selection / time; verified before timing)");
  o.num_tokens = 1;
  o.ll_num_tokens = 1;
  o.num_experts = 8;
  o.ll_num_experts = 1;
  o.num_topk = 1;
  EXPECT_EQ(
      epx::bench::normal_header(o, 1),
      "normal mode: 1 rank, 1 token/rank, hidden 7168, top-1 of 8 experts (GB/s = rows received x row bytes "
      "/ time; verified before timing)");
  EXPECT_EQ(
      epx::bench::low_latency_header(o, 1),
      "low-latency mode: 1 rank, 1 token/rank, hidden 7168, top-1 of 1 expert (GB/s = selections x bytes "
      "per selection / time; verified before timing)");
  o.ranks_per_node = 2;
  o.ll_ranks_per_node = 4;
  EXPECT_EQ(
      epx::bench::normal_header(o, 4),
      "normal mode: 4 ranks (2 nodes of 2, NVSHMEM between them), 1 token/rank, hidden 7168, top-1 of 8 "
      "experts (GB/s = rows received x row bytes / time; net GB/s = rows crossing to other nodes, once per "
      "node, x row bytes / time; verified before timing)");
  EXPECT_EQ(epx::bench::low_latency_header(o, 8).substr(0, 78),
            "low-latency mode: 8 ranks (2 nodes of 4, NVSHMEM between them), 1 token/rank, ");
  EXPECT_EQ(epx::bench::count_of(0, "token", "tokens"), "0 tokens");
}

// Each token counts once per other node that holds one of its experts, however many ranks there need it.
TEST(BenchBytes, NetworkRowsCountEachTokenOncePerOtherNode) {
  // 4 ranks as 2 nodes of 2, one expert per rank.
  const std::vector<int64_t> topk_idx = {
      0,  1,  // token 0: both ranks of node 0 -> no network row for a rank of node 0
      2,  3,  // token 1: both ranks of node 1 -> one row to node 1 (not two)
      0,  2,  // token 2: one rank of each node -> one row to node 1
      -1, 3,  // token 3: rank 3 only -> one row to node 1
      -1, -1  // token 4: nowhere
  };
  const auto layout = epx::reference::get_dispatch_layout(topk_idx.data(), 5, 2, 4, 4, 2);
  ASSERT_EQ(layout.num_tokens_per_rdma_rank, (std::vector<int>{2, 3}));
  EXPECT_EQ(epx::internode_network_rows(layout.num_tokens_per_rdma_rank.data(), 2, 0), 3);
  EXPECT_EQ(epx::internode_network_rows(layout.num_tokens_per_rdma_rank.data(), 2, 1), 2);
  // Bytes: those rows x the row bytes of the format.
  EXPECT_EQ(epx::internode_network_rows(layout.num_tokens_per_rdma_rank.data(), 2, 0) *
                epx::normal_row_bytes(7168, false),
            3 * 14336.0);
  // One node: nothing crosses.
  const int one_node[] = {5};
  EXPECT_EQ(epx::internode_network_rows(one_node, 1, 0), 0);
}

}  // namespace
