#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "buffer_map/internode_buffer_map.hpp"
#include "buffer_map/normal_buffer_map.hpp"
#include "epx/error.hpp"

namespace {

using epx::Config;
using epx::NormalBufferMap;
using epx::NormalRecord;
using epx::NormalShape;

NormalShape bf16_shape(int ranks = 4, int hidden = 7168, int topk = 8) {
  return NormalShape{ranks, 256, hidden, hidden * 2, 0, topk};
}

TEST(NormalBufferMap, ChannelRangesCoverTheBatchInOrder) {
  for (int tokens : {0, 1, 31, 4095, 4097, 65536}) {
    for (int channels : {1, 3, 10, 12, 24, 64}) {
      int next = 0;
      for (int c = 0; c < channels; ++c) {
        const epx::TokenRange range = epx::channel_token_range(tokens, channels, c);
        EXPECT_EQ(range.begin, next) << tokens << " tokens, channel " << c << " of " << channels;
        EXPECT_LE(range.begin, range.end);
        EXPECT_LE(range.end - range.begin, epx::tokens_per_channel(tokens, channels));
        next = range.end;
      }
      EXPECT_EQ(next, tokens);
    }
  }
}

TEST(NormalBufferMap, RecordFieldsAreContiguousAndAligned) {
  const NormalRecord bf16 = NormalRecord::dispatch(bf16_shape());
  EXPECT_EQ(bf16.scales_offset(), 14336u);
  EXPECT_EQ(bf16.topk_idx_offset(), 14336u);
  EXPECT_EQ(bf16.topk_weights_offset(), 14336u + 32);
  EXPECT_EQ(bf16.src_idx_offset(), 14336u + 64);
  EXPECT_EQ(bf16.bytes(), 14416u);  // 14336 + 68, padded to 16
  const NormalRecord fp8 = NormalRecord::dispatch(NormalShape{4, 256, 7168, 7168, 56, 8});
  EXPECT_EQ(fp8.topk_idx_offset(), 7168u + 56 * 4);
  EXPECT_EQ(fp8.bytes() % 16, 0u);
  const NormalRecord combine = NormalRecord::combine(7168, 8);
  EXPECT_EQ(combine.topk_weights_offset(), 14336u);
  EXPECT_EQ(combine.bytes(), 14336u + 32);
  EXPECT_EQ(NormalRecord::combine(7168, 0).bytes(), 14336u);
  // The largest record bounds every call's record for that row size.
  const NormalRecord largest = NormalRecord::largest(7168 * 2);
  for (int topk : {0, 1, 8, epx::kMaxTopk}) {
    EXPECT_LE(NormalRecord::dispatch(bf16_shape(8, 7168, topk)).bytes(), largest.bytes());
    EXPECT_LE(NormalRecord::dispatch(NormalShape{8, 256, 7168, 7168, 56, topk}).bytes(), largest.bytes());
    EXPECT_LE(NormalRecord::combine(7168, topk).bytes(), largest.bytes());
  }
}

TEST(NormalBufferMap, QueuesAreDisjointAndInsideTheBuffer) {
  Config config;
  config.num_sms = 6;  // 3 channels
  config.num_max_nvl_chunked_recv_tokens = 5;
  const int ranks = 4;
  const NormalBufferMap map =
      NormalBufferMap::of(ranks, config, NormalRecord::dispatch(bf16_shape(ranks, 256, 4)));
  EXPECT_EQ(map.num_channels, 3);
  EXPECT_EQ(map.total_bytes(), NormalBufferMap::kQueuesOffset + size_t(ranks - 1) * 3 * 5 * map.record_bytes);
  std::vector<char> owner_buffer(map.total_bytes());
  for (int owner = 0; owner < ranks; ++owner) {
    std::set<size_t> offsets;
    for (int src = 0; src < ranks; ++src) {
      if (src == owner) continue;
      for (int c = 0; c < map.num_channels; ++c) {
        for (uint32_t entry = 0; entry < 5; ++entry) {
          const size_t offset = map.record(owner_buffer.data(), src, owner, c, entry) - owner_buffer.data();
          EXPECT_GE(offset, NormalBufferMap::kQueuesOffset);
          EXPECT_LE(offset + map.record_bytes, map.total_bytes());
          EXPECT_EQ(offset % 16, 0u);
          EXPECT_TRUE(offsets.insert(offset).second) << "record used twice";
          // Entry e and e + Q share a slot.
          EXPECT_EQ(map.record(owner_buffer.data(), src, owner, c, entry + 5),
                    map.record(owner_buffer.data(), src, owner, c, entry));
        }
      }
    }
    EXPECT_EQ(offsets.size(), size_t(ranks - 1) * 3 * 5);
  }
  // The fixed areas: control is 32 ints and the launch fingerprints, the counters (tail, head, sent,
  // consumed and a combine's second reducer's head and consumed) cover every (rank, channel).
  EXPECT_EQ(sizeof(NormalBufferMap::Control), 128u + 8u * epx::kMaxNvlRanks);
  EXPECT_EQ(NormalBufferMap::kCountersOffset, 256u);
  EXPECT_EQ(sizeof(NormalBufferMap::QueueCounters), 6u * epx::kMaxNvlRanks * epx::kMaxChannels * 4);
}

// The protocol of one queue, played on the CPU with counters that wrap: a sender writes whatever room a
// chunk allows, a receiver takes what landed, both starting from their own running counts. Every record
// arrives once, in order, and no record is overwritten before it was read.
TEST(NormalBufferMap, QueueProtocolDeliversInOrderAcrossCounterWrap) {
  std::mt19937 rng(7);
  for (int queue_tokens : {1, 2, 3, 7, 256}) {
    for (int chunk : {1, 2, 6, queue_tokens}) {
      if (chunk > queue_tokens) continue;
      uint32_t tail = 0xFFFFFFF0u, head = tail;  // close to the wrap, as after a long run
      uint32_t sender_count = tail, receiver_count = head;
      for (int call = 0; call < 3; ++call) {
        const int records = static_cast<int>(rng() % 40);
        std::vector<int> slots(queue_tokens, -1);  // which record each slot holds
        int pushed = 0, got = 0;
        const uint32_t send_base = sender_count, recv_base = receiver_count;
        ASSERT_EQ(send_base, recv_base);
        while (got < records) {
          if (pushed < records && rng() % 2 == 0) {
            const int room = epx::queue_room(pushed, epx::count_since(head, send_base), queue_tokens);
            ASSERT_GE(room, 0);
            const int n = std::min({room, chunk, records - pushed});
            for (int j = 0; j < n; ++j) {
              int& slot = slots[epx::queue_slot(uint32_t(pushed + j), queue_tokens)];
              ASSERT_EQ(slot, -1) << "overwrote an unread record";
              slot = pushed + j;
            }
            pushed += n;
            tail = send_base + uint32_t(pushed);
          } else {
            const int landed = epx::count_since(tail, recv_base) - got;
            const int n = landed == 0 ? 0 : 1 + static_cast<int>(rng() % landed);
            for (int j = 0; j < n; ++j) {
              int& slot = slots[epx::queue_slot(uint32_t(got + j), queue_tokens)];
              ASSERT_EQ(slot, got + j) << "record out of order";
              slot = -1;
            }
            got += n;
            head = recv_base + uint32_t(got);
          }
        }
        sender_count = send_base + uint32_t(pushed);
        receiver_count = recv_base + uint32_t(got);
      }
    }
  }
}

// Pinned hints of the default config (10 channels of 256 tokens), as docs/ARCHITECTURE.md lists them.
TEST(NormalBufferMap, SizeHintDependsOnTheConfigNotOnTokens) {
  const Config config;
  EXPECT_EQ(config.get_nvl_buffer_size_hint(7168 * 2, 2),
            epx::normal_nvl_buffer_size_hint(7168 * 2, 2, config));
  for (int ranks : {1, 2, 4, 8}) {
    for (size_t hidden : {4096u, 7168u}) {
      const size_t hint = config.get_nvl_buffer_size_hint(hidden * 2, ranks);
      const NormalBufferMap map = NormalBufferMap::of(ranks, config, NormalRecord::largest(hidden * 2));
      EXPECT_EQ(hint, epx::align_up(map.total_bytes(), epx::kNormalAlign));
      EXPECT_EQ(hint,
                NormalBufferMap::kQueuesOffset +
                    size_t(ranks - 1) * 10 * 256 * epx::align_up(hidden * 2 + 2 * 4 * epx::kMaxTopk + 4, 16));
    }
  }
  Config wide = config;
  wide.num_sms = 48;
  EXPECT_GT(wide.get_nvl_buffer_size_hint(7168 * 2, 4), config.get_nvl_buffer_size_hint(7168 * 2, 4));
  Config deep = config;
  deep.num_max_nvl_chunked_recv_tokens = 512;
  EXPECT_GT(deep.get_nvl_buffer_size_hint(7168 * 2, 4), config.get_nvl_buffer_size_hint(7168 * 2, 4));
  EXPECT_THROW(epx::normal_nvl_buffer_size_hint(7168 * 2 + 2, 4), epx::Error);
  EXPECT_THROW(epx::normal_nvl_buffer_size_hint(7168 * 2, 65), epx::Error);
  // Across nodes the NVLink buffer holds the forwarding queues: (L - 1) N C (Q / N) records for the largest
  // node split, here nodes of 8.
  const epx::ForwardBufferMap forward =
      epx::ForwardBufferMap::of(8, 2, config, epx::InternodeRecord::largest(7168 * 2));
  EXPECT_EQ(config.get_nvl_buffer_size_hint(7168 * 2, 16), epx::align_up(forward.total_bytes(), 128));
  EXPECT_EQ(forward.total_bytes(),
            epx::ForwardBufferMap::kQueuesOffset + size_t(7) * 2 * 10 * 128 * forward.record_bytes);
  EXPECT_EQ(config.get_rdma_buffer_size_hint(7168 * 2, 8), 0u);
  EXPECT_GT(config.get_rdma_buffer_size_hint(7168 * 2, 16),
            0u);  // two nodes of 8: test_internode_buffer_map.cpp
}

std::string message_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const epx::Error& error) {
    return error.what();
  }
  return "";
}

