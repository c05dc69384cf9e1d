#pragma once

#include <cstdint>

#include "core/wait_record.hpp"
#include "device/ptx.cuh"
#include "epx/common/tagged_word.hpp"

namespace epx::device {

// What every bounded wait needs to report a timeout: who is waiting, for how long at most, and where the
// host-mapped record lives.
struct WaitContext {
  WaitTimeoutRecord* record;  // host-mapped; written once, by the first waiter that gives up
  int rank;
  uint64_t timeout_ns;
};

// Writes the record (first failure wins) and traps so the launch fails instead of hanging.
__device__ __forceinline__ void report_and_trap(const WaitContext& ctx, int peer, WaitPhase phase,
                                                int64_t expected, int64_t seen, uint64_t waited_ns) {
  if (atomicCAS(&ctx.record->flag, 0, -1) == 0) {
    ctx.record->rank = ctx.rank;
    ctx.record->peer = peer;
    ctx.record->phase = static_cast<int32_t>(phase);
    ctx.record->expected = expected;
    ctx.record->seen = seen;
    ctx.record->waited_ns = static_cast<int64_t>(waited_ns);
    __threadfence_system();
    atomicExch(&ctx.record->flag, 1);
    __threadfence_system();
  }
  __trap();
}

// The one spin-wait of EPX: spins with `load` (an acquire load) of `address` until done(value), bounded by
// ctx.timeout_ns; on timeout reports `expected` and the value seen. Returns the value that ended it.
template <typename Load, typename Done>
__device__ __forceinline__ int wait_until_loaded(Load load, const int* address, Done done, int64_t expected,
                                                 const WaitContext& ctx, int peer, WaitPhase phase) {
  int value = load(address);
  if (done(value)) return value;
  const uint64_t start = global_timer_ns();
  while (true) {
    value = load(address);
    if (done(value)) return value;
    const uint64_t waited = global_timer_ns() - start;
    if (waited > ctx.timeout_ns) report_and_trap(ctx, peer, phase, expected, value, waited);
  }
}

// For words written by peers or the host: system-scope acquire loads.
template <typename Done>
__device__ __forceinline__ int wait_until(const int* address, Done done, int64_t expected,
                                          const WaitContext& ctx, int peer, WaitPhase phase) {
  return wait_until_loaded([](const int* a) { return ld_acquire_sys(a); }, address, done, expected, ctx, peer,
                           phase);
}

// For words this GPU's own blocks write: gpu-scope acquire loads, served by L2 without system traffic.
template <typename Done>
__device__ __forceinline__ int wait_until_gpu(const int* address, Done done, int64_t expected,
                                              const WaitContext& ctx, int peer, WaitPhase phase) {
  return wait_until_loaded([](const int* a) { return ld_acquire_gpu(a); }, address, done, expected, ctx, peer,
                           phase);
}

// Waits until *address >= expected. Returns the value seen.
__device__ __forceinline__ int wait_at_least(const int* address, int expected, const WaitContext& ctx,
                                             int peer, WaitPhase phase) {
  return wait_until(
      address, [expected](int value) { return value >= expected; }, expected, ctx, peer, phase);
}

// For monotonic counters that may wrap: waits until *counter - base >= needed (unsigned difference) and
// returns that difference.
__device__ __forceinline__ int wait_count_since(const uint32_t* counter, uint32_t base, int needed,
                                                const WaitContext& ctx, int peer, WaitPhase phase) {
  const auto since = [base](int value) {
    return static_cast<int>(static_cast<uint32_t>(value) - base);
  };  // count_since
  const int value = wait_until(
      reinterpret_cast<const int*>(counter), [&](int v) { return since(v) >= needed; },
      static_cast<int64_t>(static_cast<uint32_t>(base + needed)), ctx, peer, phase);
  return since(value);
}

// 64-bit monotonic counters (NVSHMEM signal words): waits until *counter - base >= needed and returns that
// difference.
__device__ __forceinline__ int64_t wait_count_since_u64(const uint64_t* counter, uint64_t base,
                                                        int64_t needed, const WaitContext& ctx, int peer,
                                                        WaitPhase phase) {
  uint64_t value = ld_acquire_sys_u64(counter);
  if (static_cast<int64_t>(value - base) >= needed) return static_cast<int64_t>(value - base);
  const uint64_t start = global_timer_ns();
  while (true) {
    value = ld_acquire_sys_u64(counter);
    if (static_cast<int64_t>(value - base) >= needed) return static_cast<int64_t>(value - base);
    const uint64_t waited = global_timer_ns() - start;
    if (waited > ctx.timeout_ns)
      report_and_trap(ctx, peer, phase, static_cast<int64_t>(base) + needed, static_cast<int64_t>(value),
                      waited);
  }
}

// Tagged words (pack_tagged): waits until the word at `address` carries `sequence` and returns its value.
// The value travels in the word the tag does, so a relaxed load suffices.
__device__ __forceinline__ int wait_tagged(const uint64_t* address, uint32_t sequence, const WaitContext& ctx,
                                           int peer, WaitPhase phase) {
  uint64_t word = ld_relaxed_sys_u64(address);
  if (tagged_sequence(word) == sequence) return tagged_value(word);
  const uint64_t start = global_timer_ns();
  while (true) {
    word = ld_relaxed_sys_u64(address);
    if (tagged_sequence(word) == sequence) return tagged_value(word);
    const uint64_t waited = global_timer_ns() - start;
    if (waited > ctx.timeout_ns) report_and_trap(ctx, peer, phase, sequence, tagged_sequence(word), waited);
  }
}

// A spin that polls several sources without blocking on any of them: restart() whenever something moved,
// check() after a round in which nothing did; it reports (and traps) once nothing moved for the timeout.
struct StallClock {
  uint64_t since = 0;
  __device__ void restart() { since = global_timer_ns(); }
  __device__ void check(const WaitContext& ctx, int peer, WaitPhase phase, int64_t expected,
                        int64_t seen) const {
    const uint64_t waited = global_timer_ns() - since;
    if (waited > ctx.timeout_ns) report_and_trap(ctx, peer, phase, expected, seen, waited);
  }
};

}  // namespace epx::device
