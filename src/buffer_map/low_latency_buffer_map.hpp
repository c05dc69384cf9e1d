#pragma once

#include <cstddef>
#include <cstdint>

#include "buffer_map/internode_buffer_map.hpp"
#include "buffer_map/normal_buffer_map.hpp"
#include "common/host_device.hpp"
#include "common/small_divisor.hpp"
#include "epx/error.hpp"
#include "formats/fp8.hpp"
#include "formats/logfmt.hpp"
#include "formats/scale_format.hpp"

namespace epx {

constexpr int kMaxLowLatencyRanks = 64;               // the Buffer's limit
constexpr int kMaxLowLatencyTokensPerRank = 1 << 16;  // keeps R*M rows and packed index entries in int
constexpr size_t kLowLatencyAlign = 128;              // every region starts on a cache line
constexpr size_t kLowLatencySizeHintAlign = size_t(2) << 20;  // size hints are whole 2 MiB pages
// One shape fingerprint slot: room for a ShapeFingerprint (checked where kernels use it) and more fields.
constexpr size_t kLowLatencyShapeSlotBytes = 64;
// FP8 scales and LogFMT metadata both cover groups of this many channels, so one group count serves both.
constexpr int kLowLatencyGroupSize = kFp8GroupSize;
static_assert(kLogfmtGroupSize == kLowLatencyGroupSize, "FP8 and LogFMT groups must coincide");
// The dispatch kernel casts a group with 8 lanes of 16 channels each.
constexpr bool every_scale_group_is(int group_size) {
  bool same = true;
  for_each_scale_format([&](ScaleFormat f) {
    same = same && (row_format(f).group_size == 0 || row_format(f).group_size == group_size);
  });
  return same;
}
static_assert(every_scale_group_is(kLowLatencyGroupSize),
              "a format's scale groups must be the cast's groups");
constexpr size_t kLargestMsgBytesPerGroup = largest_msg_bytes(kLowLatencyGroupSize);

// An entry of the dispatch index lists: the source token index above kRecvIndexTopkBits bits of its top-k
// position, so one int names both the message slot and the combine slot the expert output returns to.
constexpr int kRecvIndexTopkBits = 4;
static_assert(kMaxTopk <= (1 << kRecvIndexTopkBits), "every top-k position must fit the entry's low bits");
static_assert(kMaxLowLatencyTokensPerRank <= (INT32_MAX >> kRecvIndexTopkBits), "token indices must fit");
EPX_HD constexpr int pack_recv_index_entry(int token, int topk_pos) {
  return (token << kRecvIndexTopkBits) | topk_pos;
}
EPX_HD constexpr int recv_index_entry_token(int entry) {
  return entry >> kRecvIndexTopkBits;
}
EPX_HD constexpr int recv_index_entry_topk_pos(int entry) {
  return entry & ((1 << kRecvIndexTopkBits) - 1);
}

// The low-latency dispatch's count words and list entries: one 8-byte word each, stored and read whole, its
// value (a count, or a pack_recv_index_entry) in the low 24 bits and the call's tag above: the half's use
// number + 1 (32 bits) and the number of cleans so far (Buffer-wide, the same on every rank) modulo 256. A
// reader that sees its call's tag holds the value, with no flag. The use numbers restart at each clean, which
// zeroes only the words of its own shape: the clean count keeps a word an earlier shape left from passing for
// a later call's. Zeroed words (a fresh or reset buffer) carry no call's tag (use numbers + 1 are never 0).
constexpr int kLowLatencyWordValueBits = 24;
static_assert(kMaxLowLatencyTokensPerRank < (1 << kLowLatencyWordValueBits),
              "counts must fit a word's value");
static_assert((kMaxLowLatencyTokensPerRank << kRecvIndexTopkBits) <= (1 << kLowLatencyWordValueBits),
              "index entries must fit a word's value");
EPX_HD constexpr uint64_t low_latency_call_tag(int uses_plus_one, int num_cleans) {
  return (uint64_t(uint8_t(num_cleans)) << 32) | uint32_t(uses_plus_one);
}
EPX_HD constexpr uint64_t pack_low_latency_word(uint64_t tag, int value) {
  return (tag << kLowLatencyWordValueBits) | (uint32_t(value) & ((1u << kLowLatencyWordValueBits) - 1u));
}
EPX_HD constexpr uint64_t low_latency_word_tag(uint64_t word) {
  return word >> kLowLatencyWordValueBits;
}
EPX_HD constexpr int low_latency_word_value(uint64_t word) {
  return int(word & ((uint64_t(1) << kLowLatencyWordValueBits) - 1u));
}

// One dispatched token's listings (sent beside its message when the dispatch has top-k weights): the token's
// whole top-k, kMaxTopk int32 expert ids (-1 for none) then kMaxTopk float weights, so that a receiver finds
// every listing of the token on its own rank (the pre-reduced combine's table).
constexpr size_t kLowLatencyListingsBytes = 2 * sizeof(int32_t) * kMaxTopk;
constexpr int kListingWeightsWord = kMaxTopk;  // the 32-bit word of the listings where the weights start

// The two operations that talk through the low-latency buffer; each has its own signals in each half.
enum class LowLatencyOp : int { kDispatch = 0, kCombine = 1 };
constexpr int kNumLowLatencyOps = 2;

// Map of one rank's low-latency (decode) buffer: the host sizes the allocation with it, kernels address
// the local buffer and the peers' mappings with it (all ranks use the same shape, so offsets agree).
//
// NOTES: dispatch is deduplicated per destination RANK, not per expert: a token travels once to every rank
// holding at least one of its experts, into the slot named by its source token index, and the sender also
// writes, per (local expert, source), the ordered list of its tokens that chose the expert. The receiver
// expands rows into the packed per-expert output. That moves ~3.6 instead of 8 copies of a token for top-8 of
// 288 experts on 4 ranks, and the receive area is [R][M] messages instead of [E][M].
//
// NOTES: completion is signalled per (half, op, source rank) by one int written with release semantics after
// all of that source's data. Signals are monotonic (the number of operations of that kind the source has
// sent into this half), never cleaned: a receiver waits for "its own completed count + 1", so no cleaning
// launch or cleaning race exists and a stale signal can never pass. clean_low_latency_buffer() resets them
// collectively.
//
// NOTES: one Buffer serves low-latency mode and normal mode across nodes with one symmetric buffer. Normal
// mode's fixed area (InternodeBufferMap::Head, its monotonic counters) comes first and low-latency calls
// never touch it; the clean barrier (monotonic too) follows and normal mode never touches it; the rest holds
// either mode's queues and messages. So a low-latency call after normal-mode calls across nodes needs
// clean_low_latency_buffer() first (the host refuses it otherwise), and the clean's barrier also orders it
// after every rank's normal-mode calls. Normal mode needs nothing after low-latency calls: its queues are
// written before they are read, and its count exchange waits for every peer to reach it.
//
// NOTES: shapes are checked across nodes too. A source on another node stores its shape fingerprint
// (core/shape_fingerprint.hpp) into remote_shapes[half][op][source] of the receiver before the flag that
// publishes the operation where it maps the receiver, else puts it there from its own
// staged_shapes[half][op] (a put reads this rank's symmetric buffer).
// Sources on this rank's NVLink node post theirs into the abort words instead (AbortWordsMap). A clean zeroes
// the fingerprints with the signals (both lie in [signals_offset(0), control_end_offset())): a zero hash
// never matches, and no flag releases them until a source posts again.
//
//   normal-mode head                 InternodeBufferMap::kHeadBytes, untouched here
//   barrier                          clean-barrier signals (InternodeBufferMap::kLowLatencyBarrierBytes)
//   control (offsets depend on R only):
//     signals[2]                     per half h: recv_flag[op][R], send_finish[op][R], num_uses[op],
//                                    recv_done[op], source_decision[op][R]
//     remote_shapes[2][op][R]        fingerprints that sources on other nodes put here
//     staged_shapes[2][op]           this rank's fingerprints, read by its puts
//   combine_send[L][R*M][hidden]     BF16 rows combine sends from (zero-copy input, staging for RDMA)
//   combine_send_meta[L][R*M][G+W]   LogFMT group metadata and fallback bits of those rows (staging for RDMA)
//   per half h in {0, 1}:
//     dispatch_recv_counts[L][R]     tokens of source s that chose local expert le (pack_low_latency_word)
//     dispatch_recv_index[L][R][M]   their pack_recv_index_entry(token, top-k position), ascending tokens,
//                                    each a pack_low_latency_word as the counts are
//     dispatch_send_index[E][M]      this rank's lists for experts on RDMA ranks (staging for RDMA)
//     dispatch_send_msgs[M]          this rank's cast tokens (staging for RDMA puts)
//     dispatch_recv_msgs[R][M]       tokens received from each source, slot = source token index
//     combine_recv_slots[M][kMaxTopk] expert outputs returned for (token, top-k position)
//   listings of each half h in {0, 1} (dispatches with top-k weights only; after the halves, so the offsets
//   above, which the kernels compute on the fly, keep their few terms):
//     dispatch_send_listings[M]      this rank's tokens' listings (staging for RDMA puts)
//     dispatch_recv_listings[R][M]   listings of the tokens received
struct LowLatencyBufferMap {
  int num_max_tokens;  // M: tokens per rank per call at most
  int hidden;          // H
  int num_ranks;       // R
  int num_experts;     // E
  // E / R and R as SmallDivisors: the kernels find an expert's rank and local index, and a (local expert,
  // rank) pair's parts, with a multiply rather than a division (E <= 4096 keeps every such quotient exact).
  SmallDivisor local_experts;
  SmallDivisor ranks;