TEST(NormalBufferMap, ConfigChecksNameTheField) {
  Config config;
  EXPECT_EQ(message_of([&] { epx::validate_config(config); }), "");
  config.num_max_nvl_chunked_send_tokens = 300;
  EXPECT_NE(message_of([&] { epx::validate_config(config); }).find("num_max_nvl_chunked_send_tokens = 300"),
            std::string::npos);
  config = Config{};
  config.num_max_nvl_chunked_recv_tokens = 0;
  EXPECT_NE(message_of([&] { epx::validate_config(config); }).find("num_max_nvl_chunked_recv_tokens = 0"),
            std::string::npos);
  config = Config{};
  config.num_sms = 0;
  EXPECT_NE(message_of([&] { epx::validate_config(config); }).find("num_sms = 0"), std::string::npos);
  config.num_sms = 1;  // one channel still
  EXPECT_EQ(config.num_channels(), 1);
}

TEST(NormalBufferMap, TooSmallBufferNamesTheBytesNeeded) {
  const NormalBufferMap map = NormalBufferMap::of(2, Config{}, NormalRecord::dispatch(bf16_shape(2)));
  EXPECT_EQ(message_of([&] { epx::check_normal_map_fits(map, map.total_bytes()); }), "");
  const std::string message = message_of([&] { epx::check_normal_map_fits(map, 1000); });
  EXPECT_NE(message.find("num_nvl_bytes = 1000"), std::string::npos) << message;
  EXPECT_NE(message.find(std::to_string(map.total_bytes())), std::string::npos) << message;
}

