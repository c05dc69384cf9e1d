#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "common/cuda_check.hpp"
#include "kernels/normal_kernels.hpp"
#include "kernels/nvl_barrier.cuh"
#include "kernels/preload.hpp"
#include "kernels/shape_check.cuh"

namespace epx::kernels {

namespace {

constexpr int kNotifyThreads = 1024;
static_assert(kMaxNvlRanks * kMaxChannels <= kNotifyThreads, "one thread per (source, channel) in the scan");

// ---- Channel blocks: how many of the channel's tokens go to each rank, posted into that rank's notify area.
// The block acknowledges with a release once its stores are issued; the exchange block waits for every
// acknowledgement before the barrier, and only the barrier advances op_count, so the parity read here is the
// operation's.
// ----
__device__ void count_channel(const NotifyArgs& args, int channel) {
  using BlockReduce = cub::BlockReduce<int, kNotifyThreads>;
  __shared__ typename BlockReduce::TempStorage reduce_storage;
  __shared__ int parity;
  const int num_ranks = args.peers.num_ranks;
  if (threadIdx.x == 0) parity = parity_before_barrier(args.peers);
  const TokenRange range = channel_token_range(args.num_tokens, args.num_channels, channel);
  const bool copy_map = args.handle.is_token_in_rank != args.is_token_in_rank;
  int counts[kMaxNvlRanks] = {};
  for (int t = range.begin + threadIdx.x; t < range.end; t += kNotifyThreads) {
#pragma unroll
    for (int r = 0; r < kMaxNvlRanks; ++r) {
      if (r >= num_ranks) break;
      const size_t cell = static_cast<size_t>(t) * num_ranks + r;
      const uint8_t flag = args.is_token_in_rank[cell] != 0;
      counts[r] += flag;
      if (copy_map) args.handle.is_token_in_rank[cell] = flag;
    }
  }
  __syncthreads();
  for (int r = 0; r < num_ranks; ++r) {
    const int total = BlockReduce(reduce_storage).Sum(counts[r]);
    if (threadIdx.x == 0) {
      NormalLayout::notify(args.peers.peer_bases[r], parity)->channel_counts[args.peers.rank][channel] =
          total;
    }
    __syncthreads();
  }
  // Thread 0 wrote every count above, so its release orders them before the acknowledgement.
  if (threadIdx.x == 0)
    device::atomic_add_release_sys(&NormalLayout::control(args.peers.local_base)->parity_acks, 1);
}

// ---- Exchange block: per-expert counts out, barrier, then what arrives from whom: the received-row offsets
// per (source, channel) and the per-expert counts, to the handle and to host-mapped memory. ----
__device__ void exchange_counts(const NotifyArgs& args) {
  using BlockScan = cub::BlockScan<int, kNotifyThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ int source_totals[kMaxNvlRanks];
  const int num_ranks = args.peers.num_ranks;
  const int rank = args.peers.rank;
  const int num_channels = args.num_channels;
  const int experts_per_rank = args.num_experts / num_ranks;
  const int parity = parity_before_barrier(args.peers);
  const device::WaitContext ctx = wait_context(args.peers);

  // The shape fingerprint travels with the counts (first, so its stores overlap the counts'): the barrier
  // publishes it too, and every rank compares every peer's after it.
  if (threadIdx.x < num_ranks && args.peers.abort.peers[threadIdx.x] != nullptr)
    post_shape(AbortLayout::normal_shape(args.peers.abort.peers[threadIdx.x], parity, rank), args.shape);
  for (int e = threadIdx.x; e < args.num_experts; e += kNotifyThreads) {
    const int dst = e / experts_per_rank;
    NormalLayout::notify(args.peers.peer_bases[dst], parity)
        ->expert_counts[rank * experts_per_rank + e % experts_per_rank] =
        args.num_tokens_per_expert != nullptr ? args.num_tokens_per_expert[e] : 0;
  }
  if (threadIdx.x == 0) {
    auto* control = NormalLayout::control(args.peers.local_base);
    device::wait_at_least(&control->parity_acks, num_channels, ctx, rank, WaitPhase::kDispatchNotify);
    control->parity_acks = 0;
  }
  nvl_barrier_block(args.peers);
  if (threadIdx.x < num_ranks && threadIdx.x != rank && args.peers.abort.peers[threadIdx.x] != nullptr)
    check_shape(ctx, threadIdx.x, args.shape,
                AbortLayout::normal_shape(args.peers.abort.local, parity, threadIdx.x));

  const NormalLayout::NotifyHalf* arrived = NormalLayout::notify(args.peers.local_base, parity);
  const int cell = threadIdx.x;  // (source, channel), source-major
  const int src = cell / num_channels;
  const int count = src < num_ranks ? arrived->channel_counts[src][cell % num_channels] : 0;
  int offset = 0, total = 0;
  BlockScan(scan_storage).ExclusiveSum(count, offset, total);
  if (src < num_ranks) args.handle.recv_channel_offset[cell] = offset;
  if (cell == 0) args.handle.recv_channel_offset[num_ranks * num_channels] = total;
  if (threadIdx.x < num_ranks) source_totals[threadIdx.x] = 0;
  __syncthreads();
  if (src < num_ranks) atomicAdd(&source_totals[src], count);
  __syncthreads();
  if (threadIdx.x == 0) {
    args.host.counts[0] = total;
    if (args.num_worst_tokens > 0 && total > args.num_worst_tokens) {
      // The dispatch that follows sees the abort at its start and writes nothing.
      device::raise_abort(ctx, -1, WaitPhase::kCapacity, args.num_worst_tokens, total, 0);
    }
  }
  if (threadIdx.x < num_ranks) args.host.counts[1 + threadIdx.x] = source_totals[threadIdx.x];
  for (int le = threadIdx.x; le < experts_per_rank; le += kNotifyThreads) {
    int sum = 0;
    for (int s = 0; s < num_ranks; ++s) sum += arrived->expert_counts[s * experts_per_rank + le];
    const int aligned = (sum + args.expert_alignment - 1) / args.expert_alignment * args.expert_alignment;
    args.handle.num_recv_tokens_per_expert[le] = aligned;
    args.host.counts[1 + num_ranks + le] = aligned;
  }
  // The host spins on the ready word, not on the launch.
  // The release is cumulative over the block's count writes that bar.sync ordered before it.
  if (args.host.ready != nullptr) {
    __syncthreads();
    if (threadIdx.x == 0) device::st_release_sys(args.host.ready, args.host.ready_value);
  }
}

// Block 0 exchanges, blocks 1..C count their channel.
__global__ void __launch_bounds__(kNotifyThreads, 1) notify_kernel(NotifyArgs args) {
  if (blockIdx.x == 0) {
    exchange_counts(args);
  } else {
    count_channel(args, blockIdx.x - 1);
  }
}

}  // namespace

void launch_dispatch_notify(const NotifyArgs& args, cudaStream_t stream) {
  notify_kernel<<<1 + args.num_channels, kNotifyThreads, 0, stream>>>(args);
  EPX_CUDA_CHECK_LAUNCH();
}

void preload_normal_notify_kernels() {
  preload_kernel(notify_kernel);
}

}  // namespace epx::kernels
