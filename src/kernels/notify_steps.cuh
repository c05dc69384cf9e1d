#pragma once

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "device/wait.cuh"
#include "kernels/deep_ep_matrices.hpp"
#include "kernels/host_counts.cuh"
#include "kernels/normal_kernels.hpp"
#include "kernels/shape_check.cuh"
#include "kernels/wait_context.cuh"

// The steps of normal mode's count exchange, for blocks of kThreads threads: the notify kernel runs them in
// blocks of its own, a dispatch launched with its notify (DispatchArgs::with_notify) in its own blocks.
namespace epx::kernels {

// NOTES: every count crosses as a tagged word (pack_tagged with the notify's sequence) into the half of the
// receiver's notify area that the sequence's parity picks. The receiver polls each word until it carries
// this sequence, so the exchange needs no barrier, no acknowledgement and no fence: the value is in the
// word that says it is current.

// ---- Channel blocks: how many of the channel's tokens go to each rank, posted into that rank's notify area.
// ----
template <int kThreads>
__device__ void count_channel(const NotifyArgs& args, int channel) {
  using BlockReduce = cub::BlockReduce<int, kThreads>;
  __shared__ typename BlockReduce::TempStorage reduce_storage;
  const int num_ranks = args.peers.num_ranks;
  const TokenRange range = channel_token_range(args.num_tokens, args.num_channels, channel);
  const bool copy_map = args.handle.is_token_in_rank != args.is_token_in_rank;
  int counts[kMaxNvlRanks] = {};
  for (int t = range.begin + threadIdx.x; t < range.end; t += kThreads) {
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
      auto* half = NormalBufferMap::notify(args.peers.peer_bases[r], args.sequence);
      device::st_relaxed_sys_u64(&half->channel_counts[args.peers.rank][channel],
                                 pack_tagged(args.sequence, total));
    }
    __syncthreads();  // the reduce storage is reused
  }
}

// ---- Received-row offsets: what each (source, channel) sends this rank, scanned into the handle's
// recv_channel_offset. Returns (in every thread) the rows from source threadIdx.x, for threads < R. Each
// thread takes kCells / kThreads consecutive (source, channel) cells, source-major. ----
template <int kThreads>
__device__ int scan_channel_offsets(const NotifyArgs& args, const NormalBufferMap::NotifyHalf* arrived,
                                    const device::WaitContext& ctx, int& total) {
  constexpr int kCells = kMaxNvlRanks * kMaxChannels;
  constexpr int kItems = kCells / kThreads;
  static_assert(kItems * kThreads == kCells, "the cells split evenly over the threads");
  using BlockScan = cub::BlockScan<int, kThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ int source_totals[kMaxNvlRanks];
  const int num_ranks = args.peers.num_ranks;
  const int num_channels = args.num_channels;
  int counts[kItems];
  int offsets[kItems];
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int cell = threadIdx.x * kItems + i;
    const int src = cell / num_channels;
    counts[i] = src < num_ranks ? device::wait_tagged(&arrived->channel_counts[src][cell % num_channels],
                                                      args.sequence, ctx, src, WaitPhase::kDispatchNotify)
                                : 0;
  }
  BlockScan(scan_storage).ExclusiveSum(counts, offsets, total);
  if (threadIdx.x < num_ranks) source_totals[threadIdx.x] = 0;
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int cell = threadIdx.x * kItems + i;
    const int src = cell / num_channels;
    if (src >= num_ranks) continue;
    args.handle.recv_channel_offset[cell] = offsets[i];
    atomicAdd(&source_totals[src], counts[i]);
  }
  if (threadIdx.x == 0) args.handle.recv_channel_offset[num_ranks * num_channels] = total;
  __syncthreads();  // also makes the block's offsets visible to all its threads
  if (args.handle.deep_ep_matrices != nullptr) {
    for (int i = threadIdx.x; i < deep_ep_matrices_size(num_ranks, num_channels); i += kThreads) {
      args.handle.deep_ep_matrices[i] = deep_ep_matrices_entry(i, args.handle.recv_channel_offset, num_ranks,
                                                               num_channels, args.peers.rank);
    }
  }
  if (threadIdx.x == 0 && args.num_worst_tokens > 0 && total > args.num_worst_tokens) {
    // The dispatch that follows sees the abort at its start and writes nothing.
    device::raise_abort(ctx, -1, WaitPhase::kCapacity, args.num_worst_tokens, total, 0);
  }
  return threadIdx.x < num_ranks ? source_totals[threadIdx.x] : 0;
}

