#pragma once

// Low-latency combine: send phase (every expert output row goes back to its source token's slot on the
// source rank, BF16 or LogFMT-10) and receive phase (wait, then the weighted sum in top-k order). Templated
// on the transport policy for ranks outside the NVLink node (low_latency_transport.cuh). The LogFMT coding of
// the rows is logfmt_coding.cuh's.
#include "formats/bf16.hpp"
#include "formats/logfmt.hpp"
#include "gpu/cuda_check.hpp"
#include "kernels/launch.hpp"
#include "kernels/logfmt_coding.cuh"
#include "kernels/low_latency_common.cuh"
#include "kernels/low_latency_transport.cuh"
#include "kernels/preload.hpp"
#include "kernels/warp_copy.cuh"

namespace epx::kernels {

namespace {

using namespace low_latency;

struct CombineSmallSmem {
  float weights[kMaxTopk];
  int slot_pos[kMaxTopk];  // top-k position whose slot holds listing k's row, -1 for no expert
  int warp_sums[kNumWarps];
  unsigned long long masked;    // the rank mask as this launch sees it (load_rank_mask)
  unsigned long long left_out;  // sources the receive leaves out (wait_all_sources)
  unsigned long long needed;    // the ranks the block's current token has experts on (reduce_tokens)
  unsigned packed;              // bit k: listing k's row came by a put, packed (logfmt.hpp; LogFMT only)
};

// The receive's table of constants, one per (listed slot, group) of a window of the token's groups: top-8
// of hidden 7168 (8 x 56 groups) in one window.
constexpr int kLogfmtTableEntries = 512;
// Per warp: the encoder's constants of a batch of groups, or the receive's products awaiting their ordered
// sum (chunks_per_warp chunks of lanes_per_chunk * 8 + 8 floats, once lanes_per_chunk > 1: at most
// 16 * 24 floats).
constexpr int kLogfmtWarpScratchBytes = 1536;

// Dynamic shared memory of a combine kernel: CombineSmallSmem, then (LogFMT kernels) the receive's table and
// the warps' scratch, then the send's per-pair prefix sums.
constexpr size_t kCombineTableOffset = align_up(sizeof(CombineSmallSmem), 16);
// Beside each table entry, where its group's payload starts in the slot (256 g, or packed).
constexpr size_t kCombineTableOffsetsOffset =
    kCombineTableOffset + sizeof(LogfmtDecodeConstants) * kLogfmtTableEntries;
constexpr size_t kCombineWarpScratchOffset = kCombineTableOffsetsOffset + sizeof(int) * kLogfmtTableEntries;
constexpr size_t combine_prefix_offset(bool logfmt) {
  return logfmt ? kCombineWarpScratchOffset + size_t(kLogfmtWarpScratchBytes) * kNumWarps
                : kCombineTableOffset;
}

// The send's pair prefix ([E + 1] ints), then each pair's first row ([E] ints: scan_pair_ranges).
size_t combine_smem_bytes(const LowLatencyBufferMap& map, bool logfmt) {
  return combine_prefix_offset(logfmt) + sizeof(int) * (2 * size_t(map.num_experts) + 1);
}

__device__ __forceinline__ char* combine_smem() {
  extern __shared__ __align__(16) char smem[];
  return smem;
}

__device__ __forceinline__ LogfmtDecodeConstants* logfmt_table() {
  return reinterpret_cast<LogfmtDecodeConstants*>(combine_smem() + kCombineTableOffset);
}
__device__ __forceinline__ int* logfmt_table_payloads() {
  return reinterpret_cast<int*>(combine_smem() + kCombineTableOffsetsOffset);
}

// The calling warp's scratch (LogFMT kernels only).
__device__ __forceinline__ char* logfmt_warp_scratch() {
  return combine_smem() + kCombineWarpScratchOffset + size_t(threadIdx.x / 32) * kLogfmtWarpScratchBytes;
}

// ---- Send ----

// One warp encodes a row group by group: lane l holds channels 4l..4l+3, whose 40 code bits sit at bit 40l
// of the group's code stream; lanes assemble the stream into 32-bit words with two shuffles each. Payloads
// go to `slot` + g * 256, metadata words to `meta` (in a slot: right after the payloads).
// Groups [group_begin, group_end) only: a piece of the row (work_split.hpp's logfmt_row_pieces).
// kPacked (a whole row, for a put): payloads packed (logfmt_packed_offset), the fallback words after the G
// metadata words; returns the row's fallback groups. A packed group's payload lies within the input's groups
// up to its own, which the warp has read before it writes it, so `slot` may be `row` itself (encoding in
// place).
template <bool kPacked = false>
__device__ int encode_logfmt_groups(char* slot, uint32_t* meta, const uint16_t* row, int group_begin,
                                    int group_end, int lane) {
  // kBatch groups' loads in flight together; a batch is loaded before any of its payloads is written. Lane
  // 4g computes group g's constants from the batch's max and min, into the warp's scratch.
  constexpr int kBatch = 8;
  static_assert(kBatch * sizeof(LogfmtEncodeConstants) <= kLogfmtWarpScratchBytes);
  auto* constants = reinterpret_cast<LogfmtEncodeConstants*>(logfmt_warp_scratch());
  int fallbacks = 0;           // kPacked: the row's fallback groups so far
  uint32_t fallback_bits = 0;  // kPacked: of the current fallback word
  for (int group0 = group_begin; group0 < group_end; group0 += kBatch) {
    uint2 batch[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      batch[u] = group0 + u < group_end
                     ? __ldcg(reinterpret_cast<const uint2*>(row + (group0 + u) * kLogfmtGroupSize) + lane)
                     : make_uint2(0u, 0u);
    }
    __syncwarp();  // the previous batch's constants have been read
    if (group_end - group0 == 1) {
      // Warp-uniform: a lone group (a spread send's piece, often one group per warp), its key word
      // reduced whole in every lane, without the other seven groups' keys.
      uint32_t key = logfmt_key_word(batch[0].x, batch[0].y);
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1)
        key = max_u16x2(key, __shfl_xor_sync(kFullMask, key, offset));
      if (lane == 0) store_encode_constants(constants[0], key);
    } else {
      // After every load is in flight. An absent group's zeros give kLogfmtKeyWordIdentity.
      uint32_t keys[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) keys[u] = logfmt_key_word(batch[u].x, batch[u].y);
      const uint32_t key = reduce_scatter8(keys, lane);
      if (lane % 4 == 0) store_encode_constants(constants[lane / 4], key);
    }
    __syncwarp();
    // Rolled, the batch rotating to the front (so it stays in registers): one copy of the encode.
#pragma unroll 1
    for (int u = 0; u < kBatch && group0 + u < group_end; ++u) {
      const int group = group0 + u;
      char* payload = slot + logfmt_payload_offset(group, kPacked, fallbacks);
      encode_logfmt_group(payload, meta, group, batch[0], in_registers(constants[u]), lane);
      if constexpr (kPacked) {
        const bool fallback = constants[u].params.max_bits == kLogfmtFallbackMarker;  // warp-uniform
        fallbacks += fallback;
        fallback_bits |= static_cast<uint32_t>(fallback) << (group % 32);
        if (group % 32 == 31 || group + 1 == group_end) {
          if (lane == 0) meta[group_end + group / 32] = fallback_bits;
          fallback_bits = 0;
        }
      }
#pragma unroll
      for (int v = 0; v + 1 < kBatch; ++v) batch[v] = batch[v + 1];
    }
  }
  return fallbacks;
}

// Groups [group_begin, group_end) of a row as fallback (BF16) groups, at 256 g: how a LogFMT combine that
// spans nodes sends the rows that stay within the node (unless LowLatencyCombineInput::logfmt_within_node).
// kSourceMayChange: as warp_copy's (a staged row this kernel wrote).
template <bool kSourceMayChange>
__device__ void copy_plain_groups(char* slot, uint32_t* meta, const uint16_t* row, int group_begin,
                                  int group_end, int lane) {
  warp_copy<kSourceMayChange, 4>(slot + logfmt_payload_offset(group_begin, false, 0),
                                 row + size_t(group_begin) * kLogfmtGroupSize,
                                 size_t(group_end - group_begin) * kLogfmtPayloadStride, lane);
  for (int group = group_begin + lane; group < group_end; group += 32) meta[group] = kLogfmtFallbackMarker;
}

// Whether a LogFMT combine sends the rows it writes into `dst` as BF16 groups: `dst` is of this node, the
// combine spans nodes (the NVLink-only kernels run only when LogFMT is asked within the node) and was not
// asked to code them. A mapped rank of another node gets codes, as a put would carry them.
template <typename Remote>
__device__ __forceinline__ bool plain_within_node(const LowLatencyCombineArgs& args, int dst) {
  return Remote::kEnabled && !args.in.logfmt_within_node && same_node(args.peers, dst);
}

// One expert output row to `dst`'s slot at `slot_offset`, through this rank's staging row (`row_idx` of
// combine_send) and puts.
template <typename Remote, bool kLogfmt>
__device__ void put_expert_output(const LowLatencyCombineArgs& args, const uint16_t* row, size_t row_idx,
                                  int dst, size_t slot_offset, int lane) {
  const LowLatencyBufferMap& map = args.map;
  const int num_groups = map.num_groups();
  const size_t row_bytes = size_t(map.hidden) * 2;
  char* staged = local_at<char>(args.peers, map.combine_send_offset()) + row_idx * row_bytes;
  char* slot = local_at<char>(args.peers, slot_offset);
  if constexpr (kLogfmt) {
    // The packed payload in the staging row, the metadata and fallback words beside it; the puts carry
    // only the payload's bytes (0.64x a BF16 row's when every group is coded).
    uint32_t* meta =
        local_at<uint32_t>(args.peers, map.combine_send_meta_offset()) + row_idx * map.logfmt_meta_words();
    const int fallbacks = encode_logfmt_groups<true>(staged, meta, row, 0, num_groups, lane);
    __syncwarp();
    Remote::put_warp(slot, staged, logfmt_packed_bytes(num_groups, fallbacks), dst);
    Remote::put_warp(slot + map.logfmt_meta_offset(), meta, sizeof(uint32_t) * map.logfmt_meta_words(), dst);
    return;
  }
  // Zero-copy rows already are the staging rows.
  if (reinterpret_cast<const char*>(row) != staged) warp_copy<false>(staged, row, row_bytes, lane);
  __syncwarp();
  Remote::put_warp(slot, staged, row_bytes, dst);
}

// ---- Send, pre-reduced ----

// 8 floats as 4 words of BF16 pairs, rounded to nearest even.
__device__ __forceinline__ int4 pack_bf16x8(const float* acc) {
  uint32_t words[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    words[i] = float_to_bf16(acc[2 * i]) | (static_cast<uint32_t>(float_to_bf16(acc[2 * i + 1])) << 16);
  return make_int4(static_cast<int>(words[0]), static_cast<int>(words[1]), static_cast<int>(words[2]),
                   static_cast<int>(words[3]));
}

// acc[i] += weight * value i of 8 BF16 values, with separate IEEE multiply and add (the reference's order).
__device__ __forceinline__ void add_weighted8(float* acc, float weight, const int4& raw) {
  float values[8];
  unpack_bf16x8(raw, values);
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(weight, values[i]));
}

// Channels 8c..8c+7 for chunks c in [chunk_begin, chunk_end) of a token's partial row: +0, then weight *
// row added for each listing in top-k order (separate IEEE multiply and add, as the reference writes it),
// rounded to BF16 into dst[c]. Lane k holds listing k (row -1: none here); the warp runs it together.
// kBatch: listings' loads in flight together (8: top-8 in one round).
template <int kBatch = 8>
__device__ void sum_listings(int4* dst, const int4* x, int row_chunks, int listing_row, float listing_weight,
                             int num_topk, int chunk_begin, int chunk_end, int lane) {
  for (int chunk0 = chunk_begin; chunk0 < chunk_end; chunk0 += 32) {
    const int chunk = chunk0 + lane;
    const bool active = chunk < chunk_end;
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
    for (int k0 = 0; k0 < num_topk; k0 += kBatch) {
      int rows[kBatch];
      int4 raw[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int row = __shfl_sync(kFullMask, listing_row, (k0 + u) % 32);
        rows[u] = k0 + u < num_topk ? row : -1;
        if (active && rows[u] >= 0) raw[u] = __ldcg(x + size_t(rows[u]) * row_chunks + chunk);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const float weight = __shfl_sync(kFullMask, listing_weight, (k0 + u) % 32);
        if (active && rows[u] >= 0) add_weighted8(acc, weight, raw[u]);
      }
    }
    if (active) dst[chunk] = pack_bf16x8(acc);
  }
}

// values[k] for k in 0..3, by selects: a register array indexed by a runtime value would go to local memory.
template <typename T>
__device__ __forceinline__ T pick_of_four(const T (&values)[4], int k) {
  return k == 0 ? values[0] : k == 1 ? values[1] : k == 2 ? values[2] : values[3];
}

// sum_listings for a BF16 partial row whose token has 1 to 4 listings here (`listed`, bit k: lane k's listing
// has a row here), with eight 16-byte loads in flight per lane whatever their number m: the eight load slots
// of a round cover P = m rounded up to a power of two listings by 8 / P chunks 32 apart (slot q: listing q %
// P, chunk q / P), then add up chunk by chunk. sum_listings takes one chunk per lane per round, so a token
// with one listing here went through its share of the row in rounds of one load each, and its warp was the
// send's last. The same sums in the same order as sum_listings (acc = +0, then weight * row in top-k order).
// The listings' rows and weights are gathered once, before the rounds: a slot picks its listing's with
// selects. Found per slot and round with __fns (about 70 instructions each, twice per slot), the rounds were
// bound by their instructions: a warp's share took 7.4-8.1 us at 128 tokens on two ranks against 3.9 at one
// rank, where every token has eight listings here and takes sum_listings (per-warp stamps, 2 x H200).
__device__ void sum_listings_wide(int4* dst, const int4* x, int row_chunks, unsigned listed, int listing_row,
                                  float listing_weight, int chunk_begin, int chunk_end, int lane) {
  constexpr int kSlots = 8;
  const int num_listed = __popc(listed);
  const int listing_bits = num_listed == 1 ? 0 : num_listed == 2 ? 1 : 2;  // log2 P
  const int per_chunk = 1 << listing_bits;
  // Listing k's row (-1 past the m listed) and weight, in top-k order: the k-th set bit of `listed`.
  int rows[4];
  float weights[4];
  unsigned rest = listed;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int src = rest != 0u ? __ffs(rest) - 1 : 0;
    const int row = __shfl_sync(kFullMask, listing_row, src);
    weights[k] = __shfl_sync(kFullMask, listing_weight, src);
    rows[k] = rest != 0u ? row : -1;
    rest &= rest - 1u;
  }
  // Warp-uniform rounds; lanes past the range load and store nothing.
  for (int base = chunk_begin; base < chunk_end; base += 32 * (kSlots >> listing_bits)) {
    const int chunk0 = base + lane;
    int4 raw[kSlots];
#pragma unroll
    for (int q = 0; q < kSlots; ++q) {
      const int k = q & (per_chunk - 1);
      const int chunk = chunk0 + (q >> listing_bits) * 32;
      const int row = pick_of_four(rows, k);
      if (row >= 0 && chunk < chunk_end) raw[q] = __ldcg(x + size_t(row) * row_chunks + chunk);
    }
    float acc[8];
#pragma unroll
    for (int q = 0; q < kSlots; ++q) {
      const int k = q & (per_chunk - 1);
      const int chunk = chunk0 + (q >> listing_bits) * 32;
      const int row = pick_of_four(rows, k);
      const float weight = pick_of_four(weights, k);
      if (k == 0) {
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
      }
      if (row >= 0 && chunk < chunk_end) add_weighted8(acc, weight, raw[q]);
      if (k == per_chunk - 1 && chunk < chunk_end) dst[chunk] = pack_bf16x8(acc);
    }
  }
}

