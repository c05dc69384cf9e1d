#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "device/wait.cuh"
#include "gpu/cuda_check.hpp"
#include "kernels/host_counts.cuh"
#include "kernels/launch.hpp"
#include "kernels/normal_kernels.hpp"
#include "kernels/preload.hpp"
#include "kernels/shape_check.cuh"
#include "kernels/wait_context.cuh"

namespace epx::kernels {

namespace {

constexpr int kNotifyThreads = 1024;
static_assert(kMaxNvlRanks * kMaxChannels <= kNotifyThreads, "one thread per (source, channel) in the scan");

// NOTES: every count crosses as a tagged word (pack_tagged with the notify's sequence) into the half of the
// receiver's notify area that the sequence's parity picks. The receiver polls each word until it carries
// this sequence, so the exchange needs no barrier, no acknowledgement and no fence: the value is in the
// word that says it is current.

// ---- Channel blocks: how many of the channel's tokens go to each rank, posted into that rank's notify area.
// ----
__device__ void count_channel(const NotifyArgs& args, int channel) {
  using BlockReduce = cub::BlockReduce<int, kNotifyThreads>;
  __shared__ typename BlockReduce::TempStorage reduce_storage;
  const int num_ranks = args.peers.num_ranks;
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
  for (int r = 0; r < num_ranks; ++r) {
    const int total = BlockReduce(reduce_storage).Sum(counts[r]);
    if (threadIdx.x == 0) {
      auto* half = NormalLayout::notify(args.peers.peer_bases[r], args.sequence);
      device::st_relaxed_sys_u64(&half->channel_counts[args.peers.rank][channel],
                                 pack_tagged(args.sequence, total));
    }
    __syncthreads();  // the reduce storage is reused
  }
}

// ---- Exchange block: per-expert counts out, then what arrives from whom: the received-row offsets per
// (source, channel) and the per-expert counts, to the handle and to the host. ----
__device__ void exchange_counts(const NotifyArgs& args) {
  using BlockScan = cub::BlockScan<int, kNotifyThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ int source_totals[kMaxNvlRanks];
  const int num_ranks = args.peers.num_ranks;
  const int rank = args.peers.rank;
  const int num_channels = args.num_channels;
  const int experts_per_rank = args.num_experts / num_ranks;
  const uint32_t sequence = args.sequence;
  const device::WaitContext ctx = wait_context(args.peers);
  const HostCountIndex index{num_ranks, experts_per_rank};

  // The shape fingerprint goes first: its values into the peer's abort-words slot, then its hash as a tagged
  // word whose release orders the values before it. Every rank checks every peer's before it waits for any
  // count, since counts of another shape may never come (other channels): a mismatch aborts the group.
  if (threadIdx.x < num_ranks) {
    if (args.peers.abort.peers[threadIdx.x] != nullptr)
      post_shape(AbortLayout::normal_shape(args.peers.abort.peers[threadIdx.x], sequence & 1u, rank),
                 args.shape);
    device::st_release_sys_u64(
        &NormalLayout::notify(args.peers.peer_bases[threadIdx.x], sequence)->shape_hash[rank],
        pack_tagged(sequence, args.shape.hash));
  }

  for (int e = threadIdx.x; e < args.num_experts; e += kNotifyThreads) {
    const int dst = e / experts_per_rank;
    const int count = args.num_tokens_per_expert != nullptr ? args.num_tokens_per_expert[e] : 0;
    device::st_relaxed_sys_u64(&NormalLayout::notify(args.peers.peer_bases[dst], sequence)
                                    ->expert_counts[rank * experts_per_rank + e % experts_per_rank],
                               pack_tagged(sequence, count));
  }

  // The layout kernel's flag lies in host memory: its read overlaps the wait for the counts.
  __shared__ int invalid_id;
  if (threadIdx.x == kNotifyThreads - 1)
    invalid_id = args.invalid_id != nullptr ? *reinterpret_cast<const volatile int*>(args.invalid_id) : 0;

  const NormalLayout::NotifyHalf* arrived = NormalLayout::notify(args.peers.local_base, sequence);
  if (threadIdx.x < num_ranks && threadIdx.x != rank) {
    const int hash = device::wait_tagged(&arrived->shape_hash[threadIdx.x], sequence, ctx, threadIdx.x,
                                         WaitPhase::kDispatchNotify);
    if (hash != args.shape.hash && args.peers.abort.peers[threadIdx.x] != nullptr) {
      __threadfence_system();  // the values were released before the hash
      check_shape(ctx, threadIdx.x, args.shape,
                  AbortLayout::normal_shape(args.peers.abort.local, sequence & 1u, threadIdx.x));
    }
  }
  const int cell = threadIdx.x;  // (source, channel), source-major
  const int src = cell / num_channels;
  const int count = src < num_ranks ? device::wait_tagged(&arrived->channel_counts[src][cell % num_channels],
                                                          sequence, ctx, src, WaitPhase::kDispatchNotify)
                                    : 0;
  int offset = 0, total = 0;
  BlockScan(scan_storage).ExclusiveSum(count, offset, total);
  if (src < num_ranks) args.handle.recv_channel_offset[cell] = offset;
  if (cell == 0) args.handle.recv_channel_offset[num_ranks * num_channels] = total;
  if (threadIdx.x < num_ranks) source_totals[threadIdx.x] = 0;
  __syncthreads();
  if (src < num_ranks) atomicAdd(&source_totals[src], count);
  __syncthreads();
  if (threadIdx.x == 0) {
    publish_host_count(args.host, index.rows(), total);
    publish_host_count(args.host, index.invalid_id(), invalid_id);
    if (args.num_worst_tokens > 0 && total > args.num_worst_tokens) {
      // The dispatch that follows sees the abort at its start and writes nothing.
      device::raise_abort(ctx, -1, WaitPhase::kCapacity, args.num_worst_tokens, total, 0);
    }
  }
  if (threadIdx.x < num_ranks)
    publish_host_count(args.host, index.rows_from(threadIdx.x), source_totals[threadIdx.x]);
  for (int le = threadIdx.x; le < experts_per_rank; le += kNotifyThreads) {
    int sum = 0;
    for (int s = 0; s < num_ranks; ++s) {
      sum += device::wait_tagged(&arrived->expert_counts[s * experts_per_rank + le], sequence, ctx, s,
                                 WaitPhase::kDispatchNotify);
    }
    const int aligned = (sum + args.expert_alignment - 1) / args.expert_alignment * args.expert_alignment;
    args.handle.num_recv_tokens_per_expert[le] = aligned;
    publish_host_count(args.host, index.expert(le), aligned);
  }
  flush_host_counts(args.host);
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
  launch(notify_kernel, {unsigned(1 + args.num_channels), kNotifyThreads, 0, Residency::kCoResident}, stream,
         args);
}

void preload_normal_notify_kernels() {
  preload_kernel(notify_kernel);
}

}  // namespace epx::kernels
