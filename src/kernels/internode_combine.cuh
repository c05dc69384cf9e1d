#pragma once

#include <cuda_bf16.h>

#include "kernels/bf16x8.cuh"
#include "kernels/internode_common.cuh"
#include "kernels/launch.hpp"
#include "kernels/phase_clock.cuh"

// Combine across nodes: the reverse of dispatch. Every channel has two blocks:
//   even: NVLink senders, one group per local rank f: the rows f forwarded to this rank, returned through the
//         sub-queues (this rank -> f, source node) in the order they came; and the final reducer: for each of
//         this rank's tokens, the partial sums of the nodes that received it, in node order, plus the biases;
//   odd:  node reducers, one group per source node m: for each record this rank forwarded from m, the rows
//         of the local ranks it went to (ascending) summed in float, rounded once to BF16 (a node's partial),
//         put back to m's rail peer (own node: into own receive queue).
// The reduction order is reference::internode_combine's, so results are bit-exact.
namespace epx::kernels::internode {

// 512 threads (128 registers a thread, a quarter of 1,024's spills) took 20 % / 16 % less time than 1,024 at
// 12 / 24 SMs (2 x H100 as 2 virtual nodes): the reducers' per-token work is register-heavy.
constexpr int kCombineThreads = 512;
constexpr int kCombineWarps = kCombineThreads / 32;

// The reducers' rows: each lane sums kReduceUnroll 16-byte vectors at a time, 32 vectors apart, loading a
// source's vectors together before it adds them, so several loads are in flight per lane (one at a time left
// a warp waiting a load's latency per 512 bytes). The order of the additions per element is unchanged:
// bit-exact.
constexpr int kReduceUnroll = 4;

__device__ __forceinline__ void start_sums(float (&acc)[kReduceUnroll][8]) {
#pragma unroll
  for (int u = 0; u < kReduceUnroll; ++u) start_sum(acc[u]);
}
// Adds vectors v0, v0 + 32, ... (below num_vectors) of `row`.
__device__ __forceinline__ void add_vectors(float (&acc)[kReduceUnroll][8], const int4* row, int v0,
                                            int num_vectors) {
  int4 values[kReduceUnroll];
#pragma unroll
  for (int u = 0; u < kReduceUnroll; ++u) {
    if (v0 + u * 32 < num_vectors) values[u] = device::ld_v4(row + v0 + u * 32);
  }
#pragma unroll
  for (int u = 0; u < kReduceUnroll; ++u) {
    if (v0 + u * 32 < num_vectors) add_bf16x8(acc[u], values[u]);
  }
}
__device__ __forceinline__ void store_vectors(int4* row, const float (&acc)[kReduceUnroll][8], int v0,
                                              int num_vectors) {
#pragma unroll
  for (int u = 0; u < kReduceUnroll; ++u) {
    if (v0 + u * 32 < num_vectors) row[v0 + u * 32] = round_bf16x8(acc[u]);
  }
}

// A row's sum when it is the only term (one_term_sum_bf16x8 per vector), as a warp copy: twice the loads in
// flight of the sum's loop, and no float registers. kCoherent: the row lies in a queue peers write.
struct OneTermSum {
  __device__ int4 operator()(const int4& v) const { return one_term_sum_bf16x8(v); }
};
template <bool kCoherent>
__device__ __forceinline__ void copy_as_one_term_sum(int4* out, const int4* row, int num_vectors, int lane) {
  warp_copy<kCoherent>(out, row, static_cast<size_t>(num_vectors) * 16, lane, OneTermSum{});
}

// ---- NVLink send: the rows local rank `dst` forwarded to this rank, back to it, per source node. ----
__device__ void return_rows(const InternodeCombineArgs& args, int channel, int dst, const WarpGroup& group,
                            int* shared, uint64_t calls) {
  const InternodeContext& context = args.context;
  const NodeMap& nodes = context.nodes;
  const int num_nodes = nodes.num_nodes();
  const int num_channels = args.rdma.num_channels;
  const int me = own_local(context);
  const NormalRecord& r = args.record.normal;
  auto* my_nvl = nvl_counters(context.peers.local_base);
  void* dst_base = nvl_base(context, dst);
  const device::WaitContext wait = wait_context(context);
  if (group.leader()) wait_local_peer_ready(context, dst, calls);
  group.sync();
  int pushed[kMaxRdmaNodes];
  int done_nodes = 0;
  for (int m = 0; m < num_nodes; ++m) {
    pushed[m] = 0;
    const int cell = (m * nodes.ranks_per_node + dst) * num_channels + channel;
    if (args.handle.recv_channel_offset[cell + 1] == args.handle.recv_channel_offset[cell]) ++done_nodes;
  }
  device::StallClock stall;
  stall.restart();
  bool stop = false;  // the leader's: the group was aborted, leave the loop
  while (done_nodes < num_nodes) {
    bool moved = false;
    for (int m = 0; m < num_nodes; ++m) {
      const int cell = (m * nodes.ranks_per_node + dst) * num_channels + channel;
      const int row0 = args.handle.recv_channel_offset[cell];
      const int count = args.handle.recv_channel_offset[cell + 1] - row0;
      if (pushed[m] == count) continue;
      const uint32_t base = my_nvl->sent[dst][m][channel];
      if (group.leader()) {
        const int consumed = count_since(static_cast<uint32_t>(device::ld_acquire_sys(
                                             reinterpret_cast<const int*>(&my_nvl->head[dst][m][channel]))),
                                         base);
        *shared =
            stop ? kStopPolling
                 : min(min(queue_room(pushed[m], consumed, args.nvl.queue_tokens), args.nvl_chunk_tokens),
                       count - pushed[m]);
      }
      group.sync();
      const int take = *shared;
      group.sync();
      if (take == kStopPolling) return;
      if (take <= 0) continue;
      for (int k = group.warp; k < take; k += group.num_warps) {
        const int row = row0 + pushed[m] + k;
        char* record = args.nvl.record(dst_base, me, dst, m, channel, base + pushed[m] + k);
        write_combine_record(record, r, args.in.x, args.in.topk_weights, row, group.lane);
      }
      group.sync();
      pushed[m] += take;
      if (pushed[m] == count) ++done_nodes;
      if (group.leader()) {
        device::st_release_sys(reinterpret_cast<int*>(&nvl_counters(dst_base)->tail[me][m][channel]),
                               static_cast<int>(base + pushed[m]));
      }
      moved = true;
    }
    if (moved) {
      stall.restart();
    } else if (group.leader()) {
      stop = stall.check(wait, own_node(context) * nodes.ranks_per_node + dst, WaitPhase::kCombineSend, 0,
                         done_nodes);
    }
  }
  if (group.leader()) {
    for (int m = 0; m < num_nodes; ++m) my_nvl->sent[dst][m][channel] += pushed[m];
  }
}

// ---- Node reduce: this rank's forwarded records from source node `node`, reduced over the local ranks. ----
template <typename Remote>
__device__ void reduce_for_node(const InternodeCombineArgs& args, int channel, int node,
                                const WarpGroup& group, int* shared, int* publish, const char** rows,
                                uint64_t calls) {
  const InternodeContext& context = args.context;
  const NodeMap& nodes = context.nodes;
  const int num_channels = args.rdma.num_channels;
  const int me = own_local(context);
  const int own = own_node(context);
  const int lane = group.lane;
  const NormalRecord& r = args.record.normal;
  const int num_topk = r.num_topk_weights;
  const int dst_rank = nodes.rail_peer(context.peers.rank, node);
  const RailTarget target = RailTarget::of<Remote>(context, dst_rank);
  InternodeBufferMap::Head* head = rdma_head(context);
  auto* my_nvl = nvl_counters(context.peers.local_base);
  const device::WaitContext wait = wait_context(context);
  const int first = args.handle.node_channel_offset[node * num_channels + channel];
  const int count = args.handle.node_channel_offset[node * num_channels + channel + 1] - first;
  const uint64_t base = head->counters.sent[node][channel];
  PhaseClock clock(args.phases, PhaseStream::kNodesReduce,
                   channel == 0 && node == (own + 1) % nodes.num_nodes() && group.leader());
  if (node != own && group.leader()) wait_rail_peer_ready(context, node, calls);
  group.sync();
  const int self_row0 =
      args.handle.recv_channel_offset[(node * nodes.ranks_per_node + me) * num_channels + channel];
  int self_taken = 0;
  int got[kMaxNvlRanks];
  for (int l = 0; l < kMaxNvlRanks; ++l) got[l] = 0;
  unsigned shapes_seen = 0;  // lane 0's: local ranks whose launch fingerprint it checked
  const int num_vectors = r.x_bytes / 16;
  for (int done = 0; done < count;) {
    if (group.leader()) {
      const int64_t consumed = device::wait_count_since_u64(&head->counters.head[node][channel], base,
                                                            done - args.rdma.queue_tokens + 1, wait, dst_rank,
                                                            WaitPhase::kCombineSend);
      *shared = min(min(min(queue_room(done, static_cast<int>(consumed), args.rdma.queue_tokens),
                            args.rdma_chunk_tokens),
                        count - done),
                    32);
      if (group_aborted(context)) *shared = kStopPolling;  // the room may not be there
    }
    group.sync();
    const int take = *shared;
    group.sync();
    if (take == kStopPolling) break;
    clock.mark(0);
    const uint32_t lane_mask = lane < take ? args.handle.forward_mask[first + done + lane] : 0u;
    for (int i = group.warp; i < take; i += group.num_warps) {
      const uint32_t mask = __shfl_sync(~0u, lane_mask, i);
      // Where record i's row sits for each local rank: after the batch's earlier records that rank had.
      int entry[kMaxNvlRanks];
      for (int l = 0; l < nodes.ranks_per_node; ++l) {
        const unsigned with_l = __ballot_sync(~0u, (lane_mask >> l) & 1u);
        entry[l] = __popc(with_l & lanes_below(i));
        if (lane == 0 && l != me && ((mask >> l) & 1u)) {
          // A row of another shape is never summed unchecked: on a mismatch the group aborts, naming the
          // field (what this rank then reads lies inside its own queues and goes to outputs the error voids).
          if (!((shapes_seen >> l) & 1u)) {
            shapes_seen |= 1u << l;
            check_local_launch_shape(context, calls, args.shape, l, WaitPhase::kCombineReduce);
          }
          device::wait_count_since(&my_nvl->tail[l][node][channel], my_nvl->consumed[l][node][channel],
                                   got[l] + entry[l] + 1, wait, own * nodes.ranks_per_node + l,
                                   WaitPhase::kCombineReduce);
        }
      }
      const auto row_of = [&](int l) -> const char* {
        if (l == me) {
          return static_cast<const char*>(args.in.x) +
                 static_cast<size_t>(self_row0 + self_taken + entry[l]) * r.x_bytes;
        }
        return args.nvl.record(context.peers.local_base, l, me, node, channel,
                               my_nvl->consumed[l][node][channel] + got[l] + entry[l]);
      };
      // This rank's top-k weights of the record's token (its own row's, in the combine's input).
      const auto own_weights = [&] {
        return args.in.topk_weights + static_cast<size_t>(self_row0 + self_taken + entry[me]) * num_topk;
      };
      // Each local rank's row, looked up once per record (in the loop below, each lookup's loads of the
      // queue counters were a round trip before every vector's loads).
      if (lane == 0) {
        for (int l = 0; l < nodes.ranks_per_node; ++l) rows[l] = (mask >> l) & 1u ? row_of(l) : nullptr;
      }
      __syncwarp();
      const uint64_t position = base + done + i;
      char* out = queue_record(args.rdma, context.rdma_base, target, node, own, channel, position);
      if (__popc(mask) == 1) {
        // One term: the sum is the row itself (its NaNs canonical), copied with the weight's load in flight.
        const int l = __ffs(mask) - 1;
        const uint32_t weight = lane >= num_topk ? 0u
                                : l == me        ? load_word<false>(own_weights() + lane)
                                          : load_word<true>(rows[l] + r.topk_weights_offset() + 4 * lane);
        if (l == me) {
          copy_as_one_term_sum<false>(reinterpret_cast<int4*>(out), reinterpret_cast<const int4*>(rows[l]),
                                      num_vectors, lane);
        } else {
          copy_as_one_term_sum<true>(reinterpret_cast<int4*>(out), reinterpret_cast<const int4*>(rows[l]),
                                     num_vectors, lane);
        }
        if (lane < num_topk)
          reinterpret_cast<float*>(out + r.topk_weights_offset())[lane] = 0.0f + __uint_as_float(weight);
        continue;
      }
      for (int v0 = lane; v0 < num_vectors; v0 += 32 * kReduceUnroll) {
        float acc[kReduceUnroll][8];
        start_sums(acc);
        for (int l = 0; l < nodes.ranks_per_node; ++l) {
          if (rows[l] != nullptr) add_vectors(acc, reinterpret_cast<const int4*>(rows[l]), v0, num_vectors);
        }
        store_vectors(reinterpret_cast<int4*>(out), acc, v0, num_vectors);
      }
      if (lane < num_topk) {
        float weight = 0.0f;
        for (int l = 0; l < nodes.ranks_per_node; ++l) {
          if (rows[l] == nullptr) continue;
          if (l == me) {
            weight += own_weights()[lane];
          } else {
            weight += reinterpret_cast<const volatile float*>(rows[l] + r.topk_weights_offset())[lane];
          }
        }
        reinterpret_cast<float*>(out + r.topk_weights_offset())[lane] = weight;
      }
    }
    clock.mark(1);
    if (node != own && target.mapped == nullptr) __threadfence();  // for the put's reads (publish_records)
    // The group publishes the partials, unless a wait of this group was abandoned (rows never received: it
    // has set the abort word before this barrier); then nothing more leaves. The leader decides for the whole
    // group (one read of the abort word), so no warp copies into the peer's queue while another stops: the
    // room may not be there.
    group.sync();
    if (group.leader()) *publish = group_aborted(context) ? 0 : 1;
    group.sync();
    if (*publish != 0) {
      publish_records<Remote>(args.rdma, context.rdma_base, target, node, own, channel, base + done, take,
                              &head->counters.tail[own][channel], group);
    }
    for (int l = 0; l < nodes.ranks_per_node; ++l) {
      const int used = __popc(__ballot_sync(~0u, (lane_mask >> l) & 1u));
      if (l == me) {
        self_taken += used;
        continue;
      }
      got[l] += used;
      if (used > 0 && group.leader()) {
        device::st_release_sys(
            reinterpret_cast<int*>(&nvl_counters(nvl_base(context, l))->head[me][node][channel]),
            static_cast<int>(my_nvl->consumed[l][node][channel] + got[l]));
      }
    }
    done += take;
    clock.mark(2);
  }
  clock.add_to_report(count, static_cast<int>(r.bytes()));
  group.sync();
  if (group.leader()) {
    head->counters.sent[node][channel] = base + count;
    for (int l = 0; l < nodes.ranks_per_node; ++l) {
      if (l != me) my_nvl->consumed[l][node][channel] += got[l];
    }
  }
}

// ---- Final reduce: each token's node partials in node order, then the biases, one rounding. ----
template <typename Remote>
__device__ void reduce_tokens(const InternodeCombineArgs& args, int channel, const WarpGroup& group,
                              unsigned* batch_end, const char** partials, uint64_t calls) {
  const InternodeContext& context = args.context;
  const NodeMap& nodes = context.nodes;
  const int num_nodes = nodes.num_nodes();
  const int own = own_node(context);
  const int lane = group.lane;
  const NormalRecord& r = args.record.normal;
  const int num_topk = r.num_topk_weights;
  InternodeBufferMap::Head* head = rdma_head(context);
  const device::WaitContext wait = wait_context(context);
  const device::WaitContext own_wait = own_blocks_wait_context(context);  // this node's partial: own blocks
  const TokenRange range = channel_token_range(args.num_tokens, args.rdma.num_channels, channel);
  const int batch = min(group.num_warps, args.rdma.queue_tokens);
  const int num_vectors = r.x_bytes / 16;
  unsigned released[kMaxRdmaNodes];
  for (int n = 0; n < kMaxRdmaNodes; ++n) released[n] = 0;
  unsigned shapes_seen = 0;  // lane 0's: nodes whose rail peer's launch fingerprint it checked
  if (group.leader()) {
    for (int n = 0; n < kMaxRdmaNodes; ++n) batch_end[n] = 0;
  }
  PhaseClock clock(args.phases, PhaseStream::kNodesCombine, channel == 0 && group.leader());
  group.sync();
  for (int t0 = range.begin; t0 < range.end; t0 += batch) {
    const int t = t0 + group.warp;
    if (group.warp < batch && t < range.end) {
      int entry[kMaxRdmaNodes];
      for (int n = 0; n < num_nodes; ++n) {
        entry[n] = args.handle.send_head[static_cast<size_t>(t) * num_nodes + n];
        if (entry[n] >= 0 && lane == 0) {
          if (n != own && !((shapes_seen >> n) & 1u)) {  // as in reduce_for_node
            shapes_seen |= 1u << n;
            check_rail_launch_shape(context, calls, args.shape, n, WaitPhase::kCombineReduce);
          }
          device::wait_count_since_u64(&head->counters.tail[n][channel], head->counters.consumed[n][channel],
                                       entry[n] + 1, n == own ? own_wait : wait,
                                       nodes.rail_peer(context.peers.rank, n), WaitPhase::kCombineReduce);
          atomicMax(&batch_end[n], static_cast<unsigned>(entry[n] + 1));
        }
      }
      // Each node's partial, looked up once per token (as in reduce_for_node).
      if (lane == 0) {
        for (int n = 0; n < num_nodes; ++n) {
          partials[n] = entry[n] >= 0 ? args.rdma.recv_record(context.rdma_base, n, channel,
                                                              head->counters.consumed[n][channel] + entry[n])
                                      : nullptr;
        }
      }
      __syncwarp();
      clock.mark(0);
      bool any_source = args.in.bias0 != nullptr || args.in.bias1 != nullptr;
      for (int n = 0; n < num_nodes; ++n) any_source |= entry[n] >= 0;
      const size_t token_vectors = static_cast<size_t>(t) * num_vectors;
      for (int v0 = lane; v0 < num_vectors; v0 += 32 * kReduceUnroll) {
        float acc[kReduceUnroll][8];
        start_sums(acc);
        for (int n = 0; n < num_nodes; ++n) {
          if (partials[n] != nullptr)
            add_vectors(acc, reinterpret_cast<const int4*>(partials[n]), v0, num_vectors);
        }
        if (args.in.bias0 != nullptr)
          add_vectors(acc, static_cast<const int4*>(args.in.bias0) + token_vectors, v0, num_vectors);
        if (args.in.bias1 != nullptr)
          add_vectors(acc, static_cast<const int4*>(args.in.bias1) + token_vectors, v0, num_vectors);
        if (any_source) {
          store_vectors(static_cast<int4*>(args.out.combined_x) + token_vectors, acc, v0, num_vectors);
        } else {
          for (int u = 0; u < kReduceUnroll && v0 + u * 32 < num_vectors; ++u)
            static_cast<int4*>(args.out.combined_x)[token_vectors + v0 + u * 32] = int4{0, 0, 0, 0};
        }
      }
      if (args.out.combined_topk_weights != nullptr && lane < num_topk) {
        float weight = 0.0f;
        for (int n = 0; n < num_nodes; ++n) {
          if (partials[n] != nullptr)
            weight += reinterpret_cast<const volatile float*>(partials[n] + r.topk_weights_offset())[lane];
        }
        args.out.combined_topk_weights[static_cast<size_t>(t) * num_topk + lane] = weight;
      }
      clock.mark(1);
    }
    group.sync();
    if (group.leader()) {
      for (int n = 0; n < num_nodes; ++n) {
        const unsigned end = *reinterpret_cast<volatile unsigned*>(&batch_end[n]);
        if (end > released[n]) {
          Remote::signal_add(&head->counters.head[own][channel], end - released[n],
                             nodes.rail_peer(context.peers.rank, n));
          released[n] = end;
        }
      }
    }
    group.sync();
    clock.mark(2);
  }
  clock.add_to_report(range.end - range.begin, static_cast<int>(r.bytes()));
  if (group.leader()) {
    for (int n = 0; n < num_nodes; ++n) {
      released[n] = *reinterpret_cast<volatile unsigned*>(&batch_end[n]);
      head->counters.consumed[n][channel] += released[n];
    }
  }
}

template <typename Remote>
__global__ void __launch_bounds__(kCombineThreads, 1) combine_kernel(InternodeCombineArgs args) {
  __shared__ int group_values[kMaxRdmaNodes];
  __shared__ unsigned batch_end[kMaxRdmaNodes];
  __shared__ int publish_flags[kMaxRdmaNodes];  // node reducers: whether the group publishes its chunk
  __shared__ const char* row_pointers[kCombineWarps][kMaxRdmaNodes];  // a reducing warp's rows of one token
  const InternodeContext& context = args.context;
  const uint64_t calls = calls_before(context);
  // A combine after an aborted dispatch must not trust the handle it left.
  if (device::block_sees_abort(wait_context(context), WaitPhase::kCombineReduce)) return;
  post_launch_shapes<Remote>(context, calls, args.shape);
  const int channel = blockIdx.x / 2;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int num_nodes = context.nodes.num_nodes();
  const int ranks_per_node = context.nodes.ranks_per_node;
  if (blockIdx.x % 2 == 0 && ranks_per_node == 1) {
    // No other rank on the node: no rows to return over NVLink, so every warp reduces tokens.
    reduce_tokens<Remote>(args, channel, WarpGroup{1, warp, kCombineWarps, lane}, batch_end,
                          row_pointers[warp], calls);
  } else if (blockIdx.x % 2 == 0) {
    constexpr int kHalf = kCombineWarps / 2;
    if (warp < kHalf) {
      const int warps_per_rank = kHalf / ranks_per_node;
      const int local = warp / warps_per_rank;
      if (local < ranks_per_node && local != own_local(context)) {
        const WarpGroup group{local, warp % warps_per_rank, warps_per_rank, lane};
        return_rows(args, channel, local, group, &group_values[local], calls);
      }
    } else {
      const WarpGroup group{ranks_per_node, warp - kHalf, kHalf, lane};
      reduce_tokens<Remote>(args, channel, group, batch_end, row_pointers[warp], calls);
    }
  } else {
    const int warps_per_node = kCombineWarps / num_nodes;
    const int node = warp / warps_per_node;
    if (node < num_nodes) {
      const WarpGroup group{node, warp % warps_per_node, warps_per_node, lane};
      reduce_for_node<Remote>(args, channel, node, group, &group_values[node], &publish_flags[node],
                              row_pointers[warp], calls);
    }
  }
  finish_launch<Remote>(context, calls);
}

template <typename Remote>
void launch_combine_with(const InternodeCombineArgs& args, cudaStream_t stream) {
  launch(combine_kernel<Remote>,
         {unsigned(2 * args.rdma.num_channels), kCombineThreads, 0, Residency::kCoResident}, stream, args);
}

}  // namespace epx::kernels::internode
