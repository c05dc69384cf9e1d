#include "runtime/layout_board.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>

#include "common/tagged_word.hpp"

namespace epx {

namespace {

// The counts in HostCountIndex's order from the board, when every source posted them under `sequence`.
Posted read_board_counts(const Buffer& buffer, const BoardCounts& board, uint32_t sequence,
                         const kernels::HostCountIndex& index, std::vector<int>& values) {
  PostedCounts posted{};
  int* expert_rows = board.with_experts ? values.data() + index.expert(0) : nullptr;
  const Posted state = read_posted_counts(board.half, board.map, sequence, board.num_local_experts,
                                          board.expert_alignment, posted, expert_rows);
  if (state != Posted::kAll) return state;
  values[index.rows()] = posted.rows;
  std::copy_n(posted.rows_from, board.map.num_ranks, values.begin() + index.rows_from(0));
  // The layout kernel set the flag before it posted this rank's own words, which are among those read.
  std::atomic_thread_fence(std::memory_order_acquire);
  values[index.invalid_id()] = *static_cast<const volatile int*>(&normal_host_scratch(buffer).invalid_id);
  return Posted::kAll;
}

// How long a host spins on the layout board before it runs the count exchange instead: a peer that comes
// later than this (a straggler, a rank that skipped the call or died) is then waited for by the exchange's
// bounded device waits, which name it and abort the group. The host waits for that peer either way; the
// quarter of the wait bound keeps a missing peer reported soon after the bound.
constexpr uint64_t kBoardWaitNs = 250'000'000;

}  // namespace

bool layout_post_matches(const NormalHostScratch::LayoutPost& post, const DispatchInput& in,
                         uint32_t sequence) {
  return in.num_tokens_per_rank != nullptr && post.sequence == sequence &&
         post.num_tokens_per_rank == in.num_tokens_per_rank && post.num_experts == in.num_experts &&
         (in.num_tokens_per_expert == nullptr || in.num_tokens_per_expert == post.num_tokens_per_expert);
}

void mark_posted_counts(const BufferAccess::LayoutBoard& board, int rank, uint32_t sequence, bool hold) {
  for (int dest = 0; dest < board.map.num_ranks; ++dest) {
    const size_t mark = board.map.slot(dest, sequence, rank) + board.map.mark_word();
    *static_cast<volatile uint64_t*>(board.host + mark) =
        pack_tagged(sequence, hold ? kPostedCountsHold : kNothingPosted);
  }
}

bool wait_for_board(const Buffer& buffer, const BoardCounts& board, uint32_t sequence,
                    const kernels::HostCountIndex& index, std::vector<int>& values) {
  const uint64_t bound_ns = std::min(kBoardWaitNs, buffer.wait_timeout_ns() / 4);
  const auto start = std::chrono::steady_clock::now();
  for (uint64_t spin = 0;; ++spin) {
    const Posted state = read_board_counts(buffer, board, sequence, index, values);
    if (state != Posted::kPending) {
      normal_host_scratch(buffer).count_wait_ns += elapsed_ns(start);
      return state == Posted::kAll;
    }
    if (spin % 1024 != 1023) continue;
    const uint64_t waited = elapsed_ns(start);
    if (waited > bound_ns) {
      normal_host_scratch(buffer).count_wait_ns += waited;
      return false;
    }
  }
}

}  // namespace epx
