#pragma once

#include <cstddef>
#include <cstdint>

#include "buffer_map/normal_buffer_map.hpp"
#include "common/host_device.hpp"
#include "common/tagged_word.hpp"

namespace epx {

// The layout board: host memory shared by the ranks of a one-node group (every rank maps it, and so does
// every rank's GPU) where get_dispatch_layout posts what the dispatch after it will send each rank: the
// tokens, then the tokens for each of that rank's experts, as tagged words carrying the sequence of the
// notify that follows the layout. A rank's host then reads its dispatch's counts from its own row as soon as
// the peers' layouts ran, without waiting for a kernel launched by dispatch_notify; the notify kernel checks
// them against what the peers' dispatches actually send (WaitPhase::kLayoutCounts).
//
// Map: row `dest` (the rank whose host reads it), then the sequence's parity (the next layout posts into
// the other half while a notify still checks this one), then source rank, then words_per_source() words:
// [0] tokens from the source, [1 + le] its tokens for local expert le of `dest`, and last the source host's
// mark (kPostedCountsHold or kNothingPosted with the sequence; no kernel writes it).
struct LayoutBoardMap {
  int num_ranks;

  EPX_HD int words_per_source() const { return 2 + kMaxExperts / num_ranks; }
  EPX_HD int mark_word() const { return words_per_source() - 1; }
  // First word of what `src` posted for `dest` under `sequence`.
  EPX_HD size_t slot(int dest, uint32_t sequence, int src) const {
    return ((static_cast<size_t>(dest) * 2 + (sequence & 1u)) * num_ranks + src) * words_per_source();
  }
  // First word of `dest`'s half for `sequence` (the slot of source 0).
  EPX_HD size_t row(int dest, uint32_t sequence) const { return slot(dest, sequence, 0); }
  // Words of `dest`'s row, both halves (what reset() clears).
  EPX_HD size_t row_words() const { return 2 * static_cast<size_t>(num_ranks) * words_per_source(); }
  EPX_HD size_t num_words() const { return static_cast<size_t>(num_ranks) * row_words(); }
  EPX_HD size_t num_bytes() const { return num_words() * sizeof(uint64_t); }
};

// What a rank's host reads off its row: the rows it receives from each source and its local experts' rows,
// summed over sources and aligned up to `expert_alignment` (as notify computes them).
struct PostedCounts {
  int rows_from[kMaxNvlRanks];
  int rows;
};

// The mark's values, written by a source's host when its dispatch_notify starts: its dispatch sends what its
// layout posted under the mark's sequence (it passes that layout's outputs), or its counts must come from the
// count exchange (no layout posted for this notify, or its dispatch passes other counts).
constexpr int kPostedCountsHold = 1;
constexpr int kNothingPosted = -1;

enum class Posted {
  kAll,      // every source posted under the sequence and marked that its counts hold: the counts are read
  kPending,  // some source has not (yet) posted or marked
  kNone,     // some source marked that its counts come from the count exchange
};

// Reads `half` (a rank's half for `sequence`, LayoutBoardMap::row): when every source posted under
// `sequence`, fills `counts` and `expert_rows` ([num_local_experts], when not null).
inline Posted read_posted_counts(const volatile uint64_t* half, const LayoutBoardMap& map, uint32_t sequence,
                                 int num_local_experts, int expert_alignment, PostedCounts& counts,
                                 int* expert_rows) {
  const int stride = map.words_per_source();
  bool pending = false;
  counts.rows = 0;
  for (int src = 0; src < map.num_ranks; ++src) {
    const volatile uint64_t* slot = half + static_cast<size_t>(src) * stride;
    const uint64_t mark = slot[map.mark_word()];
    if (mark == pack_tagged(sequence, kNothingPosted)) return Posted::kNone;
    const uint64_t word = slot[0];
    pending |= mark != pack_tagged(sequence, kPostedCountsHold) || tagged_sequence(word) != sequence;
    counts.rows_from[src] = tagged_value(word);
    counts.rows += counts.rows_from[src];
  }
  if (pending) return Posted::kPending;
  if (expert_rows == nullptr) return Posted::kAll;
  for (int le = 0; le < num_local_experts; ++le) {
    int sum = 0;
    for (int src = 0; src < map.num_ranks; ++src) {
      const uint64_t word = half[static_cast<size_t>(src) * stride + 1 + le];
      if (tagged_sequence(word) != sequence) return Posted::kPending;
      sum += tagged_value(word);
    }
    expert_rows[le] = (sum + expert_alignment - 1) / expert_alignment * expert_alignment;
  }
  return Posted::kAll;
}

}  // namespace epx
