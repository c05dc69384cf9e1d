#pragma once

// clean_low_latency_buffer: reset this rank's low-latency signals, then meet every rank, so the ranks agree
// again on the operation counts however the previous operations ended. Templated on the transport policy for
// ranks outside the NVLink node (low_latency_transport.cuh).
#include "gpu/cuda_check.hpp"
#include "kernels/launch.hpp"
#include "kernels/low_latency_common.cuh"
#include "kernels/low_latency_transport.cuh"
#include "kernels/preload.hpp"

namespace epx::kernels {

namespace {

using namespace low_latency;

// `bytes` (a multiple of 16) at `words`, zeroed by the block.
__device__ __forceinline__ void zero_words(int4* words, size_t bytes) {
  for (size_t i = threadIdx.x; i < bytes / sizeof(int4); i += kNumThreads) words[i] = int4{0, 0, 0, 0};
}

template <typename Remote>
__global__ void __launch_bounds__(kNumThreads, 1) low_latency_clean_kernel(const LowLatencyCleanArgs args) {
  const LowLatencyBufferMap& map = args.map;
  const PeerContext& peers = args.peers;
  // Both halves' signals and the remote shape slots are contiguous: [signals_offset(0), control_end_offset())
  // (a zeroed shape slot never matches: hashes are never 0).
  const int num_signal_ints =
      static_cast<int>((map.control_end_offset() - map.signals_offset(0)) / sizeof(int));
  int* signals = local_at<int>(peers, map.signals_offset(0));
  for (int i = threadIdx.x; i < num_signal_ints; i += kNumThreads) signals[i] = 0;
  // The dispatch count words and index lists of this shape: the use numbers restart (other shapes' words
  // carry an older clean count in their tags, pack_low_latency_word).
  for (int half = 0; half < 2; ++half) {
    zero_words(local_at<int4>(peers, map.dispatch_recv_count_offset(half, 0, 0)),
               map.dispatch_recv_counts_bytes());
    zero_words(local_at<int4>(peers, map.dispatch_recv_index_offset(half, 0, 0)),
               map.dispatch_recv_index_bytes());
  }
  // Barrier on monotonic signals (never reset, so a late rank can not miss one). Resets happen before this
  // rank's signal, and a peer sends again only after it saw every rank's signal.
  __threadfence_system();
  __syncthreads();
  // Masked ranks are left out; with enable_shrink a rank the barrier times out on is masked.
  const int target = read_num_cleans(peers, map) + 1;
  const unsigned long long masked = load_rank_mask(args.mask);
  const int peer = threadIdx.x;
  if (peer < peers.num_ranks && !rank_masked(masked, peer)) {
    signal_rank<Remote>(peers, peer, map.barrier_signal_offset(peers.rank), target);
    const device::WaitContext ctx = wait_context(peers);
    const device::WaitOutcome outcome = device::wait_at_least_outcome(
        local_at<int>(peers, map.barrier_signal_offset(peer)), target, ctx, peer, WaitPhase::kBarrier,
        args.mask.shrink ? device::OnTimeout::kGiveUp : device::OnTimeout::kAbortGroup);
    if (outcome == device::WaitOutcome::kTimedOut) mask_timed_out_peer(args.mask, peer);
  }
  __syncthreads();
  if (threadIdx.x == 0) *local_at<int>(peers, map.barrier_count_offset()) = target;
}

template <typename Remote>
void launch_low_latency_clean_with(const LowLatencyCleanArgs& args, cudaStream_t stream) {
  launch(low_latency_clean_kernel<Remote>, {1, kNumThreads, 0, Residency::kIndependent}, stream, args);
}

template <typename Remote>
void preload_low_latency_clean_with() {
  preload_kernel(low_latency_clean_kernel<Remote>);
}

}  // namespace

}  // namespace epx::kernels
