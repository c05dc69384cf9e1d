#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "buffer_map/internode_buffer_map.hpp"
#include "epx/error.hpp"

namespace {

using epx::Config;
using epx::InternodeBufferMap;
using epx::InternodeRecord;
using epx::NodeMap;
using epx::NormalShape;

// Passes when `call` throws an epx::Error whose message contains `needle` ("" : when it throws nothing).
void expect_message(const std::function<void()>& call, const std::string& needle) {
  std::string message;
  try {
    call();
  } catch (const epx::Error& error) {
    message = error.message();
  }
  if (needle.empty()) {
    EXPECT_EQ(message, "");
  } else {
    EXPECT_NE(message.find(needle), std::string::npos)
        << "expected '" << needle << "' in '" << message << "'";
  }
}

TEST(InternodeBufferMap, NodeMapNamesNodesLocalRanksAndRails) {
  const NodeMap nodes{16, 8};
  EXPECT_EQ(nodes.num_nodes(), 2);
  EXPECT_TRUE(nodes.spans_nodes());
  EXPECT_EQ(nodes.node_of(11), 1);
  EXPECT_EQ(nodes.local_rank(11), 3);
  EXPECT_EQ(nodes.rail_peer(11, 0), 3);
  EXPECT_EQ(nodes.rail_peer(3, 1), 11);
  EXPECT_EQ(nodes.rail_peer(3, 0), 3);  // its own node: itself
  // Ranks 1, 8, 9 and 15: local ranks 1 on node 0, and 0, 1, 7 on node 1.
  const uint64_t mask = (1ull << 1) | (1ull << 8) | (1ull << 9) | (1ull << 15);
  EXPECT_EQ(nodes.local_mask(mask, 0), 0b10u);
  EXPECT_EQ(nodes.local_mask(mask, 1), 0b10000011u);
  EXPECT_FALSE((NodeMap{4, 4}.spans_nodes()));
  const NodeMap singles{4, 1};  // 4 x 1 virtual nodes
  EXPECT_EQ(singles.num_nodes(), 4);
  EXPECT_EQ(singles.local_mask(0b1010, 3), 1u);
  EXPECT_EQ(singles.local_mask(0b1010, 2), 0u);
  const NodeMap wide{64, 64};  // one node of 64 (low-latency only): the mask keeps every bit
  EXPECT_EQ(wide.local_mask(~0ull, 0), 0xFFFFFFFFu);
}

TEST(InternodeBufferMap, NodeSplitRulesNameTheArgument) {
  expect_message([] { epx::validate_node_split(16, 8); }, "");
  expect_message([] { epx::validate_node_split(4, 1); }, "");
  expect_message([] { epx::validate_node_split(16, 16); }, "");  // one node: its size is not limited here
  expect_message([] { epx::validate_node_split(8, 3); },
                 "invalid ranks_per_node = 3: must divide num_ranks (8): nodes are equal blocks");
  expect_message([] { epx::validate_node_split(32, 16, "EPX_RANKS_PER_NODE"); },
                 "invalid EPX_RANKS_PER_NODE = 16: must be <= 8 when the group spans nodes (32 ranks)");
  expect_message([] { epx::validate_node_split(4, 0); }, "invalid ranks_per_node = 0: must be >= 1");
}

// An internode record is the normal-mode record with the rank mask after the source index, padded to 16.
TEST(InternodeBufferMap, RecordCarriesTheNodeRankMaskAfterTheNormalFields) {
  const InternodeRecord largest = InternodeRecord::largest(7168 * 2);
  EXPECT_EQ(largest.bytes(), 14480u);  // 14336 + 16 ids + 16 weights + source index + rank mask
  for (const int row_bytes : {7168 * 2, 7168}) {
    for (const int topk : {0, 1, 8, epx::kMaxTopk}) {
      const NormalShape shape{16, 256, 7168, row_bytes, row_bytes == 7168 ? 56 : 0, topk};
      const InternodeRecord record = InternodeRecord::dispatch(shape);
      const epx::NormalRecord normal = epx::NormalRecord::dispatch(shape);
      EXPECT_EQ(record.rank_mask_offset(), normal.src_idx_offset() + 4);
      EXPECT_EQ(record.bytes(), epx::align_up(normal.src_idx_offset() + 8, 16));
      EXPECT_LE(record.bytes(), largest.bytes()) << row_bytes << " bytes, top-" << topk;
      const InternodeRecord combine = InternodeRecord::combine(7168, topk);
      EXPECT_EQ(combine.bytes(), epx::NormalRecord::combine(7168, topk).bytes());  // no mask going back
    }
  }
  EXPECT_EQ(InternodeRecord::dispatch(NormalShape{16, 256, 7168, 7168 * 2, 0, 8}).bytes(), 14416u);
}

// Every send ring and receive queue record of every (own node, peer node, channel, entry) tiles the area
// after the fixed head exactly once, record after record; entry e and e + Q share a slot.
TEST(InternodeBufferMap, SendRingsAndQueuesTileTheBufferAfterTheHead) {
  Config config;
  config.num_sms = 6;  // 3 channels
  config.num_max_rdma_chunked_recv_tokens = 5;
  const int num_nodes = 4, queue_tokens = 5;
  const InternodeBufferMap map = InternodeBufferMap::of(
      num_nodes, config, InternodeRecord::dispatch(NormalShape{8, 64, 256, 512, 0, 4}));
  ASSERT_EQ(map.num_channels, 3);
  ASSERT_EQ(map.queue_tokens, queue_tokens);
  const size_t num_records = (2 * size_t(num_nodes) - 1) * 3 * queue_tokens;
  EXPECT_EQ(map.total_bytes(), InternodeBufferMap::kQueuesOffset + num_records * map.record_bytes);
  std::vector<char> buffer(map.total_bytes());
  char* base = buffer.data();
  for (int own = 0; own < num_nodes; ++own) {
    std::vector<size_t> offsets;
    for (int peer = 0; peer < num_nodes; ++peer) {
      for (int c = 0; c < map.num_channels; ++c) {
        for (uint64_t entry = 0; entry < uint64_t(queue_tokens); ++entry) {
          offsets.push_back(map.recv_record(base, peer, c, entry) - base);
          EXPECT_EQ(map.recv_record(base, peer, c, entry + queue_tokens),
                    map.recv_record(base, peer, c, entry));
          if (peer == own) continue;  // no ring towards the own node
          offsets.push_back(map.send_record(base, peer, own, c, entry) - base);
          EXPECT_EQ(map.send_record(base, peer, own, c, entry + queue_tokens),
                    map.send_record(base, peer, own, c, entry));
        }
      }
    }
    std::sort(offsets.begin(), offsets.end());
    ASSERT_EQ(offsets.size(), num_records);
    for (size_t i = 0; i < num_records; ++i)
      ASSERT_EQ(offsets[i], InternodeBufferMap::kQueuesOffset + i * map.record_bytes) << "node " << own;
  }
  // The head keeps its size whatever the call: counters and notify counts stay at stable addresses.
  EXPECT_EQ(sizeof(InternodeBufferMap::Control), 776u);
  EXPECT_EQ(offsetof(InternodeBufferMap::Head, counters), 896u);
  EXPECT_EQ(sizeof(InternodeBufferMap::QueueCounters), 4u * epx::kMaxRdmaNodes * epx::kMaxChannels * 8);
  EXPECT_EQ(offsetof(InternodeBufferMap::Head, notify) % 128, 0u);
  EXPECT_EQ(InternodeBufferMap::kQueuesOffset, 323840u);
  EXPECT_EQ(static_cast<void*>(&InternodeBufferMap::head(base)->notify[1]),
            static_cast<void*>(base + offsetof(InternodeBufferMap::Head, notify) +
                               sizeof(InternodeBufferMap::NotifyHalf)));
}

// Pinned hints, as docs/ARCHITECTURE.md lists them: hidden 7168, 2 and 4 nodes of 8, DeepEP's recommended
// network queue of 128 tokens.
TEST(InternodeBufferMap, SizeHintDependsOnTheConfigNotOnTokens) {
  Config config;
  config.num_max_rdma_chunked_recv_tokens = 128;
  const size_t record = 14480;
  EXPECT_EQ(config.get_rdma_buffer_size_hint(7168 * 2, 16), 323840u + 3 * 10 * 128 * record);
  EXPECT_EQ(config.get_rdma_buffer_size_hint(7168 * 2, 16), 55927040u);
  EXPECT_EQ(config.get_rdma_buffer_size_hint(7168 * 2, 32), 130064640u);
  // Two arguments: DeepEP's convention (one node up to 8 ranks, nodes of 8 above).
  for (int ranks : {1, 2, 4, 8}) EXPECT_EQ(config.get_rdma_buffer_size_hint(7168 * 2, ranks), 0u);
  EXPECT_EQ(config.get_rdma_buffer_size_hint(7168 * 2, 16),
            config.get_rdma_buffer_size_hint(7168 * 2, 16, 8));
  EXPECT_EQ(config.get_rdma_buffer_size_hint(7168 * 2, 16),
            epx::internode_rdma_buffer_size_hint(7168 * 2, 16, 8, config));
  // Virtual nodes: any split of the ranks; one node needs nothing.
  EXPECT_EQ(config.get_rdma_buffer_size_hint(7168 * 2, 4, 4), 0u);
  EXPECT_EQ(config.get_rdma_buffer_size_hint(7168 * 2, 4, 2),
            config.get_rdma_buffer_size_hint(7168 * 2, 16, 8));
  EXPECT_EQ(config.get_rdma_buffer_size_hint(7168 * 2, 4, 1),
            config.get_rdma_buffer_size_hint(7168 * 2, 32, 8));
  // More channels or deeper queues need more.
  Config wide = config;
  wide.num_sms = 24;
  EXPECT_EQ(wide.get_rdma_buffer_size_hint(7168 * 2, 16), 323840u + 3 * 12 * 128 * record);
  Config deep = config;
  deep.num_max_rdma_chunked_recv_tokens = 256;
  EXPECT_GT(deep.get_rdma_buffer_size_hint(7168 * 2, 16), config.get_rdma_buffer_size_hint(7168 * 2, 16));
}

TEST(InternodeBufferMap, SizeHintAndFitErrorsNameTheArgument) {
  const Config config;
  expect_message([&] { config.get_rdma_buffer_size_hint(7168 * 2, 12); },
                 "invalid num_ranks = 12: must be a multiple of 8 above 8 ranks");
  expect_message([&] { config.get_rdma_buffer_size_hint(7168 * 2, 8, 3); },
                 "invalid ranks_per_node = 3: must divide num_ranks (8)");
  expect_message([&] { config.get_rdma_buffer_size_hint(7168 * 2, 32, 16); },
                 "invalid ranks_per_node = 16: must be <= 8 when the group spans nodes");
  expect_message([&] { config.get_rdma_buffer_size_hint(7168 * 2, 32, 1); },
                 "invalid ranks_per_node = 1: must give at most 15 nodes for normal mode across nodes (32 "
                 "ranks make 32)");
  // 16 nodes: one more than the kernels' named barriers serve.
  expect_message([&] { config.get_rdma_buffer_size_hint(7168 * 2, 64, 4); },
                 "invalid ranks_per_node = 4: must give at most 15 nodes for normal mode across nodes (64 "
                 "ranks make 16)");
  EXPECT_GT(config.get_rdma_buffer_size_hint(7168 * 2, 60, 4), 0u);
  expect_message([&] { config.get_rdma_buffer_size_hint(7168 * 2 + 2, 16); },
                 "invalid hidden_bytes = 14338: must be a multiple of 16");
  expect_message([&] { config.get_rdma_buffer_size_hint(7168 * 2, 16, -1); },
                 "invalid ranks_per_node = -1: must be >= 0");
  Config bad = config;
  bad.num_max_rdma_chunked_send_tokens = 300;
  expect_message(
      [&] { epx::validate_config(bad); },
      "invalid num_max_rdma_chunked_send_tokens = 300: must be <= num_max_rdma_chunked_recv_tokens (256)");

  const InternodeBufferMap map = InternodeBufferMap::of(2, config, InternodeRecord::largest(7168 * 2));
  expect_message([&] { epx::check_internode_map_fits(map, map.total_bytes()); }, "");
  expect_message(
      [&] { epx::check_internode_map_fits(map, map.total_bytes() - 1); },
      "invalid num_rdma_bytes = " + std::to_string(map.total_bytes() - 1) +
          ": must be >= " + std::to_string(map.total_bytes()) +
          " for this call (2 nodes, 10 channels, 256 tokens per queue, 14480-byte records); size it "
          "with Config::get_rdma_buffer_size_hint");
}

}  // namespace

// The Buffer's first config across nodes: Config's queues (the symmetric buffer its hint sized stays big
// enough), a send chunk of 16 that fits them.
TEST(InternodeBufferMap, AcrossNodesConfigKeepsTheHintsQueues) {
  const Config defaults{.num_sms = 24};
  const Config config = epx::across_nodes_config(24);
  EXPECT_EQ(config.num_sms, 24);
  EXPECT_EQ(config.num_max_rdma_chunked_send_tokens, 16);
  EXPECT_EQ(config.num_max_rdma_chunked_recv_tokens, defaults.num_max_rdma_chunked_recv_tokens);
  EXPECT_EQ(config.num_max_nvl_chunked_recv_tokens, defaults.num_max_nvl_chunked_recv_tokens);
  EXPECT_EQ(config.get_rdma_buffer_size_hint(7168 * 2, 16), defaults.get_rdma_buffer_size_hint(7168 * 2, 16));
  epx::validate_config(config);
}
