// The node layouts normal mode refuses (src/buffer_map/normal_nodes.hpp): checked on the host before anything
// is allocated or launched, each error naming the argument, its value and the rule. The Buffer's constructor,
// the size hints and dispatch_notify call these functions (gpu/test_normal_nodes.cpp checks the calls).
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "buffer_map/internode_buffer_map.hpp"
#include "buffer_map/normal_nodes.hpp"
#include "cpu/error_message.hpp"
#include "epx/error.hpp"

namespace {

using epx::test::error_of;

TEST(NormalNodes, OneNodeHoldsAtMostEightRanks) {
  for (int num_ranks : {1, 2, 4, 8}) {
    EXPECT_EQ(error_of([&] { epx::check_normal_node_layout(num_ranks, num_ranks); }), "") << num_ranks;
  }
  EXPECT_EQ(
      error_of([&] { epx::check_normal_node_layout(16, 16); }),
      "invalid num_ranks = 16: must be <= 8 for the normal-mode NVLink buffer on one node (nodes of up to 8 "
      "ranks beyond)");
}

TEST(NormalNodes, NodesAcrossHoldAtMostEightRanks) {
  EXPECT_EQ(error_of([&] { epx::check_normal_node_layout(64, 8); }), "");
  EXPECT_EQ(
      error_of([&] { epx::check_normal_node_layout(32, 16, "EPX_RANKS_PER_NODE"); }),
      "invalid EPX_RANKS_PER_NODE = 16: must be <= 8 for normal mode across nodes (32 ranks): a node is one "
      "NVLink domain");
}

TEST(NormalNodes, AtMostFifteenNodes) {
  EXPECT_EQ(error_of([&] { epx::check_normal_node_layout(15, 1); }), "");
  EXPECT_EQ(error_of([&] { epx::check_normal_node_layout(60, 4); }), "");
  EXPECT_EQ(
      error_of([&] { epx::check_normal_node_layout(16, 1); }),
      "invalid ranks_per_node = 1: must give at most 15 nodes for normal mode across nodes (16 ranks make "
      "16)");
  EXPECT_EQ(
      error_of([&] { epx::check_normal_node_layout(64, 4); }),
      "invalid ranks_per_node = 4: must give at most 15 nodes for normal mode across nodes (64 ranks make "
      "16)");
  // The limit is below the arrays' node dimension (kMaxRdmaNodes): one barrier of the 16 is the block's.
  EXPECT_EQ(epx::kMaxNormalNodes, epx::kMaxRdmaNodes - 1);
}

TEST(NormalNodes, TheWorstCaseModeNeedsOneNode) {
  EXPECT_EQ(error_of([&] { epx::check_normal_dispatch_nodes(1, 4096); }), "");
  EXPECT_EQ(error_of([&] { epx::check_normal_dispatch_nodes(2, 0); }), "");
  EXPECT_EQ(
      error_of([&] { epx::check_normal_dispatch_nodes(2, 4096); }),
      "invalid num_worst_tokens = 4096: must be 0 across nodes (the CPU-sync-free mode needs one node, as in "
      "DeepEP)");
}

TEST(NormalNodes, ForwardingQueuesHoldARecordPerSourceNode) {
  epx::Config config;
  config.num_max_nvl_chunked_send_tokens = 1;
  config.num_max_nvl_chunked_recv_tokens = 3;
  EXPECT_EQ(error_of([&] { epx::check_normal_forward_queues(config, 1); }), "");
  EXPECT_EQ(error_of([&] { epx::check_normal_forward_queues(config, 3); }), "");
  EXPECT_EQ(
      error_of([&] { epx::check_normal_forward_queues(config, 4); }),
      "invalid num_max_nvl_chunked_recv_tokens = 3: must be >= the number of nodes (4) across nodes: every "
      "source node gets num_max_nvl_chunked_recv_tokens / nodes records of each NVLink queue");
}

// The NVLink buffer's forwarding queues: every source node gets num_max_nvl_chunked_recv_tokens / nodes
// records of each queue, and the queues must fit num_nvl_bytes.
TEST(NormalNodes, ForwardingQueuesMustHoldARecordAndFit) {
  epx::Config config;
  config.num_max_nvl_chunked_send_tokens = 1;
  config.num_max_nvl_chunked_recv_tokens = 3;
  const auto record = epx::InternodeRecord::largest(7168 * 2);
  const epx::ForwardBufferMap too_short = epx::ForwardBufferMap::of(2, 4, config, record);
  EXPECT_EQ(
      error_of([&] { epx::check_forward_map_fits(too_short, size_t(1) << 30); }),
      "invalid num_max_nvl_chunked_recv_tokens = 0: must be >= the number of nodes (4) across nodes: every "
      "source node gets num_max_nvl_chunked_recv_tokens / nodes records of each NVLink queue");
  const epx::ForwardBufferMap map = epx::ForwardBufferMap::of(2, 2, epx::Config{}, record);
  EXPECT_EQ(error_of([&] { epx::check_forward_map_fits(map, map.total_bytes()); }), "");
  EXPECT_NE(error_of([&] { epx::check_forward_map_fits(map, map.total_bytes() - 1); })
                .find("invalid num_nvl_bytes = " + std::to_string(map.total_bytes() - 1) + ": must be >= " +
                      std::to_string(map.total_bytes()) + " for this call (2 nodes of 2 ranks"),
            std::string::npos);
}

}  // namespace