// Item `piece` of row `row_idx` (token `token` of source `dst`, its expert first listed at `topk_pos`) in a
// pre-reduced send: the token's partial row over this rank's listings goes to slot (token, first listing
// here) of `dst`. The token's n distinct rows here share the work: row i of n takes the i-th share of each
// piece's channels (LogFMT: of its groups), reading all n rows for them, so the pre-reduced send spreads over
// as many warps as the plain one. A put row is summed whole, into the staging row of the token's first row
// here, by that row's item.
template <typename Remote, bool kLogfmt>
__device__ void send_partial_piece(const LowLatencyCombineArgs& args, size_t row_idx, int token, int topk_pos,
                                   int dst, int piece, int num_pieces, int lane) {
  const LowLatencyBufferMap& map = args.map;
  const int num_topk = args.in.num_topk;
  const LowLatencyListing mine =
      lane < num_topk
          ? args.handle.recv_token_listings[(size_t(dst) * map.num_max_tokens + token) * num_topk + lane]
          : LowLatencyListing{-1, 0.0f};
  // Lanes whose listing is the first of its row (a duplicate listing shares its first one's row).
  const bool first_of_row = first_lane_with(mine.row, num_topk, lane) && mine.row >= 0;
  const unsigned row_lanes = __ballot_sync(kFullMask, first_of_row);
  const int first_pos = __ffs(row_lanes) - 1;
  const int first_row = __shfl_sync(kFullMask, mine.row, first_pos);
  const int share = __popc(row_lanes & ((1u << topk_pos) - 1u));
  const int num_shares = __popc(row_lanes);
  const int row_chunks = map.hidden / 8;
  const int4* x = static_cast<const int4*>(args.in.x);
  const size_t slot_offset = map.combine_recv_slot_offset(args.half, token, first_pos);
  int4* staged = local_at<int4>(args.peers, map.combine_send_offset()) + size_t(first_row) * row_chunks;
  if (!is_direct<Remote>(args.peers, dst)) {
    if (share != 0) return;
    sum_listings(staged, x, row_chunks, mine.row, mine.weight, num_topk, 0, row_chunks, lane);
    __syncwarp();
    put_expert_output<Remote, kLogfmt>(args, reinterpret_cast<const uint16_t*>(staged), size_t(first_row),
                                       dst, slot_offset, lane);
    return;
  }
  char* slot = peer_at<char>(args.peers, dst, slot_offset);
  if constexpr (kLogfmt) {
    // The partial's BF16 groups go to the staging row first (each share writes only its own groups), then
    // are encoded from there into the slot.
    const WordRange piece_groups = piece_words(map.num_groups(), piece, num_pieces);
    const WordRange part = piece_words(piece_groups.end - piece_groups.begin, share, num_shares);
    const int group_begin = piece_groups.begin + part.begin;
    const int group_end = piece_groups.begin + part.end;
    constexpr int kGroupChunks = kLogfmtGroupSize / 8;
    // Four loads in flight: with eight the LogFMT kernel spills (the encode's registers are live too).
    sum_listings<4>(staged, x, row_chunks, mine.row, mine.weight, num_topk, group_begin * kGroupChunks,
                    group_end * kGroupChunks, lane);
    __syncwarp();
    auto* meta = reinterpret_cast<uint32_t*>(slot + map.logfmt_meta_offset());
    if (plain_within_node<Remote>(args, dst)) {
      copy_plain_groups<true>(slot, meta, reinterpret_cast<const uint16_t*>(staged), group_begin, group_end,
                              lane);
    } else {
      encode_logfmt_groups(slot, meta, reinterpret_cast<const uint16_t*>(staged), group_begin, group_end,
                           lane);
    }
  } else {
    const WordRange piece_chunks = piece_words(row_chunks, piece, num_pieces);
    const WordRange part = piece_words(piece_chunks.end - piece_chunks.begin, share, num_shares);
    const int chunk_begin = piece_chunks.begin + part.begin;
    const int chunk_end = piece_chunks.begin + part.end;
    const unsigned listed = __ballot_sync(kFullMask, lane < num_topk && mine.row >= 0);
    // A share of one round (a small call's: every lane one chunk) or a token with many listings here keeps
    // to sum_listings; a longer share with few listings takes the wide sum.
    if (chunk_end - chunk_begin > 32 && __popc(listed) <= 4) {
      sum_listings_wide(reinterpret_cast<int4*>(slot), x, row_chunks, listed, mine.row, mine.weight,
                        chunk_begin, chunk_end, lane);
    } else {
      sum_listings(reinterpret_cast<int4*>(slot), x, row_chunks, mine.row, mine.weight, num_topk, chunk_begin,
                   chunk_end, lane);
    }
  }
}

