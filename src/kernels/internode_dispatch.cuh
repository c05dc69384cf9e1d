#pragma once

#include "kernels/internode_common.cuh"
#include "kernels/launch.hpp"
#include "kernels/phase_clock.cuh"
#include "kernels/window_cut.hpp"

// Dispatch across nodes. Every channel has two blocks:
//   even: network senders, one warp group per destination node: the channel's tokens for that node, in token
//         order, as records (row, scales, top-k, source index, the node's local ranks that need the token)
//         into the send ring, then put to the rail peer there (own node: straight into own receive queue);
//   odd:  forwarders, one group per local rank l of this node: every record from every source node's rail
//         peer, and those for l go into the NVLink sub-queue (this rank -> l, source node) or, for l = this
//         rank, straight into the outputs; and receivers, one group per local rank f: the rows forwarded by
//         f, copied from the sub-queues into their final rows.
// Forwarders and receivers poll their sources round-robin and never block on one of them, and every
// sub-queue carries one source rank's rows in token order, so streams never wait for each other.
namespace epx::kernels::internode {

// Block sizes per row format (every group size derives from them), measured on 2 x H100 as 2 virtual nodes
// at 12 / 24 SMs: BF16 records are mostly row, and 1,024 threads (32 warps' copies in flight, 64 registers a
// thread) took 22 % / 18 % less time than 512; FP8 records are half the row plus scales, per-record work
// weighs more, and 512 threads (128 registers, a seventh of the spills) took 8 % less time than 1,024.
constexpr int kBf16DispatchThreads = 1024;
constexpr int kFp8DispatchThreads = 512;

// Bit l: local rank l of `node` takes token t (the input's routing, or a cached handle's copy).
__device__ __forceinline__ uint32_t ranks_of_node_taking(const InternodeDispatchArgs& args, int t, int node) {
  const int ranks_per_node = args.context.nodes.ranks_per_node;
  const uint8_t* flags =
      args.is_token_in_rank + static_cast<size_t>(t) * args.context.peers.num_ranks + node * ranks_per_node;
  uint32_t mask = 0;
  for (int l = 0; l < ranks_per_node; ++l) mask |= (flags[l] != 0 ? 1u : 0u) << l;
  return mask;
}

// ---- Network send: the channel's tokens for `node`, a chunk at a time. ----
template <typename Remote>
__device__ void send_to_node(const InternodeDispatchArgs& args, int channel, int node, const WarpGroup& group,
                             int* shared, uint64_t calls) {
  const InternodeContext& context = args.context;
  const NodeMap& nodes = context.nodes;
  const int own = own_node(context);
  const int dst_rank = nodes.rail_peer(context.peers.rank, node);
  const RailTarget target = RailTarget::of<Remote>(context, dst_rank);
  const int lane = group.lane;
  InternodeBufferMap::Head* head = rdma_head(context);
  const uint64_t base = head->counters.sent[node][channel];
  const device::WaitContext wait = wait_context(context);
  PhaseClock clock(args.phases, PhaseStream::kNodesSend,
                   channel == 0 && node == (own + 1) % nodes.num_nodes() && group.leader());
  if (node != own && group.leader()) wait_rail_peer_ready(context, node, calls);
  group.sync();
  const TokenRange range = channel_token_range(args.num_tokens, args.rdma.num_channels, channel);
  const NormalRecord& r = args.record.normal;
  const int queue_tokens = args.rdma.queue_tokens;
  int pushed = 0;
  int window = 0;
  for (int t0 = range.begin; t0 < range.end;) {
    if (group.leader()) {
      const int64_t consumed =
          device::wait_count_since_u64(&head->counters.head[node][channel], base, pushed - queue_tokens + 1,
                                       wait, dst_rank, WaitPhase::kDispatchSend);
      *shared = min(min(queue_room(pushed, static_cast<int>(consumed), queue_tokens), args.rdma_chunk_tokens),
                    range.end - t0);
      if (node != own && group_aborted(context)) *shared = kStopPolling;  // the room may not be there
    }
    group.sync();
    const int granted = *shared;
    group.sync();
    if (granted == kStopPolling) break;
    clock.mark(0);
    int taken = 0;
    while (taken < granted && t0 < range.end) {
      const int t = t0 + lane;
      const uint32_t local_mask = t < range.end ? ranks_of_node_taking(args, t, node) : 0u;
      unsigned mask = __ballot_sync(~0u, local_mask != 0);
      const int width = tokens_within_room(mask, granted - taken, 32);
      mask &= window_bits(width);
      if (window % group.num_warps == group.warp && lane < width && t < range.end) {
        args.handle.send_head[static_cast<size_t>(t) * nodes.num_nodes() + node] =
            (mask >> lane) & 1u ? pushed + taken + __popc(mask & lanes_below(lane)) : -1;
      }
      for (unsigned todo = worker_tokens(mask, taken, group.warp, group.num_warps, lane); todo != 0;
           todo &= todo - 1) {
        const int bit = __ffs(todo) - 1;
        const int entry = taken + __popc(mask & lanes_below(bit));
        const int token = t0 + bit;
        const uint64_t position = base + pushed + entry;
        char* record = queue_record(args.rdma, context.rdma_base, target, node, own, channel, position);
        write_token_record(record, r, args.in.x, args.in.x_scales, args.in.topk_idx, args.in.topk_weights,
                           token, lane);
        const uint32_t token_mask = __shfl_sync(~0u, local_mask, bit);
        if (lane == 0) *reinterpret_cast<uint32_t*>(record + args.record.rank_mask_offset()) = token_mask;
      }
      taken += __popc(mask);
      t0 += width;
      ++window;
    }
    clock.mark(1);
    // A put reads the records: they are complete before it. Stores to a mapped peer or to this rank's own
    // queue need no fence: the barrier and the leader's release order them (publish_records).
    if (node != own && target.mapped == nullptr) __threadfence();
    group.sync();
    if (taken > 0) {  // the same in every warp (each counted the same ballots)
      publish_records<Remote>(args.rdma, context.rdma_base, target, node, own, channel, base + pushed, taken,
                              &head->counters.tail[own][channel], group);
    }
    pushed += taken;
    clock.mark(2);
  }
  if (group.leader()) head->counters.sent[node][channel] = base + pushed;
  clock.add_to_report(pushed, static_cast<int>(args.record.normal.bytes()));
}

// Records a forwarder group passes per round of one source node's stream at most: two ballots, so each of
// the group's warps has a record or more to copy between the round's barriers.
constexpr int kForwardRound = 64;

// Room that never runs out: this rank's own rows go straight into the outputs.
constexpr int kUnbounded = 1 << 30;

// ---- Own node: the channel's tokens for this node's ranks, straight where the forwarders would put them:
// into each local rank's NVLink sub-queue (this rank -> l, own node) and, for this rank, into the outputs.
// The records of the own node never enter the own receive queue (written there and copied out again, they
// cost two SM copies of the own node's share instead of one), so the own node's network counters stay as they
// are. The stream keeps the forwarders' order and positions: record e of the own node's stream is its e-th
// token any local rank needs (send_head, forward_mask as the forwarders wrote them), and rank l's rows from
// it come in token order. `rooms`: kMaxNvlRanks ints of shared memory for the leader's room counts. ----
// kMaxRanks: a bound of the node's ranks (1, 2, 4 or 8), the size of the per-rank registers below.
template <int kMaxRanks>
__device__ void deliver_own_node_up_to(const InternodeDispatchArgs& args, int channel, const WarpGroup& group,
                                       int* rooms, uint64_t calls) {
  const InternodeContext& context = args.context;
  const NodeMap& nodes = context.nodes;
  const int num_nodes = nodes.num_nodes();
  const int ranks_per_node = nodes.ranks_per_node;
  const int num_channels = args.rdma.num_channels;
  const int own = own_node(context);
  const int me = own_local(context);
  const int lane = group.lane;
  const int queue_tokens = args.nvl.queue_tokens;
  auto* my_nvl = nvl_counters(context.peers.local_base);
  const device::WaitContext wait = wait_context(context);
  if (group.leader()) {
    for (int l = 0; l < ranks_per_node; ++l) {
      if (l != me) wait_local_peer_ready(context, l, calls);
    }
  }
  group.sync();
  const TokenRange range = channel_token_range(args.num_tokens, num_channels, channel);
  const int first_record = args.handle.node_channel_offset[own * num_channels + channel];
  const int self_row0 = args.handle.recv_channel_offset[(own * ranks_per_node + me) * num_channels + channel];
  // Per local rank (unrolled, so they stay in registers; every warp counts the same ballots, so every warp
  // holds the same values): the records written to its sub-queue so far (its tail, counted since the Buffer
  // began), and the room left this round.
  uint32_t next[kMaxRanks];
  int left[kMaxRanks];
#pragma unroll
  for (int l = 0; l < kMaxRanks; ++l) next[l] = l < ranks_per_node ? my_nvl->sent[l][own][channel] : 0u;
  int self_rows = 0;  // this rank's own rows written
  int pushed = 0;     // records of the own node's stream so far
  int window = 0;
  // Which lanes' tokens local rank l needs.
  const auto needing = [&](uint32_t local_mask, int l) { return __ballot_sync(~0u, (local_mask >> l) & 1u); };
  for (int t0 = range.begin; t0 < range.end;) {
    // The room in each sub-queue, waited for until there is some (its reader drains it whatever this rank
    // does, so the wait ends); this rank's own rows need none.
    if (group.leader()) {
      for (int l = 0; l < ranks_per_node; ++l) {
        // Consumed minus written (<= 0): the room is the queue less what is unread. A round takes at most
        // kForwardRound rows for a rank, as a forwarder's does, so its reader sees the tail move as often.
        rooms[l] = l == me ? kUnbounded
                           : min(queue_tokens + device::wait_count_since(
                                                    &my_nvl->head[l][own][channel], next[l], 1 - queue_tokens,
                                                    wait, own * ranks_per_node + l, WaitPhase::kDispatchSend),
                                 kForwardRound);
      }
      if (group_aborted(context)) rooms[0] = kStopPolling;
    }
    group.sync();
#pragma unroll
    for (int l = 0; l < kMaxRanks; ++l) left[l] = l < ranks_per_node ? rooms[l] : 0;
    if (left[0] == kStopPolling) break;  // the leader writes rooms again only after the round's barrier
    // Windows of 32 tokens, each cut before the first token a full sub-queue would not take.
    while (t0 < range.end) {
      const int t = t0 + lane;
      uint32_t local_mask = t < range.end ? ranks_of_node_taking(args, t, own) : 0u;
      const int full = min(32, range.end - t0);
      int width = full;
#pragma unroll
      for (int l = 0; l < kMaxRanks; ++l)
        width = min(width, tokens_within_room(needing(local_mask, l), left[l], full));
      local_mask = (window_bits(width) >> lane) & 1u ? local_mask : 0u;
      const unsigned mask = __ballot_sync(~0u, local_mask != 0);
      if (window % group.num_warps == group.warp && lane < width && t < range.end) {
        args.handle.send_head[static_cast<size_t>(t) * num_nodes + own] =
            (mask >> lane) & 1u ? pushed + __popc(mask & lanes_below(lane)) : -1;
      }
      for (unsigned todo = worker_tokens(mask, pushed, group.warp, group.num_warps, lane); todo != 0;
           todo &= todo - 1) {
        const int bit = __ffs(todo) - 1;
        const int token = t0 + bit;
        const uint32_t token_mask = __shfl_sync(~0u, local_mask, bit);
        if (lane == 0) {
          args.handle.forward_mask[first_record + pushed + __popc(mask & lanes_below(bit))] =
              static_cast<uint8_t>(token_mask);
        }
        for (int l = 0; l < ranks_per_node; ++l) {
          if (!((token_mask >> l) & 1u)) continue;
          const int before = __popc(needing(local_mask, l) & lanes_below(bit));  // l's rows ahead of it
          if (l == me) {
            write_row_from_inputs(args, self_row0 + self_rows + before, token, lane);
          } else {
            char* record = args.nvl.record(nvl_base(context, l), me, l, own, channel,
                                           next[l] + static_cast<uint32_t>(before));
            write_token_record(record, args.record.normal, args.in.x, args.in.x_scales, args.in.topk_idx,
                               args.in.topk_weights, token, lane);
          }
        }
      }
#pragma unroll
      for (int l = 0; l < kMaxRanks; ++l) {
        const int count = __popc(needing(local_mask, l));
        left[l] -= count;
        if (l == me) {
          self_rows += count;
        } else {
          next[l] += static_cast<uint32_t>(count);
        }
      }
      pushed += __popc(mask);
      t0 += width;
      ++window;
      if (width < full) break;  // a sub-queue is full: publish, then wait for room
    }
    // The group's stores come before each reader's tail (the barrier, then the leader's release).
    group.sync();
    if (group.leader()) {
      for (int l = 0; l < ranks_per_node; ++l) {
        if (l == me) continue;
        device::st_release_sys(
            reinterpret_cast<int*>(&nvl_counters(nvl_base(context, l))->tail[me][own][channel]),
            static_cast<int>(next[l]));
      }
    }
  }
  if (group.leader()) {
    for (int l = 0; l < ranks_per_node; ++l) {
      if (l != me) my_nvl->sent[l][own][channel] = next[l];
    }
  }
}

__device__ void deliver_own_node(const InternodeDispatchArgs& args, int channel, const WarpGroup& group,
                                 int* rooms, uint64_t calls) {
  const int ranks_per_node = args.context.nodes.ranks_per_node;
  if (ranks_per_node == 1) {
    deliver_own_node_up_to<1>(args, channel, group, rooms, calls);
  } else if (ranks_per_node == 2) {
    deliver_own_node_up_to<2>(args, channel, group, rooms, calls);
  } else if (ranks_per_node <= 4) {
    deliver_own_node_up_to<4>(args, channel, group, rooms, calls);
  } else {
    deliver_own_node_up_to<kMaxNvlRanks>(args, channel, group, rooms, calls);
  }
}

// What the forwarder groups of a block share about one source node's stream.
struct ForwardShared {
  int progress[kMaxNvlRanks][kMaxRdmaNodes];   // records of node m each group has passed
  unsigned long long released[kMaxRdmaNodes];  // records of node m whose slots were given back
  int values[kMaxNvlRanks];                    // one per group, for QueueEnd-style sharing
};

// ---- Forward: every record from every source node, those for local rank `dst` onwards. ----
template <typename Remote>
__device__ void forward_to(const InternodeDispatchArgs& args, int channel, int dst, const WarpGroup& group,
                           ForwardShared& shared, uint64_t calls) {
  const InternodeContext& context = args.context;
  const NodeMap& nodes = context.nodes;
  const int num_nodes = nodes.num_nodes();
  const int num_channels = args.rdma.num_channels;
  const int me = own_local(context);
  const int own = own_node(context);
  const int lane = group.lane;
  const bool to_self = dst == me;
  InternodeBufferMap::Head* head = rdma_head(context);
  void* dst_base = nvl_base(context, dst);
  auto* my_nvl = nvl_counters(context.peers.local_base);
  const device::WaitContext wait = wait_context(context);
  PhaseClock clock(args.phases, PhaseStream::kNodesForward, channel == 0 && to_self && group.leader());
  if (!to_self && group.leader()) wait_local_peer_ready(context, dst, calls);
  group.sync();

  int progress[kMaxRdmaNodes];
  int sent[kMaxRdmaNodes];  // rows handed to dst (or, to_self, written) per source node
  int done_nodes = 0;
  for (int m = 0; m < num_nodes; ++m) {
    const int count = args.handle.node_channel_offset[m * num_channels + channel + 1] -
                      args.handle.node_channel_offset[m * num_channels + channel];
    // The own node's records never enter the receive queue: its senders deliver them (deliver_own_node).
    progress[m] = m == own ? count : 0;
    sent[m] = 0;
    if (progress[m] == count) ++done_nodes;
  }
  device::StallClock stall;
  stall.restart();
  bool stop = false;         // the leader's: the group was aborted, leave the loop
  unsigned shapes_seen = 0;  // the leader's: source nodes whose launch fingerprint it checked
  while (done_nodes < num_nodes) {
    bool moved = false;
    for (int m = 0; m < num_nodes; ++m) {
      const int first_record = args.handle.node_channel_offset[m * num_channels + channel];
      const int count = args.handle.node_channel_offset[m * num_channels + channel + 1] - first_record;
      if (progress[m] == count) continue;
      const uint64_t rdma_base_count = head->counters.consumed[m][channel];
      const uint32_t nvl_base_count = my_nvl->sent[dst][m][channel];
      if (group.leader()) {
        const int landed = static_cast<int>(
            static_cast<int64_t>(device::ld_acquire_sys_u64(&head->counters.tail[m][channel]) -
                                 rdma_base_count) -
            progress[m]);
        int room = kForwardRound;
        if (!to_self) {
          const int consumed = count_since(static_cast<uint32_t>(device::ld_acquire_sys(
                                               reinterpret_cast<const int*>(&my_nvl->head[dst][m][channel]))),
                                           nvl_base_count);
          room = queue_room(sent[m], consumed, args.nvl.queue_tokens);
        }
        // Records of another shape are never read: the group aborts, naming the field.
        if (landed > 0 && m != own && !((shapes_seen >> m) & 1u)) {
          shapes_seen |= 1u << m;
          stop |= !check_rail_launch_shape(context, calls, args.shape, m, WaitPhase::kDispatchReceive);
        }
        shared.values[group.group] = room > 0 ? min(landed, kForwardRound) : 0;
        shared.values[group.group] |= min(room, kForwardRound) << 16;
        if (stop) shared.values[group.group] = kStopPolling;
      }
      group.sync();
      const int packed = shared.values[group.group];
      group.sync();
      if (packed == kStopPolling) return;
      const int available = packed & 0xffff;
      const int room = packed >> 16;
      clock.mark(0);
      if (available == 0) continue;
      // Which of the next records go to dst, 32 at a time (one ballot each), cut after the room-th one.
      const int src_rank = m * nodes.ranks_per_node + me;
      int taken = 0;   // records for dst among those passed this round
      int passed = 0;  // records passed this round
      while (passed < available) {
        const int window = min(32, available - passed);
        const uint64_t position = rdma_base_count + progress[m] + passed;
        const uint32_t record_mask =
            lane < window
                ? device::ld_b32(args.rdma.recv_record(context.rdma_base, m, channel, position + lane) +
                                 args.record.rank_mask_offset())
                : 0u;
        unsigned mask = __ballot_sync(~0u, (record_mask >> dst) & 1u);
        const int width = tokens_within_room(mask, room - taken, window);
        mask &= window_bits(width);
        if (dst == 0 && group.warp == 0 && lane < width)
          args.handle.forward_mask[first_record + progress[m] + passed + lane] =
              static_cast<uint8_t>(record_mask);
        for (unsigned todo = worker_tokens(mask, taken, group.warp, group.num_warps, lane); todo != 0;
             todo &= todo - 1) {
          const int bit = __ffs(todo) - 1;
          const int entry = taken + __popc(mask & lanes_below(bit));
          const char* source = args.rdma.recv_record(context.rdma_base, m, channel, position + bit);
          if (to_self) {
            const int cell = src_rank * num_channels + channel;
            const int row = args.handle.recv_channel_offset[cell] + sent[m] + entry;
            // NOTES: a rail peer whose room wait was abandoned (an abort of its node, which does not reach
            // this one) may have overwritten unread records, so the masks may select more rows than this
            // source sends: never write past its rows.
            if (row < args.handle.recv_channel_offset[cell + 1])
              write_row_from_record(args, row, source, lane);
          } else {
            char* target = args.nvl.record(dst_base, me, dst, m, channel, nvl_base_count + sent[m] + entry);
            warp_copy<true>(target, source, args.record.bytes(), lane);
          }
        }
        taken += __popc(mask);
        passed += width;
        if (width < window) break;  // dst's room is full
      }
      clock.mark(1);
      group.sync();
      sent[m] += taken;
      progress[m] += passed;
      if (progress[m] == count) ++done_nodes;
      if (group.leader()) {
        if (!to_self && taken > 0) {
          device::st_release_sys(reinterpret_cast<int*>(&nvl_counters(dst_base)->tail[me][m][channel]),
                                 static_cast<int>(nvl_base_count + sent[m]));
        }
        // Give the records back to the source once every group passed them.
        volatile int* group_progress = &shared.progress[0][m];
        group_progress[dst * kMaxRdmaNodes] = progress[m];
        __threadfence_block();
        int passed = progress[m];
        for (int g = 0; g < nodes.ranks_per_node; ++g)
          passed = min(passed, group_progress[g * kMaxRdmaNodes]);
        const unsigned long long before =
            atomicMax(&shared.released[m], static_cast<unsigned long long>(passed));
        if (static_cast<unsigned long long>(passed) > before) {
          Remote::signal_add(&head->counters.head[own][channel], passed - before,
                             nodes.rail_peer(context.peers.rank, m));
        }
      }
      clock.mark(2);
      moved = true;
    }
    if (moved) {
      stall.restart();
    } else if (group.leader()) {
      // Named: the rail peer of the first source node still short of records.
      const auto waiting_for = [&] {
        for (int m = 0; m < num_nodes; ++m) {
          const int count = args.handle.node_channel_offset[m * num_channels + channel + 1] -
                            args.handle.node_channel_offset[m * num_channels + channel];
          if (progress[m] < count) return nodes.rail_peer(context.peers.rank, m);
        }
        return context.peers.rank;
      };
      stop = stall.check_naming(wait, waiting_for, WaitPhase::kDispatchReceive, 0, done_nodes);
    }
  }
  if (!to_self && group.leader()) {
    // Not the own node's count: deliver_own_node (the sender block, running at the same time) owns it, and
    // even adding 0 here is a load and a store that could put back the value it had before that block's.
    for (int m = 0; m < num_nodes; ++m) {
      if (m != own) my_nvl->sent[dst][m][channel] += sent[m];
    }
  }
  int forwarded = 0;
  for (int m = 0; m < num_nodes; ++m) forwarded += m == own ? 0 : progress[m];
  clock.add_to_report(forwarded, static_cast<int>(args.record.bytes()));
}

// ---- Receive: the rows local rank `src` forwarded, from its sub-queues into their final rows. ----
__device__ void receive_from(const InternodeDispatchArgs& args, int channel, int src, const WarpGroup& group,
                             int* shared, uint64_t calls) {
  const InternodeContext& context = args.context;
  const NodeMap& nodes = context.nodes;
  const int num_nodes = nodes.num_nodes();
  const int num_channels = args.rdma.num_channels;
  const int me = own_local(context);
  auto* my_nvl = nvl_counters(context.peers.local_base);
  void* src_base = nvl_base(context, src);
  const device::WaitContext wait = wait_context(context);
  int got[kMaxRdmaNodes];
  int done_nodes = 0;
  for (int m = 0; m < num_nodes; ++m) {
    got[m] = 0;
    const int cell = (m * nodes.ranks_per_node + src) * num_channels + channel;
    if (args.handle.recv_channel_offset[cell + 1] == args.handle.recv_channel_offset[cell]) ++done_nodes;
  }
  device::StallClock stall;
  stall.restart();
  bool stop = false;           // the leader's: the group was aborted, leave the loop
  bool shape_checked = false;  // the leader's: src's launch fingerprint was checked
  while (done_nodes < num_nodes) {
    bool moved = false;
    for (int m = 0; m < num_nodes; ++m) {
      const int cell = (m * nodes.ranks_per_node + src) * num_channels + channel;
      const int row0 = args.handle.recv_channel_offset[cell];
      const int count = args.handle.recv_channel_offset[cell + 1] - row0;
      if (got[m] == count) continue;
      const uint32_t base = my_nvl->consumed[src][m][channel];
      if (group.leader()) {
        const int landed = count_since(static_cast<uint32_t>(device::ld_acquire_sys(
                                           reinterpret_cast<const int*>(&my_nvl->tail[src][m][channel]))),
                                       base);
        // Records of another shape are never read: the group aborts, naming the field.
        if (!stop && !shape_checked && min(landed, count) > got[m]) {
          shape_checked = true;
          stop = !check_local_launch_shape(context, calls, args.shape, src, WaitPhase::kDispatchReceive);
        }
        *shared = stop ? kStopPolling : min(landed, count) - got[m];
      }
      group.sync();
      const int ready = *shared;
      group.sync();
      if (ready == kStopPolling) return;
      if (ready == 0) continue;
      for (int j = group.warp; j < ready; j += group.num_warps) {
        const char* record =
            args.nvl.record(context.peers.local_base, src, me, m, channel, base + got[m] + j);
        write_row_from_record(args, row0 + got[m] + j, record, group.lane);
      }
      group.sync();
      got[m] += ready;
      if (got[m] == count) ++done_nodes;
      if (group.leader()) {
        device::st_release_sys(reinterpret_cast<int*>(&nvl_counters(src_base)->head[me][m][channel]),
                               static_cast<int>(base + got[m]));
      }
      moved = true;
    }
    if (moved) {
      stall.restart();
    } else if (group.leader()) {
      // Named: src while it has not started this launch; then the source rank of the first stream still
      // short of rows (src forwards what that rank sent, and waits for it).
      const auto waiting_for = [&] {
        const int forwarder = own_node(context) * nodes.ranks_per_node + src;
        if (!local_rank_started(context, calls, src)) return forwarder;
        for (int m = 0; m < num_nodes; ++m) {
          const int cell = (m * nodes.ranks_per_node + src) * num_channels + channel;
          if (got[m] < args.handle.recv_channel_offset[cell + 1] - args.handle.recv_channel_offset[cell])
            return m * nodes.ranks_per_node + src;
        }
        return forwarder;
      };
      stop = stall.check_naming(wait, waiting_for, WaitPhase::kDispatchReceive, 0, done_nodes);
    }
  }
  if (group.leader()) {
    for (int m = 0; m < num_nodes; ++m) my_nvl->consumed[src][m][channel] += got[m];
  }
}

template <typename Remote, int kThreads>
__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(InternodeDispatchArgs args) {
  constexpr int kWarps = kThreads / 32;
  constexpr int kHalfWarps = kWarps / 2;
  static_assert(kWarps >= kMaxRdmaNodes && kHalfWarps >= kMaxNvlRanks, "a group per node and per local rank");
  __shared__ ForwardShared forward_shared;
  __shared__ int group_values[kMaxRdmaNodes];
  const InternodeContext& context = args.context;
  const uint64_t calls = calls_before(context);
  // A dispatch after an aborted notify must not trust the offsets it left.
  if (device::block_sees_abort(wait_context(context), WaitPhase::kDispatchReceive)) return;
  post_launch_shapes<Remote>(context, calls, args.shape);
  const int channel = blockIdx.x / 2;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int num_nodes = context.nodes.num_nodes();
  const int ranks_per_node = context.nodes.ranks_per_node;
  if (threadIdx.x < kMaxNvlRanks * kMaxRdmaNodes) (&forward_shared.progress[0][0])[threadIdx.x] = 0;
  if (threadIdx.x < kMaxRdmaNodes) forward_shared.released[threadIdx.x] = 0;
  __syncthreads();
  if (blockIdx.x % 2 == 0) {
    const int warps_per_node = kWarps / num_nodes;
    const int node = warp / warps_per_node;
    if (node < num_nodes) {
      const WarpGroup group{node, warp % warps_per_node, warps_per_node, lane};
      if (node == own_node(context)) {
        deliver_own_node(args, channel, group, forward_shared.values, calls);
      } else {
        send_to_node<Remote>(args, channel, node, group, &group_values[node], calls);
      }
    }
  } else if (ranks_per_node == 1) {
    // No other rank on the node: nothing to receive over NVLink, so every warp forwards (into the outputs).
    forward_to<Remote>(args, channel, 0, WarpGroup{0, warp, kWarps, lane}, forward_shared, calls);
  } else {
    const int warps_per_rank = kHalfWarps / ranks_per_node;
    const int half_warp = warp % kHalfWarps;
    const int local = half_warp / warps_per_rank;
    if (local < ranks_per_node) {
      if (warp < kHalfWarps) {
        const WarpGroup group{local, half_warp % warps_per_rank, warps_per_rank, lane};
        forward_to<Remote>(args, channel, local, group, forward_shared, calls);
      } else if (local != own_local(context)) {
        // Named barriers 1..L serve the forwarders, L + 1 .. 2L - 1 the receivers (at most 15).
        const int slot = local < own_local(context) ? local : local - 1;
        const WarpGroup group{ranks_per_node + slot, half_warp % warps_per_rank, warps_per_rank, lane};
        receive_from(args, channel, local, group, &group_values[local], calls);
      }
    }
  }
  __syncthreads();
  if (blockIdx.x % 2 == 1 && threadIdx.x == 0) {
    // Every group passed every record (and gave it back); the stream's consumed count moves on.
    for (int m = 0; m < num_nodes; ++m) {
      if (m == own_node(context)) continue;  // nothing of the own node passed the receive queue
      const int count = args.handle.node_channel_offset[m * args.rdma.num_channels + channel + 1] -
                        args.handle.node_channel_offset[m * args.rdma.num_channels + channel];
      rdma_head(context)->counters.consumed[m][channel] += count;
    }
  }
  finish_launch<Remote>(context, calls);
}

template <typename Remote>
void launch_dispatch_with(const InternodeDispatchArgs& args, cudaStream_t stream) {
  const unsigned blocks = 2 * args.rdma.num_channels;
  if (args.record.normal.num_scales > 0) {
    launch(dispatch_kernel<Remote, kFp8DispatchThreads>,
           {blocks, kFp8DispatchThreads, 0, Residency::kCoResident}, stream, args);
  } else {
    launch(dispatch_kernel<Remote, kBf16DispatchThreads>,
           {blocks, kBf16DispatchThreads, 0, Residency::kCoResident}, stream, args);
  }
}

}  // namespace epx::kernels::internode
