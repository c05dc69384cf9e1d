#pragma once

#include "device/wait.cuh"
#include "kernels/normal_kernels.hpp"

namespace epx::kernels {

// All ranks meet; called by every thread of exactly one block. Everything this rank wrote before (this
// kernel's block and earlier kernels on the stream) is visible to every peer after it returns, and the
// peers' writes before their barrier are visible here.
//
// NOTES: signals are monotonic counts (the number of barriers entered), never reset, so a late reader can
// not miss a signal and no cleaning launch is needed. op_count advances here: kernels before an operation's
// barrier use half op_count & 1, kernels after it use (op_count - 1) & 1, which is the same half.
// `num_parity_readers` > 0: op_count advances only once that many blocks of the same launch acknowledged
// (Control::parity_acks) that they read it.
__device__ __forceinline__ void nvl_barrier_block(const PeerContext& peers, int num_parity_readers = 0) {
  auto* local = NormalLayout::control(peers.local_base);
  __syncthreads();
  const int target = local->barrier_count + 1;
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x < peers.num_ranks) {
    auto* remote = NormalLayout::control(peers.peer_bases[threadIdx.x]);
    device::st_release_sys(&remote->barrier_signal[peers.rank], target);
    const device::WaitContext ctx{peers.timeout_record, peers.rank, peers.timeout_ns};
    device::wait_at_least(&local->barrier_signal[threadIdx.x], target, ctx, threadIdx.x, WaitPhase::kBarrier);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (num_parity_readers > 0) {
      const device::WaitContext ctx{peers.timeout_record, peers.rank, peers.timeout_ns};
      device::wait_at_least(&local->parity_acks, num_parity_readers, ctx, peers.rank, WaitPhase::kBarrier);
      local->parity_acks = 0;
      __threadfence();
    }
    local->barrier_count = target;
    local->op_count += 1;
  }
  __threadfence_system();
  __syncthreads();
}

__device__ __forceinline__ int parity_before_barrier(const PeerContext& peers) {
  return NormalLayout::control(peers.local_base)->op_count & 1;
}
__device__ __forceinline__ int parity_after_barrier(const PeerContext& peers) {
  return (NormalLayout::control(peers.local_base)->op_count - 1) & 1;
}

// Copies `bytes` (a multiple of 16) with 16-byte accesses by one warp: kUnroll loads per lane are issued
// before the first store, the last partial round included, so a remote row never waits on serial round trips.
template <bool kSourceIsRemote>
__device__ __forceinline__ void warp_copy(void* dst, const void* src, size_t bytes, int lane) {
  constexpr int kUnroll = 8;
  auto* d = static_cast<int4*>(dst);
  const auto* s = static_cast<const int4*>(src);
  const int n = static_cast<int>(bytes / 16);
  for (int base = lane; base < n; base += kUnroll * 32) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * 32 < n)
        v[u] = kSourceIsRemote ? device::ld_v4(s + base + u * 32) : device::ld_nc_v4(s + base + u * 32);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * 32 < n) device::st_na_v4(d + base + u * 32, v[u]);
    }
  }
}

// Row j of an interleaved walk over per-rank row ranges [offsets[r], offsets[r+1]): consecutive j go to
// different ranks (starting at `first_rank`), so the copy engines of every link and the local memory work at
// once instead of one source after another. Returns -1 for the walk's holes (ranks with fewer rows).
__device__ __forceinline__ int interleaved_row(int j, const int* offsets, int num_ranks, int first_rank,
                                               int& rank_of_row) {
  const int r = (j % num_ranks + first_rank) % num_ranks;
  const int i = j / num_ranks;
  rank_of_row = r;
  return offsets[r] + i < offsets[r + 1] ? offsets[r] + i : -1;
}

}  // namespace epx::kernels
