#include "bootstrap/shm_bootstrap.hpp"

#include <algorithm>
#include <cstring>
#include <thread>

#include "epx/error.hpp"

namespace epx::bootstrap {
namespace {

// Yield first (peers are usually close behind), then sleep with a growing pause so that many ranks on few
// cores do not starve the one everybody waits for.
// Yields for the first kYieldFor of a wait, then sleeps, longer each time. Ranks that arrive close together
// (the common case: a barrier between GPU calls) leave within microseconds of each other; a rank that slept
// would wake up to a whole sleep after the last arrival, which is what the benchmark's barrier-aligned runs
// then measured as their own time.
class Backoff {
 public:
  void pause() {
    if (std::chrono::steady_clock::now() - start_ < kYieldFor) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(sleep_);
    sleep_ = std::min(sleep_ * 2, kMaxSleep);
  }

 private:
  static constexpr std::chrono::milliseconds kYieldFor{5};
  static constexpr std::chrono::microseconds kMaxSleep{500};
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::chrono::microseconds sleep_{10};
};

struct Arrivals {
  int num_arrived = 0;
  std::vector<int> missing_ranks;
};

Arrivals count_arrivals(const SegmentHeader& header, uint64_t collective_idx) {
  Arrivals arrivals;
  for (int peer = 0; peer < header.num_ranks; ++peer) {
    if (header.ranks[peer].num_arrived.load(std::memory_order_acquire) > collective_idx) {
      ++arrivals.num_arrived;
    } else {
      arrivals.missing_ranks.push_back(peer);
    }
  }
  return arrivals;
}

std::string join_ranks(const std::vector<int>& ranks) {
  std::string text;
  for (size_t i = 0; i < ranks.size(); ++i) text += (i == 0 ? "" : ", ") + std::to_string(ranks[i]);
  return text;
}

}  // namespace

ShmBootstrap::ShmBootstrap(SharedSegment& segment, int rank, std::chrono::milliseconds timeout)
    : segment_(segment), rank_(rank), timeout_(timeout) {
  EPX_CHECK(rank >= 0, "rank", rank, "must be >= 0");
  EPX_CHECK(rank < segment.header().num_ranks, "rank", rank, "must be < num_ranks");
  EPX_CHECK(timeout.count() > 0, "timeout_ms", timeout.count(), "must be > 0");
}

std::vector<std::byte> ShmBootstrap::all_gather(const void* data, size_t bytes) {
  EPX_CHECK(data != nullptr || bytes == 0, "data", "nullptr", "must point to `bytes` bytes when bytes > 0");
  const uint64_t collective_idx = arrive(CollectiveKind::kAllGather, data, bytes);
  wait_for_all(collective_idx, CollectiveKind::kAllGather);
  check_same_call(collective_idx, CollectiveKind::kAllGather);

  const int num_ranks = this->num_ranks();
  std::vector<std::byte> gathered(static_cast<size_t>(num_ranks) * bytes);
  if (bytes > 0) {
    for (int peer = 0; peer < num_ranks; ++peer) {
      std::memcpy(gathered.data() + static_cast<size_t>(peer) * bytes, segment_.slot(collective_idx, peer),
                  bytes);
    }
  }
  return gathered;
}

void ShmBootstrap::barrier() {
  const uint64_t collective_idx = arrive(CollectiveKind::kBarrier, nullptr, 0);
  wait_for_all(collective_idx, CollectiveKind::kBarrier);
  check_same_call(collective_idx, CollectiveKind::kBarrier);
}

uint64_t ShmBootstrap::arrive(CollectiveKind kind, const void* data, size_t bytes) {
  const uint64_t collective_idx = num_calls_++;
  RankState& state = segment_.header().ranks[rank_];
  state.calls[collective_idx % 2] = CallRecord{collective_idx, bytes, kind};
  // An oversized payload is still announced (without data) so that every rank fails the same check
  // after the wait, instead of this rank failing alone and the others waiting for it.
  if (bytes > 0 && bytes <= segment_.header().max_gather_bytes) {
    std::memcpy(segment_.slot(collective_idx, rank_), data, bytes);
  }
  state.num_arrived.store(collective_idx + 1, std::memory_order_release);
  return collective_idx;
}

void ShmBootstrap::wait_for_all(uint64_t collective_idx, CollectiveKind kind) const {
  const SegmentHeader& header = segment_.header();
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  Backoff backoff;
  while (true) {
    const Arrivals arrivals = count_arrivals(header, collective_idx);
    if (arrivals.missing_ranks.empty()) return;
    // A collective every rank reached completes even if a peer died afterwards; the next one fails.
    if (header.aborted.load(std::memory_order_acquire) != 0) {
      fail_waiting(
          collective_idx, kind,
          detail::concat("aborted: rank ", header.abort_rank, " failed (", header.abort_reason, ")"));
    }
    for (const int peer : arrivals.missing_ranks) {
      const RankState& state = header.ranks[peer];
      const ExitState exit_state = state.exit_state.load(std::memory_order_acquire);
      // Loaded after the exit state (acquire): a peer that arrived and then finished since the count above
      // shows its arrival here, and the collective completes on the next pass.
      const uint64_t num_peer_calls = state.num_arrived.load(std::memory_order_relaxed);
      if (num_peer_calls > collective_idx) continue;
      if (exit_state == ExitState::kReturned) {
        fail_waiting(collective_idx, kind,
                     detail::concat("rank ", peer, "'s worker returned after ", num_peer_calls,
                                    " collective calls, without joining this one"));
      }
      if (exit_state == ExitState::kFailed) {
        fail_waiting(collective_idx, kind,
                     detail::concat("rank ", peer, "'s worker failed after ", num_peer_calls,
                                    " collective calls: ", state.message));
      }
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      fail_waiting(collective_idx, kind,
                   detail::concat("timed out after ", timeout_.count(), " ms (LocalLaunchOptions::timeout)"));
    }
    backoff.pause();
  }
}

void ShmBootstrap::fail_waiting(uint64_t collective_idx, CollectiveKind kind, const std::string& why) const {
  const Arrivals arrivals = count_arrivals(segment_.header(), collective_idx);
  EPX_FAIL(describe(collective_idx, kind), " ", why, "; ", arrivals.num_arrived, " of ", num_ranks(),
           " ranks had arrived (missing: ", join_ranks(arrivals.missing_ranks), ")");
}

// Every rank compares against rank 0's record, so all ranks raise the same message.
void ShmBootstrap::check_same_call(uint64_t collective_idx, CollectiveKind kind) const {
  const SegmentHeader& header = segment_.header();
  const size_t parity = collective_idx % 2;
  const CallRecord& first = header.ranks[0].calls[parity];
  for (int peer = 0; peer < header.num_ranks; ++peer) {
    const CallRecord& call = header.ranks[peer].calls[parity];
    if (call.collective_idx != collective_idx) {
      EPX_FAIL(describe(collective_idx, kind), ": rank ", peer, " published call #", call.collective_idx,
               " (internal error: shared segment out of step)");
    }
    if (call.kind != first.kind) {
      EPX_FAIL(describe(collective_idx, kind), ": ranks called different collectives: rank 0 called ",
               collective_name(first.kind), ", rank ", peer, " called ", collective_name(call.kind));
    }
    if (call.bytes != first.bytes) {
      EPX_FAIL(describe(collective_idx, kind), ": ranks passed different byte counts: rank 0 passed ",
               first.bytes, " bytes, rank ", peer, " passed ", call.bytes,
               " bytes (every rank must pass the same count)");
    }
  }
  if (first.bytes > header.max_gather_bytes) {
    EPX_FAIL(describe(collective_idx, kind), ": invalid bytes = ", first.bytes,
             ": must be <= max_gather_bytes = ", header.max_gather_bytes, " (LocalLaunchOptions)");
  }
}

std::string ShmBootstrap::describe(uint64_t collective_idx, CollectiveKind kind) const {
  return detail::concat("rank ", rank_, ": ", collective_name(kind), " #", collective_idx);
}

}  // namespace epx::bootstrap
