#pragma once

#include <cstdint>

// Memory-ordering primitives for talking to peer GPUs over NVLink. Peers' buffers are mapped with CUDA IPC,
// so a flag written by another GPU must be read with system-scope acquire, and data published to peers must
// be followed by a system-scope release (PTX ISA, "Memory Consistency Model": scope .sys covers peer GPUs).
namespace epx::device {

__device__ __forceinline__ int ld_acquire_sys(const int* address) {
  int value;
  asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
  return value;
}

__device__ __forceinline__ void st_release_sys(int* address, int value) {
  asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(address), "r"(value) : "memory");
}

__device__ __forceinline__ int ld_acquire_gpu(const int* address) {
  int value;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
  return value;
}

__device__ __forceinline__ void st_release_gpu(int* address, int value) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(address), "r"(value) : "memory");
}

__device__ __forceinline__ uint64_t ld_acquire_sys_u64(const uint64_t* address) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(address) : "memory");
  return value;
}

__device__ __forceinline__ void st_release_sys_u64(uint64_t* address, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(address), "l"(value) : "memory");
}

__device__ __forceinline__ int ld_relaxed_sys(const int* address) {
  int value;
  asm volatile("ld.relaxed.sys.global.s32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
  return value;
}

// Within a block (a generic address, shared memory included): a release store and an acquire load at CTA
// scope, so a thread that reads the flag also sees what the writer saw before it (its acquires included).
__device__ __forceinline__ void st_release_cta(int* address, int value) {
  asm volatile("st.release.cta.s32 [%0], %1;" ::"l"(address), "r"(value) : "memory");
}

__device__ __forceinline__ int ld_acquire_cta(const int* address) {
  int value;
  asm volatile("ld.acquire.cta.s32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
  return value;
}

// One 64-bit word read or written whole (single-copy atomic when 8-byte aligned), with no ordering: for
// words that carry their own validity (tagged counts).
__device__ __forceinline__ uint64_t ld_relaxed_sys_u64(const uint64_t* address) {
  uint64_t value;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(address) : "memory");
  return value;
}

__device__ __forceinline__ void st_relaxed_sys_u64(uint64_t* address, uint64_t value) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(address), "l"(value) : "memory");
}

// Atomic add with acquire and release semantics at system scope: releases what this thread ordered before it
// (cumulatively: what a barrier made its own), acquires what the writers of earlier values released.
__device__ __forceinline__ int atomic_add_acq_rel_sys(int* address, int value) {
  int old;
  asm volatile("atom.acq_rel.sys.global.add.s32 %0, [%1], %2;"
               : "=r"(old)
               : "l"(address), "r"(value)
               : "memory");
  return old;
}

// Atomic add with release semantics at system scope and no result: releases what this thread ordered before
// it (cumulatively: what a barrier made its own) without waiting for the add's round trip.
__device__ __forceinline__ void red_add_release_sys(int* address, int value) {
  asm volatile("red.release.sys.global.add.s32 [%0], %1;" ::"l"(address), "r"(value) : "memory");
}

// Named barrier `id` (0 is __syncthreads') over `threads` threads of the block, a multiple of 32.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return ns;
}

// 16-byte loads that bypass L1: rows are read once, and peer memory must not be served from a stale line.
__device__ __forceinline__ int4 ld_nc_v4(const int4* address) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(address));
  return v;
}

__device__ __forceinline__ int4 ld_v4(const int4* address) {
  int4 v;
  asm volatile("ld.global.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(address));
  return v;
}

// 4- and 8-byte loads in the same two kinds, as asm volatile so they are issued where they stand: a warp's
// small loads placed before a row's copy go out with the row's first loads instead of after its stores.
__device__ __forceinline__ uint32_t ld_nc_b32(const void* address) {
  uint32_t v;
  asm volatile("ld.global.nc.L1::no_allocate.b32 %0, [%1];" : "=r"(v) : "l"(address));
  return v;
}

__device__ __forceinline__ uint64_t ld_nc_b64(const void* address) {
  uint64_t v;
  asm volatile("ld.global.nc.L1::no_allocate.b64 %0, [%1];" : "=l"(v) : "l"(address));
  return v;
}

__device__ __forceinline__ uint32_t ld_b32(const void* address) {
  uint32_t v;
  asm volatile("ld.global.L1::no_allocate.b32 %0, [%1];" : "=r"(v) : "l"(address));
  return v;
}

__device__ __forceinline__ void st_na_v4(int4* address, const int4& v) {
  asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(address), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w));
}

}  // namespace epx::device