// With the layout's per-rank totals (the notify kernel's first channel block once its own counts are out, or
// every block of a dispatch that runs the exchange and writes rows): the host sized the outputs by the
// totals, so a source whose channels carry another count would write past them. The group stops here; a
// dispatch launched after sees the abort at its start. Returns false (in every thread) when the group is
// aborted, by this check or before it.
template <int kThreads>
__device__ bool scan_and_check_totals(const NotifyArgs& args) {
  const NormalBufferMap::NotifyHalf* arrived = NormalBufferMap::notify(args.peers.local_base, args.sequence);
  const device::WaitContext ctx = wait_context(args.peers);
  int total = 0;
  const int rows = scan_channel_offsets<kThreads>(args, arrived, ctx, total);
  bool agrees = true;
  if (threadIdx.x < args.peers.num_ranks) {
    const int announced = device::wait_tagged(&arrived->rank_totals[threadIdx.x], args.sequence, ctx,
                                              threadIdx.x, WaitPhase::kDispatchNotify);
    if (rows != announced) {
      device::raise_abort(ctx, threadIdx.x, WaitPhase::kRankCounts, announced, rows, 0);
      agrees = false;
    }
  }
  return __syncthreads_and(agrees && !abort_word_is_set(device::read_abort_word(ctx)));
}

// ---- Exchange block: the shape, per-expert counts (and per-rank totals, when given) out, then the host's
// counts: from the totals when given, else from the channel counts after the offsets. ----

// Waits for every source's counts for each local expert; writes their aligned sums to the handle and the
// host.
template <int kThreads>
__device__ void gather_expert_counts(const NotifyArgs& args, const NormalBufferMap::NotifyHalf* arrived,
                                     const device::WaitContext& ctx, const HostCountIndex& index) {
  const int num_ranks = args.peers.num_ranks;
  const int experts_per_rank = args.num_experts / num_ranks;
  for (int le = threadIdx.x; le < experts_per_rank; le += kThreads) {
    int sum = 0;
    for (int s = 0; s < num_ranks; ++s) {
      sum += device::wait_tagged(&arrived->expert_counts[s * experts_per_rank + le], args.sequence, ctx, s,
                                 WaitPhase::kDispatchNotify);
    }
    const int aligned = (sum + args.expert_alignment - 1) / args.expert_alignment * args.expert_alignment;
    args.handle.num_recv_tokens_per_expert[le] = aligned;
    publish_host_count(args.host, index.expert(le), aligned);
  }
}