  LowLatencyBufferMap() = default;
  // Validates the shape (host only); throws epx::Error naming the bad argument.
  LowLatencyBufferMap(int num_max_dispatch_tokens_per_rank, int hidden_size, int num_ranks_in_group,
                      int num_experts_total)
      : num_max_tokens(num_max_dispatch_tokens_per_rank),
        hidden(hidden_size),
        num_ranks(num_ranks_in_group),
        num_experts(num_experts_total) {
    EPX_CHECK(num_max_tokens > 0, "num_max_dispatch_tokens_per_rank", num_max_tokens, "must be > 0");
    EPX_CHECK(num_max_tokens <= kMaxLowLatencyTokensPerRank, "num_max_dispatch_tokens_per_rank",
              num_max_tokens, "must be <= 65536");
    EPX_CHECK(hidden > 0, "hidden", hidden, "must be > 0");
    EPX_CHECK(hidden % kLowLatencyGroupSize == 0, "hidden", hidden,
              "must be a multiple of 128 (the FP8/LogFMT group size)");
    EPX_CHECK(num_ranks >= 1, "num_ranks", num_ranks, "must be >= 1");
    EPX_CHECK(num_ranks <= kMaxLowLatencyRanks, "num_ranks", num_ranks, "must be <= 64");
    EPX_CHECK(num_experts > 0, "num_experts", num_experts, "must be > 0");
    EPX_CHECK(num_experts <= kMaxExperts, "num_experts", num_experts, "must be <= 4096");
    EPX_CHECK(num_experts % num_ranks == 0, "num_experts", num_experts,
              "must be a multiple of the number of ranks");
    local_experts = SmallDivisor(static_cast<uint32_t>(num_experts / num_ranks));
    ranks = SmallDivisor(static_cast<uint32_t>(num_ranks));
  }