// Pair p's range of rows in its expert block (one 8-byte load: DeepEP's packed begin << 32 | count).
__device__ __forceinline__ LowLatencyRange pair_range(const LowLatencyCombineArgs& args, int p) {
  const auto packed =
      static_cast<uint64_t>(reinterpret_cast<const int64_t*>(args.handle.recv_layout_range)[p]);
  return {static_cast<int>(packed & 0xffffffffu), static_cast<int>(packed >> 32)};
}

// The range of pair threadIdx.x (empty past the pairs), loaded by the kernel before its prologue's barrier so
// that the load and the abort check overlap.
__device__ __forceinline__ LowLatencyRange first_pair_range(const LowLatencyCombineArgs& args) {
  const int p = static_cast<int>(threadIdx.x);
  return p < args.map.num_experts ? pair_range(args, p) : LowLatencyRange{0, 0};
}

// The send's pair prefix ([E + 1]: rows of pair p are flat rows [prefix[p], prefix[p + 1])) and each pair's
// first row in its expert block (begins[E]), in shared memory, from the ranges (`first`: this thread's,
// first_pair_range): the send's items then find a row with no load of the range on their chain. With a pair
// per thread at most, the counts are scanned in registers (block_exclusive_sum: two barriers in all, against
// four for block_exclusive_scan).
__device__ void scan_pair_ranges(const LowLatencyCombineArgs& args, int* prefix, int* begins, int* warp_sums,
                                 LowLatencyRange first) {
  const int num_pairs = args.map.num_experts;
  const int p = static_cast<int>(threadIdx.x);
  if (num_pairs > kNumThreads) {
    for (int q = p; q < num_pairs; q += kNumThreads) {
      const LowLatencyRange range = q == p ? first : pair_range(args, q);
      prefix[q] = range.count;
      begins[q] = range.begin;
    }
    __syncthreads();
    block_exclusive_scan(prefix, num_pairs, warp_sums);
    return;
  }
  const BlockSum sum = block_exclusive_sum(p < num_pairs ? first.count : 0, warp_sums);
  if (p < num_pairs) {
    prefix[p] = sum.exclusive;
    begins[p] = first.begin;
  }
  if (p == 0) prefix[num_pairs] = sum.total;
  __syncthreads();
}

