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
__device__ __forceinline__ void nvl_barrier_block(const PeerContext& peers) {
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

// Copies `bytes` (a multiple of 16) with 16-byte accesses by one warp, several loads in flight per lane.
template <bool kSourceIsRemote>
__device__ __forceinline__ void warp_copy(void* dst, const void* src, size_t bytes, int lane) {
  constexpr int kUnroll = 8;
  auto* d = static_cast<int4*>(dst);
  const auto* s = static_cast<const int4*>(src);
  const int n = static_cast<int>(bytes / 16);
  int i = lane;
  for (; i + (kUnroll - 1) * 32 < n; i += kUnroll * 32) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      v[u] = kSourceIsRemote ? device::ld_v4(s + i + u * 32) : device::ld_nc_v4(s + i + u * 32);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) device::st_na_v4(d + i + u * 32, v[u]);
  }
  for (; i < n; i += 32)
    device::st_na_v4(d + i, kSourceIsRemote ? device::ld_v4(s + i) : device::ld_nc_v4(s + i));
}

}  // namespace epx::kernels