TEST(NormalBufferMap, ShapeChecksNameTheArgument) {
  const auto shape_message = [](const NormalShape& shape) {
    return message_of([&] { epx::validate_normal_shape(shape); });
  };
  EXPECT_NE(shape_message(NormalShape{65, 260, 7168, 14336, 0, 8}).find("num_ranks = 65"), std::string::npos);
  EXPECT_NE(shape_message(NormalShape{4, 250, 7168, 14336, 0, 8}).find("num_experts = 250"),
            std::string::npos);
  EXPECT_NE(shape_message(NormalShape{4, 256, 7164, 14328, 0, 8}).find("hidden = 7164"), std::string::npos);
  EXPECT_NE(shape_message(NormalShape{4, 256, 7168, 14336, 0, 17}).find("num_topk = 17"), std::string::npos);
  EXPECT_EQ(shape_message(bf16_shape()), "");
}

}  // namespace

// The C++ benchmark runs what deep_ep callers get: the recommended chunk sizes for the group size (the same
// table as epx.compat.deep_ep: DeepEP's, EPX's measured ones at 2 ranks), Config's defaults where it has
// none; the SM budget is the caller's.
TEST(RecommendedConfig, DeepEpTableByGroupSizeElseDefaults) {
  const Config dispatch2 = epx::recommended_config(epx::ConfigFor::kDispatch, 2, 16);
  EXPECT_EQ(dispatch2.num_sms, 16);
  EXPECT_EQ(dispatch2.num_max_nvl_chunked_send_tokens, 48);
  EXPECT_EQ(epx::recommended_config(epx::ConfigFor::kCombine, 2, 16).num_max_nvl_chunked_send_tokens, 16);
  EXPECT_EQ(dispatch2.num_max_nvl_chunked_recv_tokens, 256);
  EXPECT_EQ(dispatch2.num_max_rdma_chunked_recv_tokens, 128);
  const Config combine8 = epx::recommended_config(epx::ConfigFor::kCombine, 8, 24);
  EXPECT_EQ(combine8.num_max_nvl_chunked_send_tokens, 4);
  const Config none = epx::recommended_config(epx::ConfigFor::kCombine, 3, 8);
  EXPECT_EQ(none.num_sms, 8);
  EXPECT_EQ(none.num_max_nvl_chunked_send_tokens, Config{}.num_max_nvl_chunked_send_tokens);
  for (int num_ranks : {1, 2, 4, 8, 16, 24, 32, 64, 128, 144, 160}) {
    for (auto op : {epx::ConfigFor::kDispatch, epx::ConfigFor::kCombine})
      EXPECT_NO_THROW(epx::validate_config(epx::recommended_config(op, num_ranks, 24))) << num_ranks;
  }
}