// Rows of every (local expert, source) block, in pieces spread over the grid, blocks first (a row stored
// straight into a mapped rank may take several pieces, BF16 words or LogFMT groups; a put row is one); each
// goes to slot (token, first top-k position) of its source rank, unless that rank is masked. Returns the
// blocks that sent anything (block 0 always counts: it posted the shapes).
template <typename Remote, bool kLogfmt, bool kPreReduce>
__device__ Publishers send_expert_outputs(const LowLatencyCombineArgs& args, int* prefix, int* warp_sums,
                                          unsigned long long masked, LowLatencyRange first_range) {
  const LowLatencyBufferMap& map = args.map;
  const int num_pairs = map.num_experts;
  const int hidden = map.hidden;
  int* begins = prefix + num_pairs + 1;
  scan_pair_ranges(args, prefix, begins, warp_sums, first_range);
  stamp_phase(args.phase_stamps, kStampCounted);

  const int lane = threadIdx.x % 32;
  const int total_rows = prefix[num_pairs];
  // A put row is one piece (staged, then put whole); a row stored straight into a mapped rank is split,
  // unless some rank takes puts (every row then is one piece).
  const bool some_puts = ranks_reached_by_puts<Remote>(args.peers) != 0ull;
  const int num_grid_warps = gridDim.x * kNumWarps;
  const int base_pieces = some_puts ? 1
                          : kLogfmt ? logfmt_row_pieces(map.num_groups())
                                    : row_pieces(size_t(hidden) * 2);
  const int num_pieces = (kPreReduce || kLogfmt) && !some_puts
                             ? spread_row_pieces(base_pieces, total_rows, num_grid_warps,
                                                 kLogfmt ? map.num_groups() : hidden / 8 / 32)
                             : base_pieces;
  const int num_items = total_rows * num_pieces;
  for (int item = first_item(static_cast<int>(blockIdx.x), static_cast<int>(threadIdx.x) / 32,
                             static_cast<int>(gridDim.x));
       item < num_items; item += num_grid_warps) {
    const int j = item / num_pieces;
    const int piece = item % num_pieces;
    const int pair = find_pair(prefix, num_pairs, j);
    const int dst = map.pair_rank(pair);
    if (rank_masked(masked, dst)) continue;
    const size_t row_idx =
        size_t(map.pair_local_expert(pair)) * map.num_recv_rows() + begins[pair] + (j - prefix[pair]);
    const int token = args.handle.recv_src_info[row_idx];
    const int topk_pos = args.handle.recv_topk_pos[row_idx];
    const uint16_t* row = static_cast<const uint16_t*>(args.in.x) + row_idx * hidden;
    if constexpr (kPreReduce) {
      send_partial_piece<Remote, kLogfmt>(args, row_idx, token, topk_pos, dst, piece, num_pieces, lane);
      continue;
    }
    const size_t slot_offset = map.combine_recv_slot_offset(args.half, token, topk_pos);
    if (!is_direct<Remote>(args.peers, dst)) {
      put_expert_output<Remote, kLogfmt>(args, row, row_idx, dst, slot_offset, lane);
      continue;
    }
    char* slot = peer_at<char>(args.peers, dst, slot_offset);
    if constexpr (kLogfmt) {
      const WordRange groups = piece_words(map.num_groups(), piece, num_pieces);
      auto* meta = reinterpret_cast<uint32_t*>(slot + map.logfmt_meta_offset());
      if (plain_within_node<Remote>(args, dst)) {
        copy_plain_groups<false>(slot, meta, row, groups.begin, groups.end, lane);
      } else {
        encode_logfmt_groups(slot, meta, row, groups.begin, groups.end, lane);
      }
    } else {
      warp_copy_piece<false>(slot, row, size_t(hidden) * 2, piece, num_pieces, lane);
    }
  }
  return combine_publishers(num_items, static_cast<int>(gridDim.x), static_cast<int>(blockIdx.x));
}

