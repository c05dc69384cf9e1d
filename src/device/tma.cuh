#pragma once

#include <cstdint>

// Hopper bulk copies (TMA, "cp.async.bulk" in the PTX ISA) between global and shared memory, completed
// through an mbarrier's transaction count (loads) or a bulk group (stores). One thread issues them; the copy
// engine moves the bytes, so a few warps keep far more bytes in flight than their registers could hold.
namespace epx::device {

__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* barrier, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(barrier)), "r"(arrivals)
               : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbarrier_expect_bytes(uint64_t* barrier, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(barrier)),
               "r"(bytes)
               : "memory");
}

// Waits until the barrier completed the phase of parity `parity`.
__device__ __forceinline__ void mbarrier_wait(uint64_t* barrier, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}" ::"r"(shared_address(barrier)),
      "r"(parity)
      : "memory");
}

// Global memory written by other agents (peers, earlier generic stores) becomes visible to the async proxy.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async;" ::: "memory");
}

// This thread's earlier accesses to shared memory come before later bulk copies into it (e.g. reads of a
// buffer before it is reloaded).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global into shared memory; the barrier's
// transaction count falls by `bytes` when they landed.
__device__ __forceinline__ void bulk_load(void* shared_dst, const void* global_src, int bytes,
                                          uint64_t* barrier) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          shared_address(shared_dst)),
      "l"(global_src), "r"(bytes), "r"(shared_address(barrier))
      : "memory");
}

// `bytes` from shared into global memory, as one bulk group.
__device__ __forceinline__ void bulk_store(void* global_dst, const void* shared_src, int bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(global_dst),
               "r"(shared_address(shared_src)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Starts pulling `bytes` (a multiple of 16, 16-byte aligned) of global memory into L2 without waiting: the
// warp's own loads of that range then mostly hit L2 instead of each waiting a full memory round trip.
__device__ __forceinline__ void bulk_prefetch_l2(const void* global_src, int bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(global_src), "r"(bytes) : "memory");
}

// Until at most N of this thread's bulk stores still read shared memory.
template <int N>
__device__ __forceinline__ void bulk_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

// Until at most `newer` of this thread's bulk stores still read shared memory (3 or more: 3).
__device__ __forceinline__ void bulk_store_wait_read_at_most(uint32_t newer) {
  switch (newer) {
    case 0:
      bulk_store_wait_read<0>();
      break;
    case 1:
      bulk_store_wait_read<1>();
      break;
    case 2:
      bulk_store_wait_read<2>();
      break;
    default:
      bulk_store_wait_read<3>();
      break;
  }
}

// Until every bulk store of this thread completed.
__device__ __forceinline__ void bulk_store_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

}  // namespace epx::device