  // ---- Shape ----
  EPX_HD int num_local_experts() const { return static_cast<int>(local_experts.divisor); }
  // The rank that holds expert `expert` (0 <= expert < E), and its index among that rank's experts.
  EPX_HD int expert_rank(int expert) const { return static_cast<int>(local_experts.div(uint32_t(expert))); }
  EPX_HD int local_expert_of(int expert) const {
    return static_cast<int>(local_experts.mod(uint32_t(expert)));
  }
  // Pair `pair` = local expert * R + rank (0 <= pair < E): its local expert and its rank.
  EPX_HD int pair_local_expert(int pair) const { return static_cast<int>(ranks.div(uint32_t(pair))); }
  EPX_HD int pair_rank(int pair) const { return static_cast<int>(ranks.mod(uint32_t(pair))); }
  // FP8 scale / LogFMT groups per row.
  EPX_HD int num_groups() const { return hidden / kLowLatencyGroupSize; }
  EPX_HD int num_recv_rows() const { return num_ranks * num_max_tokens; }  // rows per expert: R*M

  // One dispatched token in any scale format (RowFormat::msg_bytes: the cast row, then its float scales), so
  // calls of every format share the map. Messages grow by whole groups, so the largest is a constant per
  // group.
  EPX_HD size_t dispatch_msg_bytes() const {
    return align_up(size_t(num_groups()) * kLargestMsgBytesPerGroup, 16);
  }
  // One returned expert output: BF16 row, or LogFMT with the worst-case group slot and, for a packed row
  // (logfmt.hpp), its fallback bits (the largest).
  EPX_HD size_t combine_slot_bytes() const {
    const size_t bf16_bytes = size_t(hidden) * 2;
    const size_t logfmt_bytes =
        size_t(num_groups()) * kLogfmtGroupSlotBytes + sizeof(uint32_t) * logfmt_fallback_words(num_groups());
    return align_up(bf16_bytes > logfmt_bytes ? bf16_bytes : logfmt_bytes, 16);
  }
  // A LogFMT slot: the payloads in [0, G * 256), then G metadata words, then (packed rows) the fallback bits.
  EPX_HD size_t logfmt_meta_offset() const { return size_t(num_groups()) * kLogfmtGroupSize * 2; }
  // Metadata and fallback words of a LogFMT row: what combine_send_meta stages per row, contiguous as in a
  // slot.
  EPX_HD int logfmt_meta_words() const { return num_groups() + logfmt_fallback_words(num_groups()); }

