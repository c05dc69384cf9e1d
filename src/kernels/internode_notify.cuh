#pragma once

#include <cub/block/block_scan.cuh>

#include "kernels/host_counts.cuh"
#include "kernels/internode_common.cuh"
#include "kernels/launch.hpp"
#include "kernels/phase_clock.cuh"
#include "kernels/shape_check.cuh"

// The count exchange of normal mode across nodes. Blocks 1..C count what their channel sends to each rank and
// each node and stage it in this rank's NotifySend; block 0 stages the per-expert counts, puts one message to
// every rank (put-with-signal: the signal lands after the message) and waits for everyone's message to it.
// No barrier: a rank can be at most one notify ahead of another (the dispatch between two notifies waits for
// every rank it exchanges rows with), and the halves alternate by sequence parity. Every message carries its
// sender's shape fingerprint; a receiver that finds another shape aborts the group (the host then raises the
// record instead of using the counts).
namespace epx::kernels::internode {

static_assert(sizeof(ShapeFingerprint) == sizeof(int) * InternodeBufferMap::kShapeInts,
              "a count message reserves one ShapeFingerprint");

__device__ __forceinline__ ShapeFingerprint* message_shape(
    const InternodeBufferMap::NotifyMessageView& message) {
  return reinterpret_cast<ShapeFingerprint*>(message.shape);
}

constexpr int kNotifyThreads = 1024;
constexpr int kScanItems = kMaxInternodeRanks * kMaxChannels / kNotifyThreads;  // cells per thread
static_assert(kMaxInternodeRanks + kMaxRdmaNodes <= kNotifyThreads,
              "a thread per source rank, then per node");

__device__ void count_channel(const InternodeNotifyArgs& args, int channel) {
  __shared__ int rank_counts[kMaxInternodeRanks];
  __shared__ int node_counts[kMaxRdmaNodes];
  const InternodeContext& context = args.context;
  const int num_ranks = context.peers.num_ranks;
  const int ranks_per_node = context.nodes.ranks_per_node;
  if (threadIdx.x < kMaxInternodeRanks) rank_counts[threadIdx.x] = 0;
  if (threadIdx.x < kMaxRdmaNodes) node_counts[threadIdx.x] = 0;
  __syncthreads();
  const TokenRange range = channel_token_range(args.num_tokens, args.num_channels, channel);
  const bool copy_map = args.handle.is_token_in_rank != args.is_token_in_rank;
  for (int t = range.begin + threadIdx.x; t < range.end; t += kNotifyThreads) {
    uint32_t nodes = 0;
    for (int r = 0; r < num_ranks; ++r) {
      const size_t cell = static_cast<size_t>(t) * num_ranks + r;
      const uint8_t flag = args.is_token_in_rank[cell] != 0;
      if (copy_map) args.handle.is_token_in_rank[cell] = flag;
      if (flag) {
        atomicAdd(&rank_counts[r], 1);
        nodes |= 1u << (r / ranks_per_node);
      }
    }
    for (; nodes != 0; nodes &= nodes - 1) atomicAdd(&node_counts[__ffs(nodes) - 1], 1);
  }
  __syncthreads();
  int* send = rdma_head(context)->send.messages;
  if (threadIdx.x < num_ranks) {
    const int r = threadIdx.x;
    const InternodeBufferMap::NotifyMessageView message =
        InternodeBufferMap::message(send, r, num_ranks, args.num_channels);
    message.rank_channel_counts[channel] = rank_counts[r];
    message.node_channel_counts[channel] = node_counts[r / ranks_per_node];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(&rdma_head(context)->control.notify_arrivals, 1);
  }
}

template <typename Remote>
__device__ void exchange_counts(const InternodeNotifyArgs& args) {
  using BlockScan = cub::BlockScan<int, kNotifyThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ int sequence;
  __shared__ int totals[2];  // rows received, records forwarded: the host's totals
  const InternodeContext& context = args.context;
  const int num_ranks = context.peers.num_ranks;
  const int rank = context.peers.rank;
  const int num_channels = args.num_channels;
  const int experts_per_rank = args.num_experts / num_ranks;
  const device::WaitContext wait = wait_context(context);
  const HostCountIndex index{num_ranks, experts_per_rank};
  InternodeBufferMap::Head* head = rdma_head(context);
  PhaseClock clock(args.phases, PhaseStream::kNodesNotify, threadIdx.x == 0);
  if (threadIdx.x == 0) sequence = *reinterpret_cast<volatile int*>(&head->control.op_count) + 1;
  for (int e = threadIdx.x; e < args.num_experts; e += kNotifyThreads) {
    InternodeBufferMap::message(head->send.messages, e / experts_per_rank, num_ranks, num_channels)
        .expert_counts[e % experts_per_rank] =
        args.num_tokens_per_expert != nullptr ? args.num_tokens_per_expert[e] : 0;
  }
  for (int dst = threadIdx.x; dst < num_ranks; dst += kNotifyThreads)
    post_shape(message_shape(InternodeBufferMap::message(head->send.messages, dst, num_ranks, num_channels)),
               args.shape);
  if (threadIdx.x == 0) {
    device::wait_at_least(&head->control.notify_arrivals, num_channels, wait, rank,
                          WaitPhase::kDispatchNotify);
    head->control.notify_arrivals = 0;
    __threadfence();
  }
  __syncthreads();
  clock.mark(0);
  const int parity = sequence & 1;
  const int stride = InternodeBufferMap::message_stride(num_ranks);
  const int message_ints = InternodeBufferMap::message_ints(num_channels, experts_per_rank);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  bool put_any = false;  // whether this warp put a message (a quiet completes it; stores need none)
  for (int dst = warp; dst < num_ranks; dst += kNotifyThreads / 32) {
    int* slot = head->notify[parity].messages + size_t(rank) * stride;
    const int* message = head->send.messages + size_t(dst) * stride;
    uint64_t* signal = &head->control.notify_signal[rank];
    const RailTarget target = RailTarget::of<Remote>(context, dst);
    if (target.mapped != nullptr) {
      // A peer this GPU maps: the message straight into its slot (the channel blocks wrote parts of it: read
      // past L1), then one release adding to its signal, cumulative over the warp's stores (__syncwarp).
      int* mapped_slot = target.at(context.rdma_base, slot);
      for (int i = lane; i < message_ints; i += 32)
        mapped_slot[i] = reinterpret_cast<const volatile int*>(message)[i];
      __syncwarp();
      if (lane == 0) red_add_release_sys_u64(target.at(context.rdma_base, signal), 1);
    } else {
      Remote::put_signal_warp(slot, message, sizeof(int) * static_cast<size_t>(message_ints), signal, 1, dst);
      put_any = true;
    }
  }
  if (put_any && lane == 0) Remote::quiet();
  int* arrived = head->notify[parity].messages;
  if (threadIdx.x < num_ranks) {
    device::wait_count_since_u64(&head->control.notify_signal[threadIdx.x], 0, sequence, wait, threadIdx.x,
                                 WaitPhase::kDispatchNotify);
    check_shape(wait, threadIdx.x, args.shape,
                message_shape(InternodeBufferMap::message(arrived, threadIdx.x, num_ranks, num_channels)));
  }
  __syncthreads();
  clock.mark(1);

  // Counts per (source, channel) and per (source node, channel), as the messages brought them.
  const NodeMap& nodes = context.nodes;
  const int num_nodes = nodes.num_nodes();
  const auto count_at = [&](int cell) {
    const int src = cell / num_channels;
    return src < num_ranks ? *reinterpret_cast<volatile int*>(
                                 &InternodeBufferMap::message(arrived, src, num_ranks, num_channels)
                                      .rank_channel_counts[cell % num_channels])
                           : 0;
  };
  const auto node_count_at = [&](int cell) {
    const int node = cell / num_channels;
    if (node >= num_nodes) return 0;
    const int src = nodes.rail_peer(rank, node);
    return *reinterpret_cast<volatile int*>(
        &InternodeBufferMap::message(arrived, src, num_ranks, num_channels)
             .node_channel_counts[cell % num_channels]);
  };

  // The host's counts first, flushed before the offsets are scanned: the host waits for them (it sizes the
  // outputs with them), while only the kernels that follow this one in stream order read the offsets.
  if (threadIdx.x < 2) totals[threadIdx.x] = 0;
  __syncthreads();
  // A warp per source rank, then per source node: its lanes load the channels' counts together (one load's
  // latency, not one per channel) and the warp adds them up.
  for (int stream = warp; stream < num_ranks + num_nodes; stream += kNotifyThreads / 32) {
    int sum = 0;
    for (int c = lane; c < num_channels; c += 32) {
      sum += stream < num_ranks ? count_at(stream * num_channels + c)
                                : node_count_at((stream - num_ranks) * num_channels + c);
    }
    sum = __reduce_add_sync(~0u, sum);
    if (lane == 0) {
      if (stream < num_ranks) publish_host_count(args.host, index.rows_from(stream), sum);
      atomicAdd(&totals[stream < num_ranks ? 0 : 1], sum);
    }
  }
  // A thread per local expert: its sources' counts loaded eight at a time before they are added.
  for (int le = threadIdx.x; le < experts_per_rank; le += kNotifyThreads) {
    int sum = 0;
    for (int s0 = 0; s0 < num_ranks; s0 += 8) {
      int counts[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        counts[i] = s0 + i < num_ranks
                        ? *reinterpret_cast<volatile int*>(
                              &InternodeBufferMap::message(arrived, s0 + i, num_ranks, num_channels)
                                   .expert_counts[le])
                        : 0;
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) sum += counts[i];
    }
    const int aligned = (sum + args.expert_alignment - 1) / args.expert_alignment * args.expert_alignment;
    args.handle.num_recv_tokens_per_expert[le] = aligned;
    publish_host_count(args.host, index.expert(le), aligned);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    publish_host_count(args.host, index.rows(), totals[0]);
    publish_host_count(args.host, index.forward_records(), totals[1]);
    publish_host_count(
        args.host, index.invalid_id(),
        args.invalid_id != nullptr ? *reinterpret_cast<const volatile int*>(args.invalid_id) : 0);
  }
  flush_host_counts(args.host);
  clock.mark(2);

  // Received rows: offsets per (source, channel), source-major.
  int items[kScanItems];
  for (int i = 0; i < kScanItems; ++i) items[i] = count_at(threadIdx.x * kScanItems + i);
  int total_rows = 0;
  BlockScan(scan_storage).ExclusiveSum(items, items, total_rows);
  for (int i = 0; i < kScanItems; ++i) {
    const int cell = threadIdx.x * kScanItems + i;
    if (cell < num_ranks * num_channels) args.handle.recv_channel_offset[cell] = items[i];
  }
  if (threadIdx.x == 0) args.handle.recv_channel_offset[num_ranks * num_channels] = total_rows;
  __syncthreads();

  // Forwarded records: offsets per (source node, channel), from each node's rail peer.
  constexpr int kNodeItems = kMaxRdmaNodes * kMaxChannels / kNotifyThreads;
  int node_items[kNodeItems];
  for (int i = 0; i < kNodeItems; ++i) node_items[i] = node_count_at(threadIdx.x * kNodeItems + i);
  int total_records = 0;
  BlockScan(scan_storage).ExclusiveSum(node_items, node_items, total_records);
  for (int i = 0; i < kNodeItems; ++i) {
    const int cell = threadIdx.x * kNodeItems + i;
    if (cell < num_nodes * num_channels) args.handle.node_channel_offset[cell] = node_items[i];
  }
  if (threadIdx.x == 0) {
    args.handle.node_channel_offset[num_nodes * num_channels] = total_records;
    head->control.op_count = sequence;
  }
  clock.add_to_report(0, 0);
}

template <typename Remote>
__global__ void __launch_bounds__(kNotifyThreads, 1) notify_kernel(InternodeNotifyArgs args) {
  if (blockIdx.x == 0) {
    exchange_counts<Remote>(args);
  } else {
    count_channel(args, blockIdx.x - 1);
  }
}

template <typename Remote>
void launch_notify_with(const InternodeNotifyArgs& args, cudaStream_t stream) {
  launch(notify_kernel<Remote>, {unsigned(1 + args.num_channels), kNotifyThreads, 0, Residency::kCoResident},
         stream, args);
}

}  // namespace epx::kernels::internode
