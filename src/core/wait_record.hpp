#pragma once

#include <cstdint>
#include <string>

namespace epx {

// Where a device-side wait gave up. Kernels write one FailureRecord into host-mapped memory, raise the
// abort word (core/abort_word.hpp) and return; the host reads the record at its next check.
enum class WaitPhase : int32_t {
  kNone = 0,
  kBarrier = 1,          // ranks meeting at an NVLink barrier
  kDispatchNotify = 2,   // normal dispatch: waiting for peers' published counts
  kDispatchReceive = 3,  // normal dispatch: rows still arriving / capacity
  kCombineReduce = 4,    // normal combine: waiting for peers' returned rows
  kLowLatencyDispatchRecv = 5,
  kLowLatencyCombineRecv = 6,
  kCapacity = 7,                 // a count exceeded what the caller sized for (e.g. num_worst_tokens)
  kDispatchSend = 8,             // normal dispatch: waiting for room in a peer's queue
  kCombineSend = 9,              // normal combine: likewise
  kPreviousCall = 10,            // normal mode: waiting for a peer to finish its previous dispatch or combine
  kLowLatencyDispatchSend = 11,  // low latency: the send phase (only skipped, never waits)
  kLowLatencyCombineSend = 12,
  kShapeMismatch = 13,    // not a wait: a peer's shape fingerprint differs (core/shape_fingerprint.hpp)
  kDispatchOutputs = 14,  // normal dispatch: a receive launched early, waiting for the host's output pointers
  // Not a wait: a peer's num_tokens_per_rank (expected) disagrees with its is_token_in_rank (seen) for this
  // rank, so the outputs sized by it would not hold the rows.
  kRankCounts = 15,
  // Not a wait: a peer's get_dispatch_layout posted other rows for this rank than its dispatch sends
  // (expected: what it sends, seen: what it posted: the layout's outputs were changed in place), so this
  // rank's host sized its outputs wrongly. Peer -1: the outputs hold `expected` rows and `seen` arrive.
  kLayoutCounts = 16,
};

const char* wait_phase_name(WaitPhase phase);

// What stopped this rank, written once by the first device thread that gives up (host-mapped, so the host
// reads it without a copy): a bounded wait that ran out, a capacity check, a shape mismatch, or another
// rank's abort seen by a wait.
struct FailureRecord {
  int32_t flag;  // 0 = nothing happened; set last, so the other fields are complete when it is seen
  int32_t rank;
  int32_t peer;
  int32_t phase;  // a WaitPhase
  int64_t expected;
  int64_t seen;
  int64_t waited_ns;
  // 0: this rank's own wait gave up. Else the abort word this rank saw (another rank gave up first) and
  // `peer`/`phase` say where this rank was when it stopped (peer -1: at the start of a kernel).
  int32_t abort_word;
  int32_t detail;  // kShapeMismatch: the ShapeField that differs (expected: this rank's value, seen: peer's)
};

// "rank 1 timed out after 10.0 s waiting for peer 3 in barrier: expected >= 7, saw 6", or, for a rank
// released by another rank's abort, where it stopped and what the first rank reported.
std::string describe_failure(const FailureRecord& record);

// A consistent copy of a record that kernels may be writing (host-mapped): the flag is written last, after a
// system fence, so the other fields are complete once it reads 1; a copy whose flag is not 1 holds nothing
// else.
FailureRecord snapshot_failure_record(const FailureRecord& mapped);

}  // namespace epx
