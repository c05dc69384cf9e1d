#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "epx/error.hpp"
#include "epx/layout/internode_layout.hpp"

namespace {

using epx::Config;
using epx::InternodeLayout;
using epx::InternodeRecord;
using epx::NodeMap;
using epx::NormalShape;

std::string message_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const epx::Error& error) {
    return error.message();
  }
  return "";
}

TEST(InternodeLayout, NodeMapNamesNodesLocalRanksAndRails) {
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

TEST(InternodeLayout, NodeSplitRulesNameTheArgument) {
  EXPECT_EQ(message_of([] { epx::validate_node_split(16, 8); }), "");
  EXPECT_EQ(message_of([] { epx::validate_node_split(4, 1); }), "");
  EXPECT_EQ(message_of([] { epx::validate_node_split(16, 16); }),
            "");  // one node: its size is not limited here
  EXPECT_NE(message_of([] {
              epx::validate_node_split(8, 3);
            }).find("invalid ranks_per_node = 3: must divide num_ranks (8): nodes are equal blocks"),
            std::string::npos);
  EXPECT_NE(message_of([] {
              epx::validate_node_split(32, 16, "EPX_RANKS_PER_NODE");
            }).find("invalid EPX_RANKS_PER_NODE = 16: must be <= 8 when the group spans nodes (32 ranks)"),
            std::string::npos);
  EXPECT_NE(
      message_of([] { epx::validate_node_split(4, 0); }).find("invalid ranks_per_node = 0: must be >= 1"),
      std::string::npos);
}

TEST(InternodeLayout, RecordCarriesTheNodeRankMaskAfterTheNormalFields) {
  const NormalShape bf16{16, 256, 7168, 7168 * 2, 0, 8};
  const InternodeRecord dispatch = InternodeRecord::dispatch(bf16);
  EXPECT_EQ(dispatch.normal.src_idx_offset(), 14336u + 64);
  EXPECT_EQ(dispatch.rank_mask_offset(), 14336u + 68);
  EXPECT_EQ(dispatch.bytes(), 14416u);  // 14336 + 72, padded to 16
  const InternodeRecord fp8 = InternodeRecord::dispatch(NormalShape{16, 256, 7168, 7168, 56, 8});
  EXPECT_EQ(fp8.rank_mask_offset(), 7168u + 56 * 4 + 64 + 4);
  EXPECT_EQ(fp8.bytes() % 16, 0u);
  const InternodeRecord combine = InternodeRecord::combine(7168, 8);
  EXPECT_FALSE(combine.with_rank_mask);
  EXPECT_EQ(combine.bytes(), 14336u + 32);
  const InternodeRecord largest = InternodeRecord::largest(7168 * 2);
  EXPECT_EQ(largest.bytes(), 14480u);  // 14336 + 16 ids + 16 weights + source index + rank mask
  for (int topk : {0, 1, 8, epx::kMaxTopk}) {
    EXPECT_LE(InternodeRecord::dispatch(NormalShape{16, 256, 7168, 7168 * 2, 0, topk}).bytes(),
              largest.bytes());
    EXPECT_LE(InternodeRecord::dispatch(NormalShape{16, 256, 7168, 7168, 56, topk}).bytes(), largest.bytes());
    EXPECT_LE(InternodeRecord::combine(7168, topk).bytes(), largest.bytes());
  }
}

TEST(InternodeLayout, SendRingsAndQueuesAreDisjointAndInsideTheBuffer) {
  Config config;
  config.num_sms = 6;  // 3 channels
  config.num_max_rdma_chunked_recv_tokens = 5;
  const int num_nodes = 4;
  const InternodeLayout layout =
      InternodeLayout::of(num_nodes, config, InternodeRecord::dispatch(NormalShape{8, 64, 256, 512, 0, 4}));
  EXPECT_EQ(layout.num_channels, 3);
  EXPECT_EQ(layout.queue_tokens, 5);
  EXPECT_EQ(layout.total_bytes(),
            InternodeLayout::kQueuesOffset + 2 * size_t(num_nodes - 1) * 3 * 5 * layout.record_bytes);
  std::vector<char> buffer(layout.total_bytes());
  char* base = buffer.data();
  for (int own = 0; own < num_nodes; ++own) {
    std::set<size_t> offsets;
    for (int peer = 0; peer < num_nodes; ++peer) {
      if (peer == own) continue;
      for (int c = 0; c < layout.num_channels; ++c) {
        for (uint32_t entry = 0; entry < 5; ++entry) {
          for (char* record : {layout.send_record(base, peer, own, c, entry),
                               layout.recv_record(base, peer, own, c, entry)}) {
            const size_t offset = record - base;
            EXPECT_GE(offset, InternodeLayout::kQueuesOffset);
            EXPECT_LE(offset + layout.record_bytes, layout.total_bytes());
            EXPECT_EQ(offset % 16, 0u);
            EXPECT_TRUE(offsets.insert(offset).second) << "record used twice";
          }
          // Entry e and e + Q share a slot.
          EXPECT_EQ(layout.recv_record(base, peer, own, c, entry + 5),
                    layout.recv_record(base, peer, own, c, entry));
          EXPECT_EQ(layout.send_record(base, peer, own, c, entry + 5),
                    layout.send_record(base, peer, own, c, entry));
        }
      }
    }
    EXPECT_EQ(offsets.size(), 2 * size_t(num_nodes - 1) * 3 * 5);
  }
  // The fixed areas keep their size whatever the call: counters and notify counts at stable addresses.
  EXPECT_EQ(sizeof(InternodeLayout::Control), 400u);
  EXPECT_EQ(InternodeLayout::kCountersOffset, 512u);
  EXPECT_EQ(sizeof(InternodeLayout::QueueCounters), 4u * epx::kMaxRdmaNodes * epx::kMaxChannels * 8);
  EXPECT_EQ(InternodeLayout::kQueuesOffset, 180736u);
}

// Pinned hints, as docs/ARCHITECTURE.md lists them: hidden 7168, 2 and 4 nodes of 8, DeepEP's recommended
// network queue of 128 tokens.
TEST(InternodeLayout, SizeHintDependsOnTheConfigNotOnTokens) {
  Config config;
  config.num_max_rdma_chunked_recv_tokens = 128;
  const size_t record = 14480;
  EXPECT_EQ(config.get_rdma_buffer_size_hint(7168 * 2, 16), 180736u + 2 * 1 * 10 * 128 * record);
  EXPECT_EQ(config.get_rdma_buffer_size_hint(7168 * 2, 16), 37249536u);
  EXPECT_EQ(config.get_rdma_buffer_size_hint(7168 * 2, 32), 111387136u);
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
  EXPECT_EQ(wide.get_rdma_buffer_size_hint(7168 * 2, 16), 180736u + 2 * 12 * 128 * record);
  Config deep = config;
  deep.num_max_rdma_chunked_recv_tokens = 256;
  EXPECT_GT(deep.get_rdma_buffer_size_hint(7168 * 2, 16), config.get_rdma_buffer_size_hint(7168 * 2, 16));
}

TEST(InternodeLayout, SizeHintAndFitErrorsNameTheArgument) {
  const Config config;
  EXPECT_NE(message_of([&] {
              config.get_rdma_buffer_size_hint(7168 * 2, 12);
            }).find("invalid num_ranks = 12: must be a multiple of 8 above 8 ranks"),
            std::string::npos);
  EXPECT_NE(message_of([&] {
              config.get_rdma_buffer_size_hint(7168 * 2, 8, 3);
            }).find("invalid ranks_per_node = 3: must divide num_ranks (8)"),
            std::string::npos);
  EXPECT_NE(message_of([&] {
              config.get_rdma_buffer_size_hint(7168 * 2, 32, 16);
            }).find("invalid ranks_per_node = 16: must be <= 8 when the group spans nodes"),
            std::string::npos);
  EXPECT_NE(message_of([&] {
              config.get_rdma_buffer_size_hint(7168 * 2, 32, 1);
            }).find("invalid ranks_per_node = 1: must give at most 16 nodes"),
            std::string::npos);
  EXPECT_NE(message_of([&] {
              config.get_rdma_buffer_size_hint(7168 * 2 + 2, 16);
            }).find("invalid hidden_bytes = 14338: must be a multiple of 16"),
            std::string::npos);
  EXPECT_NE(message_of([&] {
              config.get_rdma_buffer_size_hint(7168 * 2, 16, -1);
            }).find("invalid ranks_per_node = -1: must be >= 0"),
            std::string::npos);
  Config bad = config;
  bad.num_max_rdma_chunked_send_tokens = 300;
  EXPECT_NE(message_of([&] { epx::validate_config(bad); })
                .find("invalid num_max_rdma_chunked_send_tokens = 300: must be <= "
                      "num_max_rdma_chunked_recv_tokens (256)"),
            std::string::npos);

  const InternodeLayout layout = InternodeLayout::of(2, config, InternodeRecord::largest(7168 * 2));
  EXPECT_EQ(message_of([&] { epx::check_internode_layout_fits(layout, layout.total_bytes()); }), "");
  EXPECT_NE(message_of([&] {
              epx::check_internode_layout_fits(layout, layout.total_bytes() - 1);
            }).find("invalid num_rdma_bytes = "),
            std::string::npos);
  EXPECT_NE(message_of([&] {
              epx::check_internode_layout_fits(layout, 0);
            }).find("size it with Config::get_rdma_buffer_size_hint"),
            std::string::npos);
}

}  // namespace
