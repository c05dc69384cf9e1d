#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <iterator>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "buffer_map/low_latency_buffer_map.hpp"
#include "epx/error.hpp"

namespace {

using epx::LowLatencyBufferMap;
using epx::LowLatencyOp;

struct Region {
  std::string name;
  size_t begin;
  size_t end;
};

std::vector<Region> regions_of(const LowLatencyBufferMap& map) {
  std::vector<Region> regions;
  regions.push_back({"normal-mode head", 0, epx::InternodeBufferMap::kHeadBytes});
  regions.push_back(
      {"barrier", map.barrier_signal_offset(0), map.barrier_signal_offset(0) + map.barrier_bytes()});
  for (int half = 0; half < 2; ++half) {
    regions.push_back({"signals[" + std::to_string(half) + "]", map.signals_offset(half),
                       map.signals_offset(half) + map.signals_bytes()});
  }
  regions.push_back(
      {"remote_shapes", map.remote_shapes_offset(), map.remote_shapes_offset() + map.remote_shapes_bytes()});
  regions.push_back(
      {"staged_shapes", map.staged_shapes_offset(), map.staged_shapes_offset() + map.staged_shapes_bytes()});
  regions.push_back(
      {"combine_send", map.combine_send_offset(), map.combine_send_offset() + map.combine_send_bytes()});
  regions.push_back({"combine_send_meta", map.combine_send_meta_offset(),
                     map.combine_send_meta_offset() + map.combine_send_meta_bytes()});
  for (int half = 0; half < 2; ++half) {
    const size_t base = map.half_offset(half);
    const std::string h = "[" + std::to_string(half) + "]";
    regions.push_back({"dispatch_recv_counts" + h, base + map.dispatch_recv_counts_rel(),
                       base + map.dispatch_recv_counts_rel() + map.dispatch_recv_counts_bytes()});
    regions.push_back({"dispatch_recv_index" + h, base + map.dispatch_recv_index_rel(),
                       base + map.dispatch_recv_index_rel() + map.dispatch_recv_index_bytes()});
    regions.push_back({"dispatch_send_index" + h, base + map.dispatch_send_index_rel(),
                       base + map.dispatch_send_index_rel() + map.dispatch_send_index_bytes()});
    regions.push_back({"dispatch_send_msgs" + h, base + map.dispatch_send_msgs_rel(),
                       base + map.dispatch_send_msgs_rel() + map.dispatch_send_msgs_bytes()});
    regions.push_back({"dispatch_recv_msgs" + h, base + map.dispatch_recv_msgs_rel(),
                       base + map.dispatch_recv_msgs_rel() + map.dispatch_recv_msgs_bytes()});
    const size_t listings = map.listings_offset(half);
    regions.push_back(
        {"dispatch_send_listings" + h, listings, listings + map.dispatch_send_listings_bytes()});
    regions.push_back({"dispatch_recv_listings" + h, listings + map.dispatch_send_listings_bytes(),
                       listings + map.listings_half_bytes()});
    regions.push_back({"combine_recv_slots" + h, base + map.combine_recv_slots_rel(),
                       base + map.combine_recv_slots_rel() + map.combine_recv_slots_bytes()});
  }
  return regions;
}

const Region& find_region(const std::vector<Region>& regions, const std::string& name) {
  for (const Region& region : regions)
    if (region.name == name) return region;
  throw std::runtime_error("no region " + name);
}

// [offset, offset + bytes) lies inside the named region.
void expect_inside(const std::vector<Region>& regions, const std::string& name, size_t offset, size_t bytes) {
  const Region& region = find_region(regions, name);
  EXPECT_GE(offset, region.begin) << name;
  EXPECT_LE(offset + bytes, region.end) << name;
}

// The shape fingerprint slots: one per (half, op, source) and one staged per (half, op), all distinct, each
// inside its region (so off every other region), and inside the control area a clean zeroes.
void check_shape_slots(const LowLatencyBufferMap& map, const std::vector<Region>& regions) {
  const size_t slot_bytes = epx::kLowLatencyShapeSlotBytes;
  std::set<size_t> slots;
  for (int half = 0; half < 2; ++half) {
    for (LowLatencyOp op : {LowLatencyOp::kDispatch, LowLatencyOp::kCombine}) {
      for (int r = 0; r < map.num_ranks; ++r) {
        const size_t slot = map.remote_shape_offset(half, op, r);
        slots.insert(slot);
        expect_inside(regions, "remote_shapes", slot, slot_bytes);
        EXPECT_EQ(slot % sizeof(int), 0u);
      }
      const size_t staged = map.staged_shape_offset(half, op);
      slots.insert(staged);
      expect_inside(regions, "staged_shapes", staged, slot_bytes);
      EXPECT_EQ(staged % sizeof(int), 0u);
    }
  }
  // All distinct, and no two overlap (a set iterates in ascending order).
  EXPECT_EQ(slots.size(), size_t(2 * epx::kNumLowLatencyOps * (map.num_ranks + 1)));
  for (auto next = std::next(slots.begin()); next != slots.end(); ++next)
    EXPECT_GE(*next - *std::prev(next), slot_bytes);
  EXPECT_GE(map.remote_shapes_offset(), map.signals_offset(0));
  EXPECT_LE(map.staged_shapes_offset() + map.staged_shapes_bytes(), map.control_end_offset());
}

void check_structure(const LowLatencyBufferMap& map) {
  SCOPED_TRACE("M=" + std::to_string(map.num_max_tokens) + " H=" + std::to_string(map.hidden) +
               " R=" + std::to_string(map.num_ranks) + " E=" + std::to_string(map.num_experts));
  std::vector<Region> regions = regions_of(map);
  for (const Region& region : regions) {
    EXPECT_EQ(region.begin % epx::kLowLatencyAlign, 0u) << region.name;
    EXPECT_LE(region.begin, region.end) << region.name;
    EXPECT_LE(region.end, map.total_bytes()) << region.name;
  }
  std::sort(regions.begin(), regions.end(),
            [](const Region& a, const Region& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < regions.size(); ++i)
    EXPECT_LE(regions[i - 1].end, regions[i].begin) << regions[i - 1].name << " overlaps " << regions[i].name;

  const int num_local = map.num_local_experts();
  const int last_rank = map.num_ranks - 1;
  const int last_token = map.num_max_tokens - 1;
  EXPECT_EQ(map.dispatch_msg_bytes() % 16, 0u);
  EXPECT_EQ(map.combine_slot_bytes() % 16, 0u);
  EXPECT_GE(map.combine_slot_bytes(), size_t(map.num_groups()) * epx::kLogfmtGroupSlotBytes);
  // A LogFMT slot: payloads, metadata words, fallback words.
  EXPECT_EQ(map.logfmt_meta_offset(), size_t(map.num_groups()) * 256);
  EXPECT_GE(map.combine_slot_bytes(), map.logfmt_meta_offset() + sizeof(uint32_t) * map.logfmt_meta_words());
  EXPECT_GE(map.combine_slot_bytes(), size_t(map.hidden) * 2);
  EXPECT_GE(map.dispatch_msg_bytes(), size_t(map.hidden) * 2);
  epx::for_each_scale_format([&](epx::ScaleFormat f) {
    EXPECT_GE(map.dispatch_msg_bytes(), epx::row_format(f).msg_bytes(map.hidden));
  });

  expect_inside(regions, "barrier", map.barrier_signal_offset(last_rank), sizeof(int));
  expect_inside(regions, "barrier", map.barrier_count_offset(), sizeof(int));
  EXPECT_NE(map.barrier_signal_offset(last_rank), map.barrier_count_offset());
  expect_inside(regions, "combine_send", map.combine_send_row_offset(0, 0), size_t(map.hidden) * 2);
  expect_inside(regions, "combine_send", map.combine_send_row_offset(num_local - 1, map.num_recv_rows() - 1),
                size_t(map.hidden) * 2);
  EXPECT_EQ(map.combine_send_row_offset(0, 1) % 16, 0u);
  expect_inside(regions, "combine_send_meta",
                map.combine_send_meta_row_offset(num_local - 1, map.num_recv_rows() - 1),
                sizeof(uint32_t) * map.logfmt_meta_words());
  // A staged LogFMT row's codes fill at most the BF16 row; its metadata lives in combine_send_meta.
  EXPECT_LE(size_t(map.num_groups()) * 2 * epx::kLogfmtGroupSize, size_t(map.hidden) * 2);

  std::set<size_t> signal_words;
  for (int half = 0; half < 2; ++half) {
    const std::string h = "[" + std::to_string(half) + "]";
    for (LowLatencyOp op : {LowLatencyOp::kDispatch, LowLatencyOp::kCombine}) {
      for (int r = 0; r < map.num_ranks; ++r) {
        signal_words.insert(map.recv_flag_offset(half, op, r));
        signal_words.insert(map.send_finish_offset(half, op, r));
        expect_inside(regions, "signals" + h, map.recv_flag_offset(half, op, r), sizeof(int));
        expect_inside(regions, "signals" + h, map.send_finish_offset(half, op, r), sizeof(int));
      }
      for (int r = 0; r < map.num_ranks; ++r) {
        signal_words.insert(map.source_decision_offset(half, op, r));
        expect_inside(regions, "signals" + h, map.source_decision_offset(half, op, r), sizeof(int));
      }
      signal_words.insert(map.num_uses_offset(half, op));
      signal_words.insert(map.recv_done_offset(half, op));
      expect_inside(regions, "signals" + h, map.num_uses_offset(half, op), sizeof(int));
      expect_inside(regions, "signals" + h, map.recv_done_offset(half, op), sizeof(int));
    }
    expect_inside(regions, "dispatch_recv_counts" + h, map.dispatch_recv_count_offset(half, 0, 0),
                  sizeof(uint64_t));
    expect_inside(regions, "dispatch_recv_counts" + h,
                  map.dispatch_recv_count_offset(half, num_local - 1, last_rank), sizeof(uint64_t));
    EXPECT_EQ(map.dispatch_recv_count_offset(half, 0, 0) % sizeof(uint64_t), 0u);  // one 8-byte store
    expect_inside(regions, "dispatch_recv_index" + h,
                  map.dispatch_recv_index_offset(half, num_local - 1, last_rank),
                  sizeof(int) * map.num_max_tokens);
    expect_inside(regions, "dispatch_send_index" + h,
                  map.dispatch_send_index_offset(half, map.num_experts - 1),
                  sizeof(int) * map.num_max_tokens);
    expect_inside(regions, "dispatch_send_msgs" + h, map.dispatch_send_msg_offset(half, last_token),
                  map.dispatch_msg_bytes());
    expect_inside(regions, "dispatch_recv_msgs" + h,
                  map.dispatch_recv_msg_offset(half, last_rank, last_token), map.dispatch_msg_bytes());
    expect_inside(regions, "dispatch_send_listings" + h, map.dispatch_send_listings_offset(half, last_token),
                  epx::kLowLatencyListingsBytes);
    expect_inside(regions, "dispatch_recv_listings" + h,
                  map.dispatch_recv_listings_offset(half, last_rank, last_token),
                  epx::kLowLatencyListingsBytes);
    expect_inside(regions, "combine_recv_slots" + h,
                  map.combine_recv_slot_offset(half, last_token, epx::kMaxTopk - 1),
                  map.combine_slot_bytes());
    EXPECT_EQ(map.dispatch_recv_msg_offset(half, last_rank, last_token) % 16, 0u);
    EXPECT_EQ(map.combine_recv_slot_offset(half, last_token, 3) % 16, 0u);
    EXPECT_EQ(map.dispatch_recv_index_offset(half, num_local - 1, last_rank) % 4, 0u);
  }
  // Every signal word is distinct across halves, ops and ranks.
  EXPECT_EQ(signal_words.size(), size_t(2 * epx::kNumLowLatencyOps * (3 * map.num_ranks + 2)));
  check_shape_slots(map, regions);
  // The two halves have the same shape, one half_bytes() apart.
  EXPECT_EQ(map.half_offset(1) - map.half_offset(0), map.half_bytes());
  EXPECT_EQ(map.listings_offset(0), map.half_offset(0) + 2 * map.half_bytes());
  EXPECT_EQ(map.total_bytes(), map.listings_offset(0) + 2 * map.listings_half_bytes());

  const size_t hint =
      epx::get_low_latency_rdma_size_hint(map.num_max_tokens, map.hidden, map.num_ranks, map.num_experts);
  EXPECT_EQ(hint % (size_t(2) << 20), 0u);
  EXPECT_GE(hint, map.total_bytes());
  EXPECT_LT(hint - map.total_bytes(), size_t(2) << 20);
}

TEST(LowLatencyBufferMap, DefaultShapeSizesArePinned) {
  // The decode benchmark shape: 128 tokens per rank, hidden 7168, 4 ranks, 288 experts.
  const LowLatencyBufferMap map(128, 7168, 4, 288);
  EXPECT_EQ(map.num_local_experts(), 72);
  EXPECT_EQ(map.num_groups(), 56);
  EXPECT_EQ(map.num_recv_rows(), 512);
  EXPECT_EQ(map.dispatch_msg_bytes(), 14336u);  // BF16 row; the FP8 row + scales (7392) is smaller
  EXPECT_EQ(map.combine_slot_bytes(),
            14576u);  // 56 LogFMT worst-case groups of 260 bytes, 2 fallback words
  EXPECT_EQ(map.barrier_bytes(), 128u);
  // Pinned from kQueuesOffset: the normal-mode head before it is InternodeBufferMap's to size.
  const size_t queues = epx::InternodeBufferMap::kQueuesOffset;
  EXPECT_EQ(map.remote_shapes_bytes(), 1024u);          // [2][2][4] slots of 64 bytes
  EXPECT_EQ(map.staged_shapes_bytes(), 256u);           // [2][2] slots
  EXPECT_EQ(map.control_end_offset() - queues, 1536u);  // 2 x signals, then the shape slots
  EXPECT_EQ(map.combine_send_bytes(), 528482304u);      // [72][512][7168] BF16
  EXPECT_EQ(map.signals_bytes(), 128u);
  EXPECT_EQ(map.dispatch_recv_counts_bytes(), 2304u);   // [72][4] tagged 8-byte words
  EXPECT_EQ(map.dispatch_recv_index_bytes(), 294912u);  // [72][4][128] tagged 8-byte entries
  EXPECT_EQ(map.dispatch_send_msgs_bytes(), 1835008u);
  EXPECT_EQ(map.dispatch_send_listings_bytes(), 16384u);  // [128] of 128 bytes
  EXPECT_EQ(map.dispatch_recv_listings_bytes(), 65536u);  // [4][128]
  EXPECT_EQ(map.dispatch_recv_msgs_bytes(), 7340032u);
  EXPECT_EQ(map.combine_recv_slots_bytes(), 29851648u);
  EXPECT_EQ(map.dispatch_send_index_bytes(), 294912u);
  EXPECT_EQ(map.combine_send_meta_bytes(), 8552448u);  // [72][512][56 + 2] words
  EXPECT_EQ(map.half_bytes(), 39618816u);
  EXPECT_EQ(map.listings_half_bytes(), 81920u);
  EXPECT_EQ(map.total_bytes() - queues, 616437760u);
  EXPECT_EQ(epx::get_low_latency_rdma_size_hint(128, 7168, 4, 288), 618659840u);  // 295 x 2 MiB
  check_structure(map);
}

TEST(LowLatencyBufferMap, SmallestShape) {
  const LowLatencyBufferMap map(1, 128, 1, 1);
  EXPECT_EQ(map.dispatch_msg_bytes(), 256u);
  EXPECT_EQ(map.combine_slot_bytes(), 272u);  // 260 rounded up to 16
  EXPECT_EQ(map.half_bytes(), 5248u);
  EXPECT_EQ(map.total_bytes() - epx::InternodeBufferMap::kQueuesOffset, 12160u);
  EXPECT_EQ(epx::get_low_latency_rdma_size_hint(1, 128, 1, 1), size_t(2) << 20);
  check_structure(map);
}

TEST(LowLatencyBufferMap, OddShapes) {
  {
    const LowLatencyBufferMap map(3, 2688, 3, 9);  // 21 groups, 3 tokens, 3 ranks
    EXPECT_EQ(map.dispatch_msg_bytes(), 5376u);
    EXPECT_EQ(map.combine_slot_bytes(), 5472u);
    EXPECT_EQ(map.half_bytes(), 327808u);
    EXPECT_EQ(map.total_bytes() - epx::InternodeBufferMap::kQueuesOffset, 807552u);
    check_structure(map);
  }
  {
    const LowLatencyBufferMap map(256, 4096, 8, 256);
    EXPECT_EQ(map.total_bytes() - epx::InternodeBufferMap::kQueuesOffset, 654252800u);
    EXPECT_EQ(epx::get_low_latency_rdma_size_hint(256, 4096, 8, 256), 656408576u);
    check_structure(map);
  }
  for (int hidden : {128, 2048, 2688, 8192})
    for (int ranks : {1, 2, 5, 64}) check_structure(LowLatencyBufferMap(7, hidden, ranks, ranks * 3));
}

TEST(LowLatencyBufferMap, SignalsDoNotMoveWithTheShape) {
  // Operations of different M / hidden / E on one buffer must agree on the monotonic signal words and the
  // shape fingerprint slots.
  const LowLatencyBufferMap a(128, 7168, 4, 288);
  const LowLatencyBufferMap b(3, 2688, 4, 8);
  for (int half = 0; half < 2; ++half) {
    for (LowLatencyOp op : {LowLatencyOp::kDispatch, LowLatencyOp::kCombine}) {
      for (int r = 0; r < 4; ++r) {
        EXPECT_EQ(a.recv_flag_offset(half, op, r), b.recv_flag_offset(half, op, r));
        EXPECT_EQ(a.send_finish_offset(half, op, r), b.send_finish_offset(half, op, r));
      }
      EXPECT_EQ(a.num_uses_offset(half, op), b.num_uses_offset(half, op));
      EXPECT_EQ(a.recv_done_offset(half, op), b.recv_done_offset(half, op));
      // A source of another shape puts its fingerprint where the receiver looks for it.
      for (int r = 0; r < 4; ++r)
        EXPECT_EQ(a.remote_shape_offset(half, op, r), b.remote_shape_offset(half, op, r));
      EXPECT_EQ(a.staged_shape_offset(half, op), b.staged_shape_offset(half, op));
    }
  }
  EXPECT_EQ(a.barrier_count_offset(), b.barrier_count_offset());
  EXPECT_EQ(a.control_end_offset(), b.control_end_offset());
}

// One symmetric buffer serves low-latency mode and normal mode across nodes: low-latency calls never write
// normal mode's head, normal mode's queues start after the clean barrier of the largest group, and the
// barrier and signals keep their offsets for any shape.
TEST(LowLatencyBufferMap, SharesTheSymmetricBufferWithNormalMode) {
  for (int ranks : {1, 2, 16, epx::kMaxLowLatencyRanks}) {
    const LowLatencyBufferMap map(7, 256, ranks, 2 * ranks);
    EXPECT_EQ(map.barrier_signal_offset(0), epx::InternodeBufferMap::kHeadBytes) << ranks;
    EXPECT_LE(map.barrier_count_offset() + sizeof(int), epx::InternodeBufferMap::kQueuesOffset) << ranks;
    EXPECT_EQ(map.signals_offset(0), epx::InternodeBufferMap::kQueuesOffset) << ranks;
    check_structure(map);
  }
}

void expect_rejected(int m, int hidden, int ranks, int experts, const std::string& argument) {
  try {
    const LowLatencyBufferMap map(m, hidden, ranks, experts);
    FAIL() << "expected epx::Error for " << argument;
  } catch (const epx::Error& error) {
    EXPECT_NE(error.message().find("invalid " + argument), std::string::npos) << error.message();
  }
  EXPECT_THROW(epx::get_low_latency_rdma_size_hint(m, hidden, ranks, experts), epx::Error);
}

TEST(LowLatencyBufferMap, RejectsBadShapes) {
  expect_rejected(0, 7168, 4, 288, "num_max_dispatch_tokens_per_rank");
  expect_rejected(-5, 7168, 4, 288, "num_max_dispatch_tokens_per_rank");
  expect_rejected(epx::kMaxLowLatencyTokensPerRank + 1, 7168, 4, 288, "num_max_dispatch_tokens_per_rank");
  expect_rejected(128, 7000, 4, 288, "hidden");
  expect_rejected(128, 64, 4, 288, "hidden");
  expect_rejected(128, 0, 4, 288, "hidden");
  expect_rejected(128, 7168, 0, 288, "num_ranks");
  expect_rejected(128, 7168, 65, 65 * 4, "num_ranks");
  expect_rejected(128, 7168, 4, 0, "num_experts");
  expect_rejected(128, 7168, 4, 290, "num_experts");
  expect_rejected(128, 7168, 4, 4100, "num_experts");
  EXPECT_NO_THROW(LowLatencyBufferMap(epx::kMaxLowLatencyTokensPerRank, 128, 64, 64));
}

// A token's combine slots lie combine_slot_bytes() apart from its first one, in both halves: the combine
// kernels' reductions step through them that way (TokenSlots) instead of asking the map for each.
TEST(LowLatencyBufferMap, TokenSlotsAreOneStrideApart) {
  for (const LowLatencyBufferMap& map :
       {LowLatencyBufferMap(128, 7168, 2, 288), LowLatencyBufferMap(3, 2688, 3, 9),
        LowLatencyBufferMap(1, 128, 1, 1)}) {
    for (int half = 0; half < 2; ++half) {
      for (int token : {0, 1, map.num_max_tokens - 1}) {
        const size_t first = map.combine_recv_slot_offset(half, token, 0);
        for (int pos = 0; pos < epx::kMaxTopk; ++pos)
          EXPECT_EQ(map.combine_recv_slot_offset(half, token, pos),
                    first + size_t(pos) * map.combine_slot_bytes());
      }
    }
  }
}

// The index-list entry round-trips every (token, top-k position) the map allows, at both extremes.
TEST(LowLatencyBufferMap, IndexEntryKeepsTokenAndTopkPosition) {
  for (int token : {0, 1, 4095, epx::kMaxLowLatencyTokensPerRank - 1}) {
    for (int topk_pos = 0; topk_pos < epx::kMaxTopk; ++topk_pos) {
      const int entry = epx::pack_recv_index_entry(token, topk_pos);
      EXPECT_GE(entry, 0) << "token " << token << " top-k position " << topk_pos;
      EXPECT_EQ(epx::recv_index_entry_token(entry), token);
      EXPECT_EQ(epx::recv_index_entry_topk_pos(entry), topk_pos);
    }
  }
}

// A count word or list entry keeps its value and its call's tag apart at the extremes; a word of another
// clean count or use number, or a zeroed word, does not pass for the call's.
TEST(LowLatencyBufferMap, DispatchWordKeepsValueAndTag) {
  const int largest_entry =
      epx::pack_recv_index_entry(epx::kMaxLowLatencyTokensPerRank - 1, epx::kMaxTopk - 1);
  for (int value : {0, 1, 4096, epx::kMaxLowLatencyTokensPerRank, largest_entry}) {
    for (int uses : {1, 2, 0x7ffffffe, -1}) {
      for (int cleans : {0, 1, 255, 256, 1000}) {
        const uint64_t tag = epx::low_latency_call_tag(uses, cleans);
        const uint64_t word = epx::pack_low_latency_word(tag, value);
        EXPECT_EQ(epx::low_latency_word_value(word), value);
        EXPECT_EQ(epx::low_latency_word_tag(word), tag);
        EXPECT_NE(epx::low_latency_word_tag(word), epx::low_latency_call_tag(uses, cleans + 1));
        EXPECT_NE(epx::low_latency_word_tag(word), epx::low_latency_call_tag(uses + 1, cleans));
      }
    }
  }
  EXPECT_NE(epx::low_latency_word_tag(0), epx::low_latency_call_tag(1, 0));
}

}  // namespace