// ---- Receive ----

// Slot (token, top-k position `pos`) of this rank's receive half: where a returned row lands.
__device__ __forceinline__ const char* returned_slot(const LowLatencyCombineArgs& args, int token, int pos) {
  return local_at<const char>(args.peers, args.map.combine_recv_slot_offset(args.half, token, pos));
}

// A token's slots, for loops that load from several of them: slot `pos` is at(pos), one multiply-add from
// slot 0, where returned_slot sums the whole map's offsets for each (the reduction's loads waited on that).
struct TokenSlots {
  const char* first;
  size_t stride;
  __device__ __forceinline__ const int4* at(int pos) const {
    return reinterpret_cast<const int4*>(first + size_t(pos) * stride);
  }
};
__device__ __forceinline__ TokenSlots token_slots(const LowLatencyCombineArgs& args, int token) {
  return {returned_slot(args, token, 0), args.map.combine_slot_bytes()};
}

// Lane `lane`'s top-k entry of a token: its expert id (-1 for none, or past num_topk) and weight.
struct TopkEntry {
  int expert;
  float weight;
};
template <bool kPreReduce>
__device__ __forceinline__ TopkEntry load_topk_entry(const LowLatencyCombineArgs& args, int token, int lane) {
  if (lane >= args.in.num_topk) return {-1, 0.0f};
  const size_t entry = size_t(token) * args.in.num_topk + lane;
  // A pre-reduced combine's partial rows carry their weights already (and topk_weights may be null).
  return {expert_at(args.in.topk_idx, entry, args.map.num_experts),
          kPreReduce ? 1.0f : args.in.topk_weights[entry]};
}

// Parts of each token the reduction splits it into (reduce_parts over this launch's grid).
__device__ __forceinline__ int reduce_parts_of(const LowLatencyCombineArgs& args) {
  return reduce_parts(args.in.num_tokens, static_cast<int>(gridDim.x), args.map.hidden / 8);
}

// Warp 0's entries of the block's first token, loaded before the receive waits for its sources: the caller's
// top-k does not depend on them, so the load is off the path from the last flag to the first row.
template <bool kPreReduce>
__device__ __forceinline__ TopkEntry first_topk_entry(const LowLatencyCombineArgs& args) {
  const int item = static_cast<int>(blockIdx.x);
  const int parts = reduce_parts_of(args);
  if (threadIdx.x >= 32 || item >= args.in.num_tokens * parts) return {-1, 0.0f};
  return load_topk_entry<kPreReduce>(args, item / parts, static_cast<int>(threadIdx.x));
}

// A pre-reduced combine's reduction order, by warp 0 from lane k's expert: one entry per rank holding some
// of the token's experts (not left out), in ascending rank order, naming the slot its partial row went to
// (the token's first listing on that rank) with weight 1 (the partial is weighted already, and 1 * v is v);
// entries past the ranks are -1.
__device__ void list_partial_slots(CombineSmallSmem& small, int expert, const LowLatencyBufferMap& map,
                                   int num_topk, unsigned long long left_out, int lane) {
  const int expert_rank = expert >= 0 ? map.expert_rank(expert) : -1;
  const int rank = expert_rank >= 0 && !rank_masked(left_out, expert_rank) ? expert_rank : -1;
  const bool first_of_rank = first_lane_with(rank, num_topk, lane) && rank >= 0;
  const unsigned firsts = __ballot_sync(kFullMask, first_of_rank);
  int order = 0;  // entries before this lane's: the ranks below its rank
  for (int k = 0; k < num_topk; ++k) {
    const int other = __shfl_sync(kFullMask, rank, k);
    if ((firsts >> k & 1u) != 0 && other < rank) ++order;
  }
  if (first_of_rank) {
    small.slot_pos[order] = lane;
    small.weights[order] = 1.0f;
  }
  if (lane < num_topk && lane >= __popc(firsts)) small.slot_pos[lane] = -1;
}