  // ---- Control: the clean barrier, both halves' signals and the shape fingerprints of sources on other
  // nodes. Their offsets depend only on R, so operations of different shapes (M, H, E) on one buffer still
  // agree on them (a fingerprint that differs is what the receiver must find, not a misplaced one). ----
  EPX_HD size_t barrier_signal_offset(int src_rank) const {
    return InternodeBufferMap::kLowLatencyBarrierOffset + sizeof(int) * size_t(src_rank);
  }
  EPX_HD size_t barrier_count_offset() const {
    return InternodeBufferMap::kLowLatencyBarrierOffset + sizeof(int) * size_t(num_ranks);
  }
  EPX_HD size_t barrier_bytes() const {
    return align_up(sizeof(int) * (size_t(num_ranks) + 1), kLowLatencyAlign);
  }
  // Per half: recv_flag[op][R], send_finish[op][R], num_uses[op], recv_done[op], source_decision[op][R].
  EPX_HD size_t signals_bytes() const {
    return align_up(sizeof(int) * (size_t(3 * kNumLowLatencyOps) * num_ranks + 2 * kNumLowLatencyOps),
                    kLowLatencyAlign);
  }
  EPX_HD size_t signals_offset(int half) const {
    return InternodeBufferMap::kQueuesOffset + size_t(half) * signals_bytes();
  }
  // Shape fingerprints that sources on other nodes put here: [half][op][src].
  EPX_HD size_t remote_shapes_offset() const { return signals_offset(2); }
  EPX_HD size_t remote_shapes_bytes() const {
    return align_up(kLowLatencyShapeSlotBytes * 2 * kNumLowLatencyOps * size_t(num_ranks), kLowLatencyAlign);
  }
  // This rank's fingerprint staged for those puts: [half][op].
  EPX_HD size_t staged_shapes_offset() const { return remote_shapes_offset() + remote_shapes_bytes(); }
  EPX_HD size_t staged_shapes_bytes() const {
    return align_up(kLowLatencyShapeSlotBytes * 2 * kNumLowLatencyOps, kLowLatencyAlign);
  }
  // Where the control area ends (its offset from the start of the buffer: the normal-mode head included).
  EPX_HD size_t control_end_offset() const { return staged_shapes_offset() + staged_shapes_bytes(); }

  // ---- Combine send rows (shared by both halves: a send phase reads them completely before it ends) ----
  EPX_HD size_t combine_send_offset() const { return control_end_offset(); }
  // L * (R * M) rows, counted as E * M (L * R == E, which the constructor checks): the kernels compute every
  // later offset on the fly, and this way none of them divides by a runtime value.
  EPX_HD size_t combine_send_bytes() const {
    return align_up(size_t(num_experts) * num_max_tokens * hidden * 2, kLowLatencyAlign);
  }
  EPX_HD size_t combine_send_row_offset(int local_expert, int row) const {
    return combine_send_offset() + (size_t(local_expert) * num_recv_rows() + row) * size_t(hidden) * 2;
  }
  // A LogFMT row staged for RDMA keeps its packed payload in the combine_send row (at most G * 256 bytes,
  // the BF16 row's size) and its metadata and fallback words (logfmt_meta_words) here.
  EPX_HD size_t combine_send_meta_offset() const { return combine_send_offset() + combine_send_bytes(); }
  EPX_HD size_t combine_send_meta_bytes() const {
    return align_up(sizeof(uint32_t) * size_t(num_experts) * num_max_tokens * logfmt_meta_words(),
                    kLowLatencyAlign);  // L * (R * M) rows, as combine_send_bytes
  }
  EPX_HD size_t combine_send_meta_row_offset(int local_expert, int row) const {
    return combine_send_meta_offset() +
           (size_t(local_expert) * num_recv_rows() + row) * sizeof(uint32_t) * logfmt_meta_words();
  }

