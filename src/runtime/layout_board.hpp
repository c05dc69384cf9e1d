#pragma once

// The host side of the layout board (src/buffer_map/layout_board_map.hpp), on one node: get_dispatch_layout
// posts each rank's counts there for the notify after it; that notify marks on every rank's row whether its
// dispatch sends what its layout posted, and its host reads its counts off its own row before any launch.
#include <cstdint>
#include <vector>

#include "buffer_map/layout_board_map.hpp"
#include "epx/buffer.hpp"
#include "epx/normal.hpp"
#include "kernels/normal_kernels.hpp"
#include "runtime/buffer_access.hpp"
#include "runtime/normal_host_scratch.hpp"

namespace epx {

// Where a notify's host may also find its counts: its half of the layout board, posted by every rank's
// get_dispatch_layout (src/buffer_map/layout_board_map.hpp).
struct BoardCounts {
  const volatile uint64_t* half;
  LayoutBoardMap map;
  int num_local_experts;
  int expert_alignment;
  bool with_experts;
};

// Whether the dispatch of `in` for notify `sequence` sends what the last layout posted on the board (`post`):
// its inputs are that layout's outputs, the per-rank totals among them.
bool layout_post_matches(const NormalHostScratch::LayoutPost& post, const DispatchInput& in,
                         uint32_t sequence);

// Marks on every rank's row of the board whether this rank's dispatch for notify `sequence` sends what its
// layout posted there (LayoutBoardMap::mark_word).
void mark_posted_counts(const BufferAccess::LayoutBoard& board, int rank, uint32_t sequence, bool hold);

// Spins until every source's layout posted this rank's counts for `sequence` on the board and its host marked
// that they hold (true, `values` filled in HostCountIndex's order); false when one of them marked that they
// do not, or after a bounded wait (at most a quarter of the Buffer's wait bound): the count exchange must
// then run before the host has its counts.
bool wait_for_board(const Buffer& buffer, const BoardCounts& board, uint32_t sequence,
                    const kernels::HostCountIndex& index, std::vector<int>& values);

}  // namespace epx
