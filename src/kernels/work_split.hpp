#pragma once

#include <cstddef>
#include <cstdint>

#include "common/host_device.hpp"

// How the low-latency kernels split their work over the grid: plain arithmetic shared by the kernels and the
// CPU tests (tests/cpu/test_work_split.cpp), so each split is checked to cover its work exactly once.
namespace epx::kernels {

// ---- Row pieces ----
// Rows are copied in pieces of at most kRowPieceWords 16-byte words, one warp per piece: a warp issues every
// load of its piece before its first store (one round trip per piece), and a call with few rows spreads each
// row over several warps instead of leaving it to one warp's serial rounds.
constexpr int kRowPieceUnroll = 16;
constexpr int kRowPieceWords = kRowPieceUnroll * 32;  // 8 KiB

// Pieces of a row of `bytes` (a multiple of 16).
EPX_HD int row_pieces(size_t bytes) {
  const int words = static_cast<int>(bytes / 16);
  return words <= kRowPieceWords ? 1 : (words + kRowPieceWords - 1) / kRowPieceWords;
}

// The 16-byte words [begin, end) of piece `piece` of `num_pieces` of a row of `words` words.
struct WordRange {
  int begin;
  int end;
};
EPX_HD WordRange piece_words(int words, int piece, int num_pieces) {
  const int per_piece = (words + num_pieces - 1) / num_pieces;
  const int begin = piece * per_piece < words ? piece * per_piece : words;
  return {begin, begin + per_piece < words ? begin + per_piece : words};
}

// LogFMT rows are encoded in pieces of at most kLogfmtPieceGroups groups (of 128 channels), one warp per
// piece: a group's encode is a chain of dependent steps (two warp reductions, the codes, their packing), so a
// row left to one warp would take its groups in series.
constexpr int kLogfmtPieceGroups = 8;
EPX_HD int logfmt_row_pieces(int num_groups) {
  return num_groups <= kLogfmtPieceGroups ? 1 : (num_groups + kLogfmtPieceGroups - 1) / kLogfmtPieceGroups;
}

// A send with few rows splits each row into more pieces, up to one piece per warp of the grid, but never
// more than `max_pieces` (BF16: chunks / 32, so a lane has a chunk; LogFMT: the groups), nor fewer than the
// plain split's `base_pieces`. The pre-reduced combine sends one partial row per token, whose channels the
// token's n rows on this rank share (row i takes the i-th share of each piece); a LogFMT group's encode is a
// chain of dependent steps, so at 1 token eight groups per warp took 8x one group's latency.
EPX_HD int spread_row_pieces(int base_pieces, int total_rows, int num_grid_warps, int max_pieces) {
  const int spread = total_rows > 0 ? num_grid_warps / total_rows : 1;
  const int pieces = spread < max_pieces ? spread : max_pieces;
  return pieces > base_pieces ? pieces : base_pieces;
}

// ---- Publishers of a send phase ----
// The blocks that wrote anything in a send phase arrive at the per-destination counters (the others skip
// publish_sends): how many there are, and whether block `block` is one of them.
struct Publishers {
  int count;
  bool this_block;
};

// A source's receive flag grows by kLowLatencyPublishUnit per operation: every publishing block adds its
// share (publish_share: block 0, which publishes always, the rest of the unit after one per other block), so
// operation n (counted from 1) has arrived exactly when the flag reaches flag_target(n), modulo 2^32 (the
// flag wraps after 2^20 operations; waits compare with counter_reached). The unit must exceed any grid:
// launches check num_blocks < kLowLatencyPublishUnit.
constexpr int kLowLatencyPublishUnit = 1 << 12;
EPX_HD int flag_target(int num_ops) {
  return static_cast<int>(static_cast<uint32_t>(num_ops) * static_cast<uint32_t>(kLowLatencyPublishUnit));
}
EPX_HD int publish_share(int block, const Publishers& publishers) {
  return block == 0 ? kLowLatencyPublishUnit - (publishers.count - 1) : 1;
}

// Dispatch: blocks 0..T-1 send a token each (block 0 also posts the shapes, so it counts when T = 0), and the
// last block routes.
EPX_HD Publishers dispatch_publishers(int num_tokens, int num_blocks, int block) {
  const int senders = num_tokens > 1 ? num_tokens : 1;
  const int count = senders + 1 < num_blocks ? senders + 1 : num_blocks;
  return {count, block < senders || block == num_blocks - 1};
}

// ---- Items over the grid ----
// Row pieces (items) go to blocks first, then to warps: item i to block i % blocks, warp i / blocks (then
// around again). A call with few rows then spreads them over as many SMs as it can, instead of loading one
// SM's memory pipes with them while the others idle (at 1 token, 8 rows on one SM took ~3 us).
EPX_HD int first_item(int block, int warp, int num_blocks) {
  return warp * num_blocks + block;
}

// Combine: the blocks that hold any of `num_items` items are the first min(items, blocks); block 0 counts
// always (it posts the shapes).
EPX_HD Publishers combine_publishers(int num_items, int num_blocks, int block) {
  const int holding = num_items < num_blocks ? num_items : num_blocks;
  const int count = holding > 1 ? holding : 1;
  return {count, block < count};
}

// ---- Combine reduction ----
// A token's `num_chunks` 8-channel chunks are split into parts, one block each, when the grid has blocks to
// spare, down to parts of kMinPartChunks chunks (one warp's): a small call's loads then spread over many SMs.
constexpr int kMinPartChunks = 32;
EPX_HD int reduce_parts(int num_tokens, int num_blocks, int num_chunks) {
  const int spare = num_tokens > 0 ? num_blocks / num_tokens : 1;
  const int most = (num_chunks + kMinPartChunks - 1) / kMinPartChunks;
  const int parts = spare < most ? spare : most;
  return parts > 1 ? parts : 1;
}

// The chunks [begin, end) of part `part` of `parts`.
EPX_HD WordRange part_chunks(int num_chunks, int part, int parts) {
  return piece_words(num_chunks, part, parts);
}

}  // namespace epx::kernels
