#pragma once

#include <cstdint>

#include "common/counter.hpp"
#include "common/tagged_word.hpp"
#include "core/abort_word.hpp"
#include "core/wait_record.hpp"
#include "device/ptx.cuh"

namespace epx::device {

// What every bounded wait needs to report a timeout: who is waiting, for how long at most, where the
// host-mapped record lives, and the abort words that stop every wait of the group (core/abort_word.hpp).
struct WaitContext {
  FailureRecord* record;  // host-mapped; written once, by the first waiter that gives up or stops
  int rank;
  uint64_t timeout_ns;
  AbortWords abort;
};

// A wait that already missed polls the abort word once in this many spins: a peer's abort is seen within
// microseconds, and the spin on the awaited word keeps its pace.
constexpr uint32_t kAbortPollSpins = 16;

__device__ __forceinline__ int32_t read_abort_word(const WaitContext& ctx) {
  return ld_relaxed_sys(ctx.abort.local);
}

// Writes the record unless another waiter of this rank already did (the first one explains the failure).
__device__ __forceinline__ void write_wait_record(const WaitContext& ctx, int peer, WaitPhase phase,
                                                  int64_t expected, int64_t seen, uint64_t waited_ns,
                                                  int32_t abort_word, int32_t detail = 0) {
  if (atomicCAS(&ctx.record->flag, 0, -1) != 0) return;
  ctx.record->rank = ctx.rank;
  ctx.record->peer = peer;
  ctx.record->phase = static_cast<int32_t>(phase);
  ctx.record->expected = expected;
  ctx.record->seen = seen;
  ctx.record->waited_ns = static_cast<int64_t>(waited_ns);
  ctx.record->abort_word = abort_word;
  ctx.record->detail = detail;
  __threadfence_system();
  atomicExch(&ctx.record->flag, 1);
  __threadfence_system();
}

// This rank gives up (a timeout, a capacity error, a peer's shapes that differ): records why, then raises the
// abort word here and in every peer of the NVLink node, so every bounded wait of the group stops. The caller
// returns afterwards; nothing traps, so the CUDA context survives. NOTES: the record is written before the
// word, so a waiter of this rank that sees the word finds the record taken and the host reports this cause,
// not a released waiter's. Ranks on other nodes are not reached: they give up by their own bounds.
__device__ __forceinline__ void raise_abort(const WaitContext& ctx, int peer, WaitPhase phase,
                                            int64_t expected, int64_t seen, uint64_t waited_ns,
                                            int32_t detail = 0) {
  write_wait_record(ctx, peer, phase, expected, seen, waited_ns, 0, detail);
  const int32_t word = encode_abort_word(ctx.rank, peer, phase);
  if (atomicCAS_system(ctx.abort.local, 0, word) != 0) return;  // the group is aborted already
  for (int r = 0; r < ctx.abort.num_ranks; ++r) {
    if (r == ctx.rank || ctx.abort.peers[r] == nullptr) continue;
    atomicCAS_system(ctx.abort.peers[r], 0, word);
  }
  __threadfence_system();
}

// A wait of this rank stopped because the group was aborted (`word`): recorded with where it stopped.
__device__ __forceinline__ void note_abort(const WaitContext& ctx, int peer, WaitPhase phase,
                                           int64_t expected, int64_t seen, int32_t word) {
  write_wait_record(ctx, peer, phase, expected, seen, 0, word);
}

// Called by every thread of a block at the start of a kernel whose inputs may come from an aborted phase:
// true (for the whole block) when the group was aborted, and the kernel must then skip its work. Records
// that `phase` was skipped, unless the record already holds a cause. `before_barrier` runs in thread 0 just
// before the block's barrier, so what it writes to shared memory is visible to the block afterwards (a load
// the caller issued earlier in thread 0 overlaps the abort word's).
template <typename BeforeBarrier>
__device__ __forceinline__ bool block_sees_abort(const WaitContext& ctx, WaitPhase phase,
                                                 BeforeBarrier before_barrier) {
  int32_t word = 0;
  if (threadIdx.x == 0) {
    word = read_abort_word(ctx);
    if (word != 0) note_abort(ctx, -1, phase, 0, 0, word);
    before_barrier();
  }
  return __syncthreads_or(word != 0) != 0;
}

__device__ __forceinline__ bool block_sees_abort(const WaitContext& ctx, WaitPhase phase) {
  return block_sees_abort(ctx, phase, [] {});
}

// How a wait ended. kTimedOut only comes from waits that do not abort on timeout (rank masks, enable_shrink):
// the bound ran out and nothing was recorded or raised; the caller decides (it masks the peer).
enum class WaitOutcome : int { kArrived, kAborted, kTimedOut };

// What a wait does when its bound runs out.
enum class OnTimeout : int { kAbortGroup, kGiveUp };

// The slow part of every wait, after the first look missed: spins with `load()` until done(value). Ends
// kAborted when the group is aborted, and when the bound runs out either raises the abort (kAbortGroup, then
// kAborted) or gives up quietly (kGiveUp, then kTimedOut). `value` holds the last value seen; `seen(value)`
// is what a record reports of it.
template <typename T, typename Load, typename Done, typename Seen>
__device__ __forceinline__ WaitOutcome spin_until_outcome(Load load, Done done, Seen seen, int64_t expected,
                                                          const WaitContext& ctx, int peer, WaitPhase phase,
                                                          OnTimeout on_timeout, T& value) {
  const uint64_t start = global_timer_ns();
  for (uint32_t spin = 0;; ++spin) {
    value = load();
    if (done(value)) return WaitOutcome::kArrived;
    if (spin % kAbortPollSpins == kAbortPollSpins - 1) {
      const int32_t word = read_abort_word(ctx);
      if (word != 0) {
        // A value published before the abort was raised still counts (the abort's fence orders it first).
        __threadfence_system();
        value = load();
        if (done(value)) return WaitOutcome::kArrived;
        note_abort(ctx, peer, phase, expected, seen(value), word);
        return WaitOutcome::kAborted;
      }
    }
    const uint64_t waited = global_timer_ns() - start;
    if (waited > ctx.timeout_ns) {
      if (on_timeout == OnTimeout::kGiveUp) return WaitOutcome::kTimedOut;
      raise_abort(ctx, peer, phase, expected, seen(value), waited);
      return WaitOutcome::kAborted;
    }
  }
}

// As spin_until_outcome, aborting the group on timeout: true when the value arrived, false when the wait was
// abandoned (the group is aborted, or the bound ran out and this rank raised the abort).
template <typename T, typename Load, typename Done, typename Seen>
__device__ __forceinline__ bool spin_until_loaded(Load load, Done done, Seen seen, int64_t expected,
                                                  const WaitContext& ctx, int peer, WaitPhase phase,
                                                  T& value) {
  return spin_until_outcome(load, done, seen, expected, ctx, peer, phase, OnTimeout::kAbortGroup, value) ==
         WaitOutcome::kArrived;
}

template <typename Done>
__device__ __forceinline__ bool spin_until(const int* address, Done done, int64_t expected,
                                           const WaitContext& ctx, int peer, WaitPhase phase, int& value) {
  return spin_until_loaded([address] { return ld_acquire_sys(address); }, done,
                           [](int v) { return static_cast<int64_t>(v); }, expected, ctx, peer, phase, value);
}

// The one spin-wait of EPX: acquire loads of `address` until done(value), bounded by ctx.timeout_ns. Returns
// the value that ended it, or, when the wait was abandoned (timeout or abort), `expected` as if the wait had
// succeeded: every loop built on waits then finishes quickly, and callers that turn what they read into
// addresses clamp it (the audit in docs/RELIABILITY.md). The first look is the whole fast path.
template <typename Done>
__device__ __forceinline__ int wait_until(const int* address, Done done, int64_t expected,
                                          const WaitContext& ctx, int peer, WaitPhase phase) {
  int value = ld_acquire_sys(address);
  if (done(value)) return value;
  return spin_until(address, done, expected, ctx, peer, phase, value) ? value : static_cast<int>(expected);
}

// Tagged words (pack_tagged): waits until the word at `address` carries `sequence`; `value` gets its value.
// Returns whether it arrived (false: the wait was abandoned), for callers that turn the value into an
// address. The value travels in the word the tag does, so a relaxed load suffices.
__device__ __forceinline__ bool try_wait_tagged(const uint64_t* address, uint32_t sequence,
                                                const WaitContext& ctx, int peer, WaitPhase phase,
                                                int& value) {
  uint64_t word = ld_relaxed_sys_u64(address);
  const auto done = [sequence](uint64_t w) { return tagged_sequence(w) == sequence; };
  const bool arrived =
      done(word) || spin_until_loaded([address] { return ld_relaxed_sys_u64(address); }, done,
                                      [](uint64_t w) { return static_cast<int64_t>(tagged_sequence(w)); },
                                      sequence, ctx, peer, phase, word);
  value = tagged_value(word);
  return arrived;
}

// As try_wait_tagged, returning the value (0 when abandoned).
__device__ __forceinline__ int wait_tagged(const uint64_t* address, uint32_t sequence, const WaitContext& ctx,
                                           int peer, WaitPhase phase) {
  int value = 0;
  return try_wait_tagged(address, sequence, ctx, peer, phase, value) ? value : 0;
}

// Waits until *address >= expected (counter_reached: modulo 2^32). Returns the value seen (expected when
// abandoned).
__device__ __forceinline__ int wait_at_least(const int* address, int expected, const WaitContext& ctx,
                                             int peer, WaitPhase phase) {
  return wait_until(
      address, [expected](int value) { return counter_reached(value, expected); }, expected, ctx, peer,
      phase);
}

// As wait_at_least, but says whether the value really arrived (false: the wait was abandoned), for callers
// that must not read what the awaited signal guards.
__device__ __forceinline__ bool try_wait_at_least(const int* address, int expected, const WaitContext& ctx,
                                                  int peer, WaitPhase phase) {
  const auto done = [expected](int value) { return counter_reached(value, expected); };
  int value = ld_acquire_sys(address);
  return done(value) || spin_until(address, done, expected, ctx, peer, phase, value);
}

// As try_wait_at_least, but the caller chooses what a timeout does; with OnTimeout::kGiveUp a wait that
// runs out returns kTimedOut and leaves the group running (rank masks with enable_shrink).
__device__ __forceinline__ WaitOutcome wait_at_least_outcome(const int* address, int expected,
                                                             const WaitContext& ctx, int peer,
                                                             WaitPhase phase, OnTimeout on_timeout) {
  const auto done = [expected](int value) { return counter_reached(value, expected); };
  int value = ld_acquire_sys(address);
  if (done(value)) return WaitOutcome::kArrived;
  return spin_until_outcome([address] { return ld_acquire_sys(address); }, done,
                            [](int v) { return static_cast<int64_t>(v); }, expected, ctx, peer, phase,
                            on_timeout, value);
}

// For monotonic counters that may wrap: waits until *counter - base >= needed (unsigned difference) and
// returns that difference (`needed` when abandoned).
__device__ __forceinline__ int wait_count_since(const uint32_t* counter, uint32_t base, int needed,
                                                const WaitContext& ctx, int peer, WaitPhase phase) {
  const auto since = [base](int value) {
    return static_cast<int>(static_cast<uint32_t>(value) - base);
  };  // count_since
  const int value = wait_until(
      reinterpret_cast<const int*>(counter), [since, needed](int v) { return since(v) >= needed; },
      static_cast<int64_t>(static_cast<uint32_t>(base + needed)), ctx, peer, phase);
  return since(value);
}

// 64-bit monotonic counters (NVSHMEM signal words): waits until *counter - base >= needed and returns that
// difference (`needed` when abandoned).
__device__ __forceinline__ int64_t wait_count_since_u64(const uint64_t* counter, uint64_t base,
                                                        int64_t needed, const WaitContext& ctx, int peer,
                                                        WaitPhase phase) {
  const auto done = [base, needed](uint64_t v) { return static_cast<int64_t>(v - base) >= needed; };
  uint64_t value = ld_acquire_sys_u64(counter);
  if (done(value)) return static_cast<int64_t>(value - base);
  const bool arrived = spin_until_loaded([counter] { return ld_acquire_sys_u64(counter); }, done,
                                         [](uint64_t v) { return static_cast<int64_t>(v); },
                                         static_cast<int64_t>(base) + needed, ctx, peer, phase, value);
  return arrived ? static_cast<int64_t>(value - base) : needed;
}

// A spin that polls several sources without blocking on any of them: restart() whenever something moved,
// check() after a round in which nothing did. check() returns true when the loop must stop polling: the
// group is aborted (looked at every kAbortPollSpins idle rounds), or nothing moved for the timeout (this
// rank then raises the abort). The caller leaves its loop then, without reading what it waited for.
// `peer_of()` names the peer waited for; it runs only when the loop stops (the report), not every idle round.
struct StallClock {
  uint64_t since = 0;
  uint32_t idle_rounds = 0;
  __device__ void restart() { since = global_timer_ns(); }
  template <typename PeerOf>
  __device__ bool check_naming(const WaitContext& ctx, PeerOf peer_of, WaitPhase phase, int64_t expected,
                               int64_t seen) {
    if (++idle_rounds % kAbortPollSpins == 0) {
      const int32_t word = read_abort_word(ctx);
      if (word != 0) {
        note_abort(ctx, peer_of(), phase, expected, seen, word);
        return true;
      }
    }
    const uint64_t waited = global_timer_ns() - since;
    if (waited <= ctx.timeout_ns) return false;
    raise_abort(ctx, peer_of(), phase, expected, seen, waited);
    return true;
  }
  __device__ bool check(const WaitContext& ctx, int peer, WaitPhase phase, int64_t expected, int64_t seen) {
    return check_naming(
        ctx, [peer] { return peer; }, phase, expected, seen);
  }
};

}  // namespace epx::device
