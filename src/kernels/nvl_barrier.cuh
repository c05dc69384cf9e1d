#pragma once

#include "device/wait.cuh"
#include "kernels/normal_kernels.hpp"
#include "kernels/wait_context.cuh"

namespace epx::kernels {

// All ranks meet; called by every thread of exactly one block. Everything this rank wrote before (this
// kernel's block and earlier kernels on the stream) is visible to every peer after it returns, and the
// peers' writes before their barrier are visible here.
//
// NOTES: signals are monotonic counts (the number of barriers entered), never reset, so a late reader can
// not miss a signal and no cleaning launch is needed. op_count advances here, so code that uses the half of
// an operation reads op_count & 1 before the operation's barrier (parity_before_barrier).
__device__ __forceinline__ void nvl_barrier_block(const PeerContext& peers) {
  auto* local = NormalLayout::control(peers.local_base);
  const int target = local->barrier_count + 1;
  // The block's earlier writes (and what it acquired from other blocks) precede each signal's release in
  // causality order (bar.sync, then release at system scope), so no separate system fence is needed.
  __syncthreads();
  if (threadIdx.x < peers.num_ranks) {
    auto* remote = NormalLayout::control(peers.peer_bases[threadIdx.x]);
    device::st_release_sys(&remote->barrier_signal[peers.rank], target);
    const device::WaitContext ctx = wait_context(peers);
    device::wait_at_least(&local->barrier_signal[threadIdx.x], target, ctx, threadIdx.x, WaitPhase::kBarrier);
  }
  // Each peer's writes before its signal were acquired by one thread; bar.sync extends them to the block.
  __syncthreads();
  if (threadIdx.x == 0) {
    local->barrier_count = target;
    local->op_count += 1;
  }
}

__device__ __forceinline__ int parity_before_barrier(const PeerContext& peers) {
  return *reinterpret_cast<volatile int*>(&NormalLayout::control(peers.local_base)->op_count) & 1;
}

}  // namespace epx::kernels