  // ---- Per-half data regions, offsets relative to the half ----
  EPX_HD size_t dispatch_recv_counts_bytes() const {
    return align_up(sizeof(uint64_t) * size_t(num_experts), kLowLatencyAlign);  // L*R == E
  }
  EPX_HD size_t dispatch_recv_index_bytes() const {
    return align_up(sizeof(uint64_t) * size_t(num_experts) * num_max_tokens, kLowLatencyAlign);
  }
  EPX_HD size_t dispatch_send_index_bytes() const { return dispatch_recv_index_bytes(); }  // E*M == L*R*M
  EPX_HD size_t dispatch_send_msgs_bytes() const {
    return align_up(size_t(num_max_tokens) * dispatch_msg_bytes(), kLowLatencyAlign);
  }
  EPX_HD size_t dispatch_recv_msgs_bytes() const {
    return align_up(size_t(num_ranks) * num_max_tokens * dispatch_msg_bytes(), kLowLatencyAlign);
  }
  EPX_HD size_t dispatch_send_listings_bytes() const {
    return align_up(size_t(num_max_tokens) * kLowLatencyListingsBytes, kLowLatencyAlign);
  }
  EPX_HD size_t dispatch_recv_listings_bytes() const {
    return align_up(size_t(num_ranks) * num_max_tokens * kLowLatencyListingsBytes, kLowLatencyAlign);
  }
  EPX_HD size_t combine_recv_slots_bytes() const {
    return align_up(size_t(num_max_tokens) * kMaxTopk * combine_slot_bytes(), kLowLatencyAlign);
  }

  EPX_HD size_t dispatch_recv_counts_rel() const { return 0; }
  EPX_HD size_t dispatch_recv_index_rel() const {
    return dispatch_recv_counts_rel() + dispatch_recv_counts_bytes();
  }
  EPX_HD size_t dispatch_send_index_rel() const {
    return dispatch_recv_index_rel() + dispatch_recv_index_bytes();
  }
  EPX_HD size_t dispatch_send_msgs_rel() const {
    return dispatch_send_index_rel() + dispatch_send_index_bytes();
  }
  EPX_HD size_t dispatch_recv_msgs_rel() const {
    return dispatch_send_msgs_rel() + dispatch_send_msgs_bytes();
  }
  EPX_HD size_t combine_recv_slots_rel() const {
    return dispatch_recv_msgs_rel() + dispatch_recv_msgs_bytes();
  }
  EPX_HD size_t half_bytes() const { return combine_recv_slots_rel() + combine_recv_slots_bytes(); }

  EPX_HD size_t half_offset(int half) const {
    return combine_send_meta_offset() + combine_send_meta_bytes() + size_t(half) * half_bytes();
  }
  // Listings of half `half`: dispatch_send_listings, then dispatch_recv_listings.
  EPX_HD size_t listings_half_bytes() const {
    return dispatch_send_listings_bytes() + dispatch_recv_listings_bytes();
  }
  EPX_HD size_t listings_offset(int half) const {
    return half_offset(2) + size_t(half) * listings_half_bytes();
  }
  EPX_HD size_t total_bytes() const { return listings_offset(2); }