// A pre-reduced BF16 combine's reduction of one token's chunks: acc = +0, plus each partial row in the order
// list_partial_slots set (the partials carry their weights), rounded to BF16. A token has one partial per
// rank holding its experts, often one or two, so each thread takes two chunks at once: both chunks' loads
// are in flight together, and a part of up to 2 * kNumThreads chunks is one round trip.
__device__ void add_partial_rows(const LowLatencyCombineArgs& args, const CombineSmallSmem& small, int token,
                                 WordRange chunks, uint16_t* out_row) {
  constexpr int kBatch = 4;  // partial rows per round, each loaded for both chunks
  const int num_topk = args.in.num_topk;
  const TokenSlots slots = token_slots(args, token);
  for (int chunk0 = chunks.begin + static_cast<int>(threadIdx.x); chunk0 < chunks.end;
       chunk0 += 2 * kNumThreads) {
    const int chunk1 = chunk0 + kNumThreads;
    const bool second = chunk1 < chunks.end;
    float acc0[8], acc1[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc0[i] = acc1[i] = 0.0f;
    for (int k0 = 0; k0 < num_topk && small.slot_pos[k0] >= 0; k0 += kBatch) {
      int4 raw0[kBatch], raw1[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int pos = k0 + u < num_topk ? small.slot_pos[k0 + u] : -1;
        if (pos < 0) continue;
        const int4* slot = slots.at(pos);
        raw0[u] = __ldcg(slot + chunk0);
        if (second) raw1[u] = __ldcg(slot + chunk1);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (k0 + u >= num_topk || small.slot_pos[k0 + u] < 0) continue;
        float values[8];
        unpack_bf16x8(raw0[u], values);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc0[i] = __fadd_rn(acc0[i], values[i]);
        if (!second) continue;
        unpack_bf16x8(raw1[u], values);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc1[i] = __fadd_rn(acc1[i], values[i]);
      }
    }
    reinterpret_cast<int4*>(out_row)[chunk0] = pack_bf16x8(acc0);
    if (second) reinterpret_cast<int4*>(out_row)[chunk1] = pack_bf16x8(acc1);
  }
}

// Where group `group` of a returned LogFMT row starts in its slot: at 256 g, or in a packed row (a put's,
// `packed`) after the payloads of the groups before it, which its fallback words count.
__device__ __forceinline__ size_t returned_group_payload(const char* slot, const LowLatencyBufferMap& map,
                                                         int group, bool packed) {
  if (!packed) return logfmt_payload_offset(group, false, 0);
  const auto* words = reinterpret_cast<const uint32_t*>(slot + map.logfmt_meta_offset()) + map.num_groups();
  return logfmt_payload_offset(group, true,
                               logfmt_fallbacks_before(group, [&](int w) { return __ldcg(words + w); }));
}

// The constants of groups [group_begin, group_begin + num_groups) of the token's listed slots (slot_pos >=
// 0), from their metadata words, by the whole block: group g of the k-th listed slot at entry g * num_listed
// + k, so that the lanes of one chunk read adjacent entries (few bank conflicts).
template <bool kPacking>
__device__ void fill_logfmt_table(const LowLatencyCombineArgs& args, const CombineSmallSmem& small, int token,
                                  unsigned listed, int num_listed, int group_begin, int num_groups) {
  LogfmtDecodeConstants* table = logfmt_table();
  int* payloads = logfmt_table_payloads();
  const size_t meta_offset = args.map.logfmt_meta_offset();
  for (int i = static_cast<int>(threadIdx.x); i < num_listed * num_groups; i += kNumThreads) {
    const int k = i % num_listed;
    const int group = group_begin + i / num_listed;
    const int entry = __fns(listed, 0, k + 1);
    const char* slot = returned_slot(args, token, small.slot_pos[entry]);
    const uint32_t meta = __ldcg(reinterpret_cast<const uint32_t*>(slot + meta_offset) + group);
    if constexpr (kPacking) {
      payloads[i] = static_cast<int>(
          returned_group_payload(slot, args.map, group, ((small.packed >> entry) & 1u) != 0));
    }
    table[i] = returned_group_constants(meta);
  }
}

// A LogFMT reduction of a token with at most one listed slot (a pre-reduced token whose experts all sit on
// one rank, say): each thread takes whole chunks, its group's constants from the metadata word itself, acc =
// +0 + w * v. No table: at 1 token a block holds a few chunks, and the table's fill and barriers would be
// its critical path.
template <bool kPacking>
__device__ void reduce_single_slot_chunks(const LowLatencyCombineArgs& args, const CombineSmallSmem& small,
                                          int token, unsigned listed, WordRange chunks, uint16_t* out_row) {
  const int entry = listed != 0 ? __ffs(listed) - 1 : -1;
  const float weight = entry >= 0 ? small.weights[entry] : 0.0f;
  const char* slot = entry >= 0 ? returned_slot(args, token, small.slot_pos[entry]) : nullptr;
  const bool packed = kPacking && entry >= 0 && ((small.packed >> entry) & 1u) != 0;
  const size_t meta_offset = args.map.logfmt_meta_offset();
  for (int chunk = chunks.begin + static_cast<int>(threadIdx.x); chunk < chunks.end; chunk += kNumThreads) {
    float weighted[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) weighted[i] = 0.0f;
    if (entry >= 0) {
      // The codes load in flight with the metadata (a fallback group's words replace them after).
      const uint32_t meta = __ldcg(reinterpret_cast<const uint32_t*>(slot + meta_offset) + chunk / 16);
      const char* payload = slot + returned_group_payload(slot, args.map, chunk / 16, packed);
      LogfmtChunk loaded = load_logfmt_chunk(payload, chunk, false);
      const LogfmtDecodeConstants constants = returned_group_constants(meta);
      if (constants.params.max_bits == kLogfmtFallbackMarker)
        loaded = load_logfmt_chunk(payload, chunk, true);
      decode_logfmt_chunk(loaded, constants, weighted);
#pragma unroll
      for (int i = 0; i < 8; ++i) weighted[i] = __fmul_rn(weight, weighted[i]);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) weighted[i] = __fadd_rn(0.0f, weighted[i]);
    reinterpret_cast<int4*>(out_row)[chunk] = pack_bf16x8(weighted);
  }
}

// A LogFMT reduction of one token's chunks, its listings spread over lanes: of the token's n listed slots
// (slot_pos >= 0, in top-k order), lane (c, k) of a warp loads, decodes and weighs the k-th one's chunk c, n
// rounded up to a power of two lanes per chunk (a pre-reduced token's two partials take two lanes, top-8
// eight; a token with at most one slot goes to reduce_single_slot_chunks). The products go to the warp's
// scratch, where lane (c, i) adds channel i of chunk c in top-k order (acc = +0, then acc + w * v as the
// reference writes it). The groups' constants come from a table the block fills first, window by window of
// groups. The next chunk's words are loaded while the
// current one decodes.
template <bool kPacking>
__device__ void reduce_logfmt_chunks(const LowLatencyCombineArgs& args, const CombineSmallSmem& small,
                                     int token, WordRange chunks, uint16_t* out_row) {
  constexpr int kGroupChunks = kLogfmtGroupSize / 8;
  const int num_topk = args.in.num_topk;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const unsigned listed = __ballot_sync(kFullMask, lane < num_topk && small.slot_pos[lane] >= 0);
  const int num_listed = __popc(listed);
  if (num_listed <= 1) {  // block-uniform
    reduce_single_slot_chunks<kPacking>(args, small, token, listed, chunks, out_row);
    return;
  }
  int lanes_per_chunk = 1;
  while (lanes_per_chunk < num_listed) lanes_per_chunk *= 2;  // 2 to kMaxTopk = 16
  const int chunks_per_warp = 32 / lanes_per_chunk;
  const int k = lane % lanes_per_chunk;
  const int c = lane / lanes_per_chunk;
  const int entry = k < num_listed ? static_cast<int>(__fns(listed, 0, k + 1)) : -1;
  const float weight = entry >= 0 ? small.weights[entry] : 0.0f;
  const char* slot = entry >= 0 ? returned_slot(args, token, small.slot_pos[entry]) : nullptr;
  const bool packed = kPacking && entry >= 0 && ((small.packed >> entry) & 1u) != 0;
  // Products of chunk c, listing k at c * stride + k * 8 floats (padded by 8 against bank conflicts).
  float* products = reinterpret_cast<float*>(logfmt_warp_scratch());
  const int stride = lanes_per_chunk * 8 + 8;
  const LogfmtDecodeConstants* table = logfmt_table();
  const int first_group = chunks.begin / kGroupChunks;
  const int end_group = (chunks.end + kGroupChunks - 1) / kGroupChunks;
  const int window = kLogfmtTableEntries / num_listed;
  for (int group0 = first_group; group0 < end_group; group0 += window) {
    const int num_groups = min(window, end_group - group0);
    const int begin = max(chunks.begin, group0 * kGroupChunks);
    const int end = min(chunks.end, (group0 + num_groups) * kGroupChunks);
    const int step = kNumWarps * chunks_per_warp;
    // The table entry of chunk `chunk` for this lane's listing, and where its group's payload starts.
    const auto table_entry = [&](int chunk) { return (chunk / kGroupChunks - group0) * num_listed + k; };
    const auto constants_of = [&](int chunk) -> const LogfmtDecodeConstants& {
      return table[table_entry(chunk)];
    };
    const auto unpacked_payload_of = [&](int chunk) {
      return slot + logfmt_payload_offset(chunk / kGroupChunks, false, 0);
    };
    const auto payload_of = [&](int chunk) {
      if constexpr (kPacking) return slot + logfmt_table_payloads()[table_entry(chunk)];
      return unpacked_payload_of(chunk);
    };
    int chunk = begin + static_cast<int>(threadIdx.x) / 32 * chunks_per_warp + c;
    // The first chunk's codes load while the table fills (a fallback group's words replace them after; a
    // packed row's payload is not known before the table).
    const bool first_listed = entry >= 0 && chunk < end;
    LogfmtChunk next{};
    if (first_listed && !packed) next = load_logfmt_chunk(unpacked_payload_of(chunk), chunk, false);
    __syncthreads();  // the previous window's table has been read
    fill_logfmt_table<kPacking>(args, small, token, listed, num_listed, group0, num_groups);
    __syncthreads();
    if (first_listed) {
      const bool fallback = constants_of(chunk).params.max_bits == kLogfmtFallbackMarker;
      if (packed || fallback) next = load_logfmt_chunk(payload_of(chunk), chunk, fallback);
    }
    for (; chunk - c < end; chunk += step) {  // warp-uniform condition
      const LogfmtChunk loaded = next;
      const int ahead = chunk + step;
      if (entry >= 0 && ahead < end)
        next = load_logfmt_chunk(payload_of(ahead), ahead,
                                 constants_of(ahead).params.max_bits == kLogfmtFallbackMarker);
      if (entry >= 0 && chunk < end) {
        float values[8];
        decode_logfmt_chunk(loaded, in_registers(constants_of(chunk)), values);
        float4* mine = reinterpret_cast<float4*>(products + c * stride + k * 8);
        mine[0] = make_float4(__fmul_rn(weight, values[0]), __fmul_rn(weight, values[1]),
                              __fmul_rn(weight, values[2]), __fmul_rn(weight, values[3]));
        mine[1] = make_float4(__fmul_rn(weight, values[4]), __fmul_rn(weight, values[5]),
                              __fmul_rn(weight, values[6]), __fmul_rn(weight, values[7]));
      }
      __syncwarp();
      const int warp_chunk = chunk - c;  // the warp's first chunk of this round
      for (int sum = lane; sum < chunks_per_warp * 8 && warp_chunk + sum / 8 < end; sum += 32) {
        const int sum_chunk = sum / 8;
        const int channel = sum % 8;
        float acc = 0.0f;
        for (int j = 0; j < num_listed; ++j)
          acc = __fadd_rn(acc, products[sum_chunk * stride + j * 8 + channel]);
        out_row[(warp_chunk + sum_chunk) * 8 + channel] = float_to_bf16(acc);
      }
      __syncwarp();  // the products have been read
    }
  }
}

// Per token, per 8 channels (a thread each): acc = +0; acc += w_k * v_k in top-k order with separate IEEE
// multiply and add (as the reference writes it), then BF16 round to nearest even. Experts on ranks the
// receive leaves out (small.left_out) count as -1 entries. A token is split into `parts` ranges of channels,
// one block each, when the grid has blocks to spare (reduce_parts), so a small call's loads spread over many
// SMs.
// Rows are reduced as they arrive: before a token, the block waits only for the sources its experts lie on
// that it has not awaited yet (`awaited`, updated), so a block whose tokens' sources have landed reduces
// while later sources are still sending. Returns false when a wait was abandoned (the group is aborted, or a
// source's shapes differ): nothing more is read then.
template <typename Remote, bool kLogfmt, bool kPreReduce>
__device__ bool reduce_tokens(const LowLatencyCombineArgs& args, CombineSmallSmem& small,
                              TopkEntry first_entry, int num_uses, unsigned long long& awaited) {
  const LowLatencyBufferMap& map = args.map;
  const int hidden = map.hidden;
  const int num_topk = args.in.num_topk;
  const int num_chunks = hidden / 8;
  const int parts = reduce_parts_of(args);
  for (int item = blockIdx.x; item < args.in.num_tokens * parts; item += gridDim.x) {
    const int token = item / parts;
    const WordRange chunks = part_chunks(num_chunks, item % parts, parts);
    __syncthreads();
    const int lane = threadIdx.x % 32;
    TopkEntry mine{-1, 0.0f};
    if (threadIdx.x < 32) {
      mine =
          item == static_cast<int>(blockIdx.x) ? first_entry : load_topk_entry<kPreReduce>(args, token, lane);
      unsigned long long ranks = mine.expert >= 0 ? 1ull << map.expert_rank(mine.expert) : 0ull;
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) ranks |= __shfl_xor_sync(kFullMask, ranks, offset);
      if (lane == 0) small.needed = ranks;
    }
    __syncthreads();
    const unsigned long long missing = small.needed & ~awaited;  // block-uniform
    if (missing != 0) {
      const SourceWait wait = wait_all_sources<Remote>(
          args.peers, map, args.half, LowLatencyOp::kCombine, num_uses + 1, WaitPhase::kLowLatencyCombineRecv,
          args.in.combine_wait_recv_cost_stats, args.shape, args.mask, &small.left_out, missing);
      awaited |= missing;
      if (!wait.arrived) return false;
    }
    if (item == static_cast<int>(blockIdx.x)) stamp_phase(args.phase_stamps, kStampArrived);
    const unsigned long long left_out = small.left_out;  // complete for this token's sources
    if (threadIdx.x < 32) {
      const int expert = mine.expert;
      if constexpr (kPreReduce) {
        list_partial_slots(small, expert, map, num_topk, left_out, lane);
      } else {
        int first = lane;
        for (int k = num_topk - 1; k >= 0; --k) {
          const int other = __shfl_sync(kFullMask, expert, k);
          if (k < lane && other == expert) first = k;
        }
        if (lane < num_topk) {
          const bool kept = expert >= 0 && !rank_masked(left_out, map.expert_rank(expert));
          small.slot_pos[lane] = kept ? first : -1;
          small.weights[lane] = mine.weight;
        }
      }
      if constexpr (kLogfmt && Remote::kEnabled) {
        // The listings whose rows came by puts (packed): listing e's row is top-k position slot_pos[e]'s.
        const unsigned long long put_ranks = ranks_reached_by_puts<Remote>(args.peers);
        __syncwarp();
        const int pos = lane < num_topk ? small.slot_pos[lane] : -1;
        const int pos_expert = __shfl_sync(kFullMask, expert, pos >= 0 ? pos : 0);
        const unsigned packed =
            __ballot_sync(kFullMask, pos >= 0 && ((put_ranks >> map.expert_rank(pos_expert)) & 1ull) != 0);
        if (lane == 0) small.packed = packed;
      }
    }
    __syncthreads();
    if (item == static_cast<int>(blockIdx.x)) stamp_phase(args.phase_stamps, kStampIds);
    uint16_t* out_row = static_cast<uint16_t*>(args.out) + size_t(token) * hidden;
    if constexpr (kLogfmt) {
      reduce_logfmt_chunks<Remote::kEnabled>(args, small, token, chunks, out_row);
    } else if constexpr (kPreReduce) {
      add_partial_rows(args, small, token, chunks, out_row);
    } else {
      const TokenSlots slots = token_slots(args, token);
      for (int chunk = chunks.begin + threadIdx.x; chunk < chunks.end; chunk += kNumThreads) {
        float acc[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
        // kBatch listings' loads in flight together (top-8 in one round), then added in top-k order. Two
        // chunks per thread at once (16 loads in flight, 128 registers) measured slower on 2 x H200: the
        // receive launched by its hook 14.2 -> 15.6 us at 1 token, 18.3 -> 18.7-19.8 at 128.
        constexpr int kBatch = 8;
        for (int k0 = 0; k0 < num_topk; k0 += kBatch) {
          int4 raw[kBatch];
#pragma unroll
          for (int u = 0; u < kBatch; ++u) {
            const int pos = k0 + u < num_topk ? small.slot_pos[k0 + u] : -1;
            if (pos >= 0) raw[u] = __ldcg(slots.at(pos) + chunk);
          }
#pragma unroll
          for (int u = 0; u < kBatch; ++u) {
            if (k0 + u < num_topk && small.slot_pos[k0 + u] >= 0)
              add_weighted8(acc, small.weights[k0 + u], raw[u]);
          }
        }
        reinterpret_cast<int4*>(out_row)[chunk] = pack_bf16x8(acc);
      }
    }
  }
  return true;
}

// Named combine, in a namespace, because profiler tooling written for DeepEP looks for kernel names
// ending in ::combine. With a receive hook, the send and the receive launch are both this kernel.
// kLogfmt: the wire format; kPreReduce: the pre-reduced send and order. Template arguments, so each kernel
// holds only its own code and, say, the LogFMT encode does not take registers from the BF16 kernel (they
// would share the 128-register cap and spill).
template <typename Remote, bool kLogfmt, bool kPreReduce>
__global__ void __launch_bounds__(kNumThreads, 1) combine(const LowLatencyCombineArgs args) {
  extern __shared__ __align__(16) char smem[];
  auto& small = *reinterpret_cast<CombineSmallSmem*>(smem);
  int* prefix = reinterpret_cast<int*>(smem + combine_prefix_offset(kLogfmt));
  stamp_phase(args.phase_stamps, kStampEntry);
  const int num_uses = read_num_uses(args.peers, args.map, args.half, LowLatencyOp::kCombine);
  const unsigned long long mask = threadIdx.x == 0 ? load_rank_mask(args.mask) : 0ull;
  // Inputs that do not depend on any peer, loaded now so that their round trips overlap the prologue's (a
  // value read from an aborted dispatch's handle is never used).
  const LowLatencyRange first_range =
      args.phases & kLowLatencySend ? first_pair_range(args) : LowLatencyRange{0, 0};
  const TopkEntry first_entry =
      args.phases & kLowLatencyRecv ? first_topk_entry<kPreReduce>(args) : TopkEntry{-1, 0.0f};
  // After an aborted dispatch the handle's arrays may be anything: send nothing, reduce nothing. The barrier
  // inside also hands the mask to every thread (its load is in flight with the abort word's).
  const bool aborted = device::block_sees_abort(
      wait_context(args.peers),
      args.phases & kLowLatencySend ? WaitPhase::kLowLatencyCombineSend : WaitPhase::kLowLatencyCombineRecv,
      [&] { small.masked = small.left_out = mask; });
  if (aborted) return;
  const unsigned long long masked = small.masked;
  stamp_phase(args.phase_stamps, kStampPrologue);
  if (args.phases & kLowLatencySend) {
    post_shapes<Remote>(args.peers, args.map, args.half, LowLatencyOp::kCombine, args.shape, masked);
    const Publishers publishers =
        send_expert_outputs<Remote, kLogfmt, kPreReduce>(args, prefix, small.warp_sums, masked, first_range);
    stamp_phase_of_block(args.phase_stamps, kStampSent);
    publish_sends<Remote>(args.peers, args.map, args.half, LowLatencyOp::kCombine, num_uses + 1, masked,
                          publishers);
    stamp_phase(args.phase_stamps, kStampPublished);
  }
  if (args.phases & kLowLatencyRecv) {
    // Each block awaits its tokens' sources as it reaches them (an abandoned wait stops its reading), then
    // every source it has not awaited, so that every block checks every source's shapes, decides each
    // timed-out source the same way (enable_shrink) and the statistics count each source once.
    unsigned long long awaited = 0;
    if (reduce_tokens<Remote, kLogfmt, kPreReduce>(args, small, first_entry, num_uses, awaited)) {
      stamp_phase(args.phase_stamps, kStampDelivered);
      const unsigned long long all = args.peers.num_ranks == 64 ? ~0ull : (1ull << args.peers.num_ranks) - 1;
      if ((all & ~awaited) != 0) {
        wait_all_sources<Remote>(args.peers, args.map, args.half, LowLatencyOp::kCombine, num_uses + 1,
                                 WaitPhase::kLowLatencyCombineRecv, args.in.combine_wait_recv_cost_stats,
                                 args.shape, args.mask, &small.left_out, all & ~awaited);
      }
    }
    finish_receive(args.peers, args.map, args.half, LowLatencyOp::kCombine, num_uses);
    stamp_phase(args.phase_stamps, kStampExit);
  }
}

template <typename Remote>
void launch_low_latency_combine_with(const LowLatencyCombineArgs& args, cudaStream_t stream) {
  const size_t smem_bytes = combine_smem_bytes(args.map, args.in.use_logfmt);
  const auto kernel = args.in.use_logfmt
                          ? (args.in.pre_reduce ? combine<Remote, true, true> : combine<Remote, true, false>)
                      : args.in.pre_reduce ? combine<Remote, false, true>
                                           : combine<Remote, false, false>;
  allow_dynamic_smem(kernel, smem_bytes);
  launch(kernel, {unsigned(args.num_blocks), kNumThreads, smem_bytes, Residency::kCoResident}, stream, args);
}

template <typename Remote>
void preload_low_latency_combine_with() {
  preload_kernel(combine<Remote, false, false>);
  preload_kernel(combine<Remote, true, false>);
  preload_kernel(combine<Remote, false, true>);
  preload_kernel(combine<Remote, true, true>);
}

}  // namespace

}  // namespace epx::kernels