template <int kThreads>
__device__ void exchange_counts(const NotifyArgs& args) {
  constexpr int kExpertsPerThread = kMaxExperts / kThreads;
  __shared__ int rows_from[kMaxNvlRanks];  // rows from each source
  __shared__ int invalid_id;
  const int num_ranks = args.peers.num_ranks;
  const int rank = args.peers.rank;
  const int experts_per_rank = args.num_experts / num_ranks;
  const uint32_t sequence = args.sequence;
  const device::WaitContext ctx = wait_context(args.peers);
  const HostCountIndex index{num_ranks, experts_per_rank};
  const bool totals_given = args.num_tokens_per_rank != nullptr;

  // Every load first, so their latencies overlap each other and the fence of the shape's release below: the
  // layout kernel's flag (host memory), this rank's totals and per-expert counts.
  if (threadIdx.x == kThreads - 1)
    invalid_id = args.invalid_id != nullptr ? *reinterpret_cast<const volatile int*>(args.invalid_id) : 0;
  const int my_total = totals_given && threadIdx.x < num_ranks ? args.num_tokens_per_rank[threadIdx.x] : 0;
  int expert_counts[kExpertsPerThread];
#pragma unroll
  for (int i = 0; i < kExpertsPerThread; ++i) {
    const int e = threadIdx.x + i * kThreads;
    expert_counts[i] =
        e < args.num_experts && args.num_tokens_per_expert != nullptr ? args.num_tokens_per_expert[e] : 0;
  }

  // The shape fingerprint goes first: its values into the peer's abort-words slot, then its hash as a tagged
  // word whose release orders the values before it. Every rank checks every peer's before it waits for any
  // count, since counts of another shape may never come (other channels): a mismatch aborts the group.
  if (threadIdx.x < num_ranks) {
    auto* half = NormalBufferMap::notify(args.peers.peer_bases[threadIdx.x], sequence);
    if (totals_given) device::st_relaxed_sys_u64(&half->rank_totals[rank], pack_tagged(sequence, my_total));
    if (args.peers.abort.peers[threadIdx.x] != nullptr)
      post_shape(AbortWordsMap::normal_shape(args.peers.abort.peers[threadIdx.x], sequence & 1u, rank),
                 args.shape);
    device::st_release_sys_u64(&half->shape_hash[rank], pack_tagged(sequence, args.shape.hash));
  }
#pragma unroll
  for (int i = 0; i < kExpertsPerThread; ++i) {
    const int e = threadIdx.x + i * kThreads;
    if (e >= args.num_experts) break;
    device::st_relaxed_sys_u64(&NormalBufferMap::notify(args.peers.peer_bases[e / experts_per_rank], sequence)
                                    ->expert_counts[rank * experts_per_rank + e % experts_per_rank],
                               pack_tagged(sequence, expert_counts[i]));
  }

  const NormalBufferMap::NotifyHalf* arrived = NormalBufferMap::notify(args.peers.local_base, sequence);
  if (threadIdx.x < num_ranks && threadIdx.x != rank) {
    const int hash = device::wait_tagged(&arrived->shape_hash[threadIdx.x], sequence, ctx, threadIdx.x,
                                         WaitPhase::kDispatchNotify);
    if (hash != args.shape.hash && args.peers.abort.peers[threadIdx.x] != nullptr) {
      __threadfence_system();  // the values were released before the hash
      check_shape(ctx, threadIdx.x, args.shape,
                  AbortWordsMap::normal_shape(args.peers.abort.local, sequence & 1u, threadIdx.x));
    }
  }

  // The rows from each source: announced with the totals (the first channel block scans the offsets and
  // checks them meanwhile), else counted from the channel counts after the offsets.
  int total = 0;
  if (totals_given) {
    if (threadIdx.x < num_ranks) {
      rows_from[threadIdx.x] = device::wait_tagged(&arrived->rank_totals[threadIdx.x], sequence, ctx,
                                                   threadIdx.x, WaitPhase::kDispatchNotify);
    }
    __syncthreads();
    for (int s = 0; s < num_ranks; ++s) total += rows_from[s];
  } else {
    const int rows = scan_channel_offsets<kThreads>(args, arrived, ctx, total);
    if (threadIdx.x < num_ranks) rows_from[threadIdx.x] = rows;
    __syncthreads();
  }
  if (threadIdx.x < num_ranks)
    publish_host_count(args.host, index.rows_from(threadIdx.x), rows_from[threadIdx.x]);
  if (threadIdx.x == 0) {
    publish_host_count(args.host, index.rows(), total);
    publish_host_count(args.host, index.invalid_id(), invalid_id);
  }
  gather_expert_counts<kThreads>(args, arrived, ctx, index);
  flush_host_counts(args.host);
}

}  // namespace epx::kernels
