#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace epx::bootstrap {

inline constexpr int kMaxRanks = 64;
inline constexpr size_t kMessageBytes = 2048;

enum class CollectiveKind : uint32_t { kNone = 0, kBarrier = 1, kAllGather = 2 };
const char* collective_name(CollectiveKind kind);

// How a rank left its worker; lets peers fail at once instead of waiting for the launcher to notice.
enum class ExitState : uint32_t { kRunning = 0, kReturned = 1, kFailed = 2 };

// What a rank passed to one collective. Two per rank, by collective index parity: a rank writes call c's
// record only after every rank arrived at call c-1, hence after everyone finished reading call c-2's.
struct CallRecord {
  uint64_t collective_idx;
  uint64_t bytes;
  CollectiveKind kind;
};

struct alignas(64) RankState {
  // Collectives this rank has arrived at. Stored with release after its CallRecord and gather slot are
  // written, so a peer that acquires num_arrived > c may read them for call c.
  std::atomic<uint64_t> num_arrived;
  std::atomic<ExitState> exit_state;  // set with release after `message` and `exit_time_ns` are written
  // steady_clock (CLOCK_MONOTONIC, shared by all processes) when the worker ended, so the launcher can list
  // the root cause before the failures it caused in peers.
  int64_t exit_time_ns;
  CallRecord calls[2];
  char message[kMessageBytes];  // what() of the exception that ended the worker
};

struct SegmentHeader {
  int num_ranks;
  uint64_t max_gather_bytes;
  uint64_t slot_stride_bytes;
  // Written only by the launcher (one writer): abort_rank and abort_reason first, then aborted (release).
  std::atomic<uint32_t> aborted;
  int abort_rank;
  char abort_reason[kMessageBytes];
  RankState ranks[kMaxRanks];
};

static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared-memory atomics must be lock-free");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "shared-memory atomics must be lock-free");
static_assert(std::atomic<ExitState>::is_always_lock_free, "shared-memory atomics must be lock-free");

// Copies `text` into a fixed buffer, truncating, always NUL-terminated.
void copy_message(char (&buffer)[kMessageBytes], const std::string& text);

// An anonymous MAP_SHARED mapping: created before fork, so every child sees the same pages and no name
// is left behind in /dev/shm. Map: SegmentHeader, then 2 * num_ranks gather slots.
class SharedSegment {
 public:
  SharedSegment(int num_ranks, size_t max_gather_bytes);
  ~SharedSegment();
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;

  SegmentHeader& header() const { return *header_; }
  std::byte* slot(uint64_t collective_idx, int rank) const;

  // Launcher side: makes every pending and later collective fail, naming `rank` and `reason`.
  void abort(int rank, const std::string& reason);

 private:
  void* base_ = nullptr;
  size_t total_bytes_ = 0;
  size_t data_offset_ = 0;
  SegmentHeader* header_ = nullptr;
};

}  // namespace epx::bootstrap
