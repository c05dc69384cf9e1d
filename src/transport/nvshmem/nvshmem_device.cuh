#pragma once

#include "transport/nvshmem/nvshmem_api.cuh"

#include <cstdint>

#include "device/ptx.cuh"
#include "device/wait.cuh"

// The NVSHMEM transport's device side: the small interface EPX kernels use to reach a rank that is not an
// NVLink peer (put a contiguous block, signal after it, complete, wait with a bound). Public NVSHMEM API
// only. Addresses are symmetric: pass this rank's address of the remote location.
namespace epx::transport::nvshmem {

// Warp-collective, non-blocking: bytes [src, src + bytes) of this rank's heap to `dst` on `rank`. `src` must
// not change until a quiet().
__device__ __forceinline__ void put_block_warp(void* dst, const void* src, size_t bytes, int rank) {
  nvshmemx_putmem_nbi_warp(dst, src, bytes, rank);
}

// One int to `rank` (blocking: `*dst` on this rank may change right after).
__device__ __forceinline__ void put_int(int* dst, int value, int rank) {
  nvshmem_int_p(dst, value, rank);
}

// Puts to `rank` issued before are delivered before those issued after (data before its signal).
__device__ __forceinline__ void fence() {
  nvshmem_fence();
}

// *signal += value on `rank`, after the puts a fence() ordered before it.
__device__ __forceinline__ void signal_add(uint64_t* signal, uint64_t value, int rank) {
  nvshmemx_signal_op(signal, value, NVSHMEM_SIGNAL_ADD, rank);
}

// *signal = value on `rank`.
__device__ __forceinline__ void signal_set(uint64_t* signal, uint64_t value, int rank) {
  nvshmemx_signal_op(signal, value, NVSHMEM_SIGNAL_SET, rank);
}

// Every put and signal this thread issued is complete (sources reusable, data visible at the target).
__device__ __forceinline__ void quiet() {
  nvshmem_quiet();
}

// Spins until this rank's *signal >= expected, bounded like every EPX wait (records and traps on timeout).
__device__ __forceinline__ uint64_t wait_signal_at_least(const uint64_t* signal, uint64_t expected,
                                                         const device::WaitContext& ctx, int peer,
                                                         WaitPhase phase) {
  const uint64_t start = device::global_timer_ns();
  while (true) {
    uint64_t value;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(signal) : "memory");
    if (value >= expected) return value;
    const uint64_t waited = device::global_timer_ns() - start;
    if (waited > ctx.timeout_ns) {
      device::report_and_trap(ctx, peer, phase, static_cast<int64_t>(expected), static_cast<int64_t>(value),
                              waited);
    }
  }
}

}  // namespace epx::transport::nvshmem