// The GPU kind comes from the device name; on H200 the 2-rank chunks follow the SM budget (measured there),
// every other (kind, group) keeps the table's chunks, and the queues never change.
TEST(RecommendedConfig, GpuKindByNameAndH200ChunksBySmBudget) {
  using epx::GpuKind;
  EXPECT_EQ(epx::gpu_kind_of("NVIDIA H200"), GpuKind::kH200);
  EXPECT_EQ(epx::gpu_kind_of("NVIDIA H100 80GB HBM3"), GpuKind::kH100);
  EXPECT_EQ(epx::gpu_kind_of("NVIDIA A100-SXM4-80GB"), GpuKind::kOther);
  EXPECT_EQ(epx::gpu_kind_of(""), GpuKind::kOther);
  EXPECT_STREQ(epx::gpu_kind_name(GpuKind::kH200), "H200");
  EXPECT_STREQ(epx::gpu_kind_name(GpuKind::kH100), "H100");
  EXPECT_STREQ(epx::gpu_kind_name(GpuKind::kOther), "other");
  const auto combine_chunk = [](int num_ranks, int num_sms, GpuKind kind) {
    return epx::recommended_config(epx::ConfigFor::kCombine, num_ranks, num_sms, kind)
        .num_max_nvl_chunked_send_tokens;
  };
  for (auto [num_sms, chunk] :
       {std::pair{8, 32}, {16, 32}, {20, 32}, {23, 32}, {24, 16}, {27, 16}, {28, 8}, {32, 8}, {64, 8}})
    EXPECT_EQ(combine_chunk(2, num_sms, GpuKind::kH200), chunk) << num_sms;
  for (int num_sms : {8, 24, 32}) {
    EXPECT_EQ(combine_chunk(2, num_sms, GpuKind::kH100), 16) << num_sms;
    EXPECT_EQ(combine_chunk(2, num_sms, GpuKind::kOther), 16) << num_sms;
    EXPECT_EQ(combine_chunk(8, num_sms, GpuKind::kH200), 4) << num_sms;
    for (GpuKind kind : {GpuKind::kOther, GpuKind::kH100, GpuKind::kH200}) {
      const Config dispatch = epx::recommended_config(epx::ConfigFor::kDispatch, 2, num_sms, kind);
      EXPECT_EQ(dispatch.num_max_nvl_chunked_send_tokens, kind == GpuKind::kH200 && num_sms >= 32 ? 32 : 48);
      const Config combine = epx::recommended_config(epx::ConfigFor::kCombine, 2, num_sms, kind);
      EXPECT_EQ(combine.num_max_nvl_chunked_recv_tokens, 256);
      EXPECT_EQ(combine.num_sms, num_sms);
      EXPECT_NO_THROW(epx::validate_config(combine));
    }
  }
}
