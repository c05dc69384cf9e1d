#pragma once

#include "transport/nvshmem/nvshmem_api.cuh"

#include <cstdint>

// The NVSHMEM transport's device side: the small interface EPX kernels use to reach a rank that is not an
// NVLink peer (put a contiguous block, put one int or 8-byte word, complete). Public NVSHMEM API
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

// One 8-byte word to `rank`, whole (blocking, like put_int).
__device__ __forceinline__ void put_u64(uint64_t* dst, uint64_t value, int rank) {
  nvshmem_uint64_p(dst, value, rank);
}

// Every put this thread issued is complete (sources reusable, data visible at the target).
__device__ __forceinline__ void quiet() {
  nvshmem_quiet();
}

}  // namespace epx::transport::nvshmem