  // ---- Absolute byte offsets of single items ----
  // Written by `src_rank`: how many operations of kind `op` it has sent into this half (monotonic).
  EPX_HD size_t recv_flag_offset(int half, LowLatencyOp op, int src_rank) const {
    return signals_offset(half) + sizeof(int) * (size_t(static_cast<int>(op)) * num_ranks + src_rank);
  }
  // Local: blocks of the running send phase done with `dst_rank` (the last one publishes and resets it).
  EPX_HD size_t send_finish_offset(int half, LowLatencyOp op, int dst_rank) const {
    return signals_offset(half) +
           sizeof(int) * (size_t(kNumLowLatencyOps + static_cast<int>(op)) * num_ranks + dst_rank);
  }
  // Local: operations of kind `op` this rank has completely received in this half.
  EPX_HD size_t num_uses_offset(int half, LowLatencyOp op) const {
    return signals_offset(half) +
           sizeof(int) * (size_t(2 * kNumLowLatencyOps) * num_ranks + static_cast<int>(op));
  }
  // Local: blocks of the running receive phase that finished (the last one bumps num_uses and resets it).
  EPX_HD size_t recv_done_offset(int half, LowLatencyOp op) const {
    return signals_offset(half) + sizeof(int) * (size_t(2 * kNumLowLatencyOps) * num_ranks +
                                                 kNumLowLatencyOps + static_cast<int>(op));
  }
  // Local, used with enable_shrink only: whether the receive of the running operation of kind `op` reads
  // source `src_rank` (+expected flag value) or leaves it out (-expected), decided once by the first block
  // that finished waiting for it, so every block of the receive agrees even when a wait timed out.
  EPX_HD size_t source_decision_offset(int half, LowLatencyOp op, int src_rank) const {
    return signals_offset(half) +
           sizeof(int) * (size_t(2 * kNumLowLatencyOps) * num_ranks + 2 * kNumLowLatencyOps +
                          size_t(static_cast<int>(op)) * num_ranks + src_rank);
  }
  // Written by `src_rank` on another node (a store or a put): the shape fingerprint of its operation of kind
  // `op` in this half, released by its recv_flag.
  EPX_HD size_t remote_shape_offset(int half, LowLatencyOp op, int src_rank) const {
    return remote_shapes_offset() +
           kLowLatencyShapeSlotBytes *
               ((size_t(half) * kNumLowLatencyOps + static_cast<int>(op)) * num_ranks + src_rank);
  }
  // Local: this rank's fingerprint of its running operation of kind `op` in this half, read by the puts.
  EPX_HD size_t staged_shape_offset(int half, LowLatencyOp op) const {
    return staged_shapes_offset() +
           kLowLatencyShapeSlotBytes * (size_t(half) * kNumLowLatencyOps + static_cast<int>(op));
  }
  EPX_HD size_t dispatch_recv_count_offset(int half, int local_expert, int src_rank) const {
    return half_offset(half) + dispatch_recv_counts_rel() +
           sizeof(uint64_t) * (size_t(local_expert) * num_ranks + src_rank);
  }
  // Start of the tagged list [M] of (local_expert, src_rank); entry i = token << 4 | top-k position.
  EPX_HD size_t dispatch_recv_index_offset(int half, int local_expert, int src_rank) const {
    return half_offset(half) + dispatch_recv_index_rel() +
           sizeof(uint64_t) * (size_t(local_expert) * num_ranks + src_rank) * num_max_tokens;
  }
  // Start of the staged tagged list [M] of global expert `expert` (on an RDMA rank).
  EPX_HD size_t dispatch_send_index_offset(int half, int expert) const {
    return half_offset(half) + dispatch_send_index_rel() + sizeof(uint64_t) * size_t(expert) * num_max_tokens;
  }
  EPX_HD size_t dispatch_send_msg_offset(int half, int token) const {
    return half_offset(half) + dispatch_send_msgs_rel() + size_t(token) * dispatch_msg_bytes();
  }
  EPX_HD size_t dispatch_recv_msg_offset(int half, int src_rank, int token) const {
    return half_offset(half) + dispatch_recv_msgs_rel() +
           (size_t(src_rank) * num_max_tokens + token) * dispatch_msg_bytes();
  }
  EPX_HD size_t dispatch_send_listings_offset(int half, int token) const {
    return listings_offset(half) + size_t(token) * kLowLatencyListingsBytes;
  }
  EPX_HD size_t dispatch_recv_listings_offset(int half, int src_rank, int token) const {
    return listings_offset(half) + dispatch_send_listings_bytes() +
           (size_t(src_rank) * num_max_tokens + token) * kLowLatencyListingsBytes;
  }
  EPX_HD size_t combine_recv_slot_offset(int half, int token, int topk_pos) const {
    return half_offset(half) + combine_recv_slots_rel() +
           (size_t(token) * kMaxTopk + topk_pos) * combine_slot_bytes();
  }

  // ---- Typed addresses inside a buffer based at `base` (local, or a peer's mapping) ----
  template <typename T>
  EPX_HD static T* at(void* base, size_t offset) {
    return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
  }
};
static_assert(sizeof(int) * (kMaxLowLatencyRanks + 1) <= InternodeBufferMap::kLowLatencyBarrierBytes,
              "the clean barrier of the largest group must fit its reserved place");

}  // namespace epx
