#pragma once

#include <cstdint>

#include "device/ptx.cuh"
#include "device/wait.cuh"
#include "gpu/cuda_check.hpp"
#include "kernels/internode_kernels.hpp"
#include "kernels/normal_queue.cuh"
#include "kernels/shape_check.cuh"
#include "kernels/warp_copy.cuh"

// What the kernels of normal mode across nodes share. They reach the network through `Remote`, a transport
// policy (the NVSHMEM one lives in transport/nvshmem):
//   put_signal_warp(dst, src, bytes, signal, add, rank)  warp-collective, non-blocking put of [src, src +
//   bytes)
//                    of this rank's symmetric buffer to symmetric address `dst` on `rank`, then adds `add` to
//                    the uint64 signal word `signal` there once the data landed; ordered after every earlier
//                    put of the calling thread to `rank` (the policy fences)
//   signal_add(signal, add, rank)   one thread: adds `add` to `rank`'s uint64 word at symmetric `signal`
//   quiet()                         every operation this thread issued is complete
//   peer_pointer(symmetric, rank)   the address through which this thread loads and stores `rank`'s copy of
//                    the symmetric address `symmetric`, or nullptr when the transport reaches `rank` only
//                    through its puts (a NIC: IBGDA, a proxy). A non-null result maps the whole symmetric
//                    allocation at one offset (result + k is `rank`'s copy of symmetric + k). Accesses
//                    through it are plain memory operations, ordered by the PTX memory model at system scope
//                    (device/ptx.cuh); the policy's fences and quiet() do not order them.
// Symmetric addresses are this rank's addresses of the place (the same offset is valid on every rank).
namespace epx::kernels::internode {

__device__ __forceinline__ device::WaitContext wait_context(const InternodeContext& context) {
  return {context.peers.failure_record, context.peers.rank, context.peers.timeout_ns, context.peers.abort};
}

// What a polling group's leader shares instead of a count once its StallClock said stop (an abort): every
// warp of the group leaves the loop, reading nothing more that peers were to write.
constexpr int kStopPolling = -0x7fffffff - 1;

__device__ __forceinline__ InternodeBufferMap::Head* rdma_head(const InternodeContext& context) {
  return InternodeBufferMap::head(context.rdma_base);
}

__device__ __forceinline__ int own_node(const InternodeContext& context) {
  return context.nodes.node_of(context.peers.rank);
}
__device__ __forceinline__ int own_local(const InternodeContext& context) {
  return context.nodes.local_rank(context.peers.rank);
}
// The NVLink buffer of local rank `local` of this rank's node.
__device__ __forceinline__ void* nvl_base(const InternodeContext& context, int local) {
  return context.peers.peer_bases[own_node(context) * context.nodes.ranks_per_node + local];
}
__device__ __forceinline__ ForwardBufferMap::QueueCounters* nvl_counters(void* base) {
  return &ForwardBufferMap::head(base)->counters;
}

// Dispatch and combine launches this rank finished before the running one (read by every block at its start).
__device__ __forceinline__ uint64_t calls_before(const InternodeContext& context) {
  return *reinterpret_cast<volatile uint64_t*>(&rdma_head(context)->control.calls_done);
}

// Called by every thread of every block at its end: the last block counts the call as done and tells the
// node's ranks (over NVLink) and the rail peers (over the network), which may then write into this rank's
// queues with the next call's map.
template <typename Remote>
__device__ __forceinline__ void finish_launch(const InternodeContext& context, uint64_t calls) {
  auto* control = &rdma_head(context)->control;
  // Each block's puts and signals are complete before "done" is.
  if (!count_call_done_by_last_block(control, calls, [] { Remote::quiet(); })) return;
  const NodeMap& nodes = context.nodes;
  const int t = threadIdx.x;
  if (t < nodes.ranks_per_node && t != own_local(context)) {
    device::st_release_sys(
        &ForwardBufferMap::head(nvl_base(context, t))->control.done_signal[own_local(context)],
        static_cast<int>(calls + 1));
  }
  const int node = t - 32;  // a second warp signals the rail peers
  if (node >= 0 && node < nodes.num_nodes() && node != own_node(context)) {
    Remote::signal_add(&control->done_signal[own_node(context)], 1,
                       nodes.rail_peer(context.peers.rank, node));
    Remote::quiet();
  }
}

// Waits until local rank `local` finished every launch before this one (then nothing of an earlier call is
// still unread in its NVLink queues).
__device__ __forceinline__ void wait_local_peer_ready(const InternodeContext& context, int local,
                                                      uint64_t calls) {
  device::wait_at_least(&ForwardBufferMap::head(context.peers.local_base)->control.done_signal[local],
                        static_cast<int>(calls), wait_context(context),
                        own_node(context) * context.nodes.ranks_per_node + local, WaitPhase::kPreviousCall);
}

// ... and rail peer on `node` likewise for its network queues.
__device__ __forceinline__ void wait_rail_peer_ready(const InternodeContext& context, int node,
                                                     uint64_t calls) {
  device::wait_count_since_u64(&rdma_head(context)->control.done_signal[node], 0, static_cast<int64_t>(calls),
                               wait_context(context), context.nodes.rail_peer(context.peers.rank, node),
                               WaitPhase::kPreviousCall);
}

// The abort word does not reach other nodes, so an aborted rank must not feed them: a group whose wait was
// abandoned (the waits then return as if satisfied) would put rows it never received, or overwrite ring slots
// a put still reads. Every network sender checks this after its waits and before each put (one load); the
// peers on other nodes then stop by their own bound, naming this rank, instead of receiving wrong rows.
__device__ __forceinline__ bool group_aborted(const InternodeContext& context) {
  return device::read_abort_word(wait_context(context)) != 0;
}

// A wait for what this rank's own blocks produce (its node's partials, its own records): twice the bound, so
// the blocks' own bounded waits, which name the peer they wait for, give up first.
__device__ __forceinline__ device::WaitContext own_blocks_wait_context(const InternodeContext& context) {
  device::WaitContext wait = wait_context(context);
  wait.timeout_ns = wait.timeout_ns > UINT64_MAX / 2 ? UINT64_MAX : 2 * wait.timeout_ns;
  return wait;
}

// ---- Launch fingerprints across nodes: a dispatch or combine whose shape (or operation) differs between
// ranks reads records of another map. Block 0 posts the launch's fingerprint to the node's ranks (NVLink:
// ForwardBufferMap::Control, the values in the abort-words slots) and to its rail peers (network:
// InternodeBufferMap::LaunchShapes) at the launch's start; a receiver checks a source's before it reads the
// source's first record of the launch. ----

static_assert(sizeof(ShapeFingerprint) == sizeof(int) * InternodeBufferMap::kShapeInts,
              "a launch fingerprint slot holds one ShapeFingerprint after the launch number");

// Block 0: threads l < L post to local rank l, warp 1 puts to every rail peer and waits for the puts (the
// staging slot is rewritten two launches later). `calls`: calls_before().
template <typename Remote>
__device__ __forceinline__ void post_launch_shapes(const InternodeContext& context, uint64_t calls,
                                                   const ShapeFingerprint& shape) {
  if (blockIdx.x != 0) return;
  const NodeMap& nodes = context.nodes;
  const PeerContext& peers = context.peers;
  const int me = own_local(context);
  const int own = own_node(context);
  const uint32_t launch = static_cast<uint32_t>(calls + 1);
  const int t = threadIdx.x;
  if (t < nodes.ranks_per_node && t != me) {
    const int peer = own * nodes.ranks_per_node + t;
    post_launch_shape_to(peers.abort.peers[peer] != nullptr
                             ? AbortWordsMap::normal_launch_shape(peers.abort.peers[peer], peers.rank)
                             : nullptr,
                         &ForwardBufferMap::head(nvl_base(context, t))->control.launch_shape[me], launch,
                         shape);
  }
  if (t / 32 != 1 || nodes.num_nodes() == 1) return;
  auto* shapes = &rdma_head(context)->launch_shapes;
  const int parity = static_cast<int>(calls % 2);
  int* staged = shapes->own[parity];
  const int lane = t % 32;
  if (lane == 0) staged[0] = static_cast<int>(launch);
  if (lane == 1) staged[1] = shape.hash;
  if (lane >= 2 && lane < InternodeBufferMap::kLaunchShapeInts) staged[lane] = shape.values[lane - 2];
  __threadfence();  // the staged slot is complete before the puts that read it
  __syncwarp();
  for (int node = 0; node < nodes.num_nodes(); ++node) {
    if (node == own) continue;
    Remote::put_signal_warp(shapes->from_node[parity][own], staged,
                            sizeof(int) * InternodeBufferMap::kLaunchShapeInts, &shapes->signal[own], 1,
                            nodes.rail_peer(peers.rank, node));
  }
  Remote::quiet();
}

// One thread, before reading the first record of this launch from the rail peer on `node`: false when the
// wait was abandoned or the peer's fingerprint differs (the group is then aborted, naming the field).
__device__ __forceinline__ bool check_rail_launch_shape(const InternodeContext& context, uint64_t calls,
                                                        const ShapeFingerprint& shape, int node,
                                                        WaitPhase phase) {
  auto* shapes = &rdma_head(context)->launch_shapes;
  const int peer = context.nodes.rail_peer(context.peers.rank, node);
  const device::WaitContext wait = wait_context(context);
  device::wait_count_since_u64(&shapes->signal[node], 0, static_cast<int64_t>(calls + 1), wait, peer, phase);
  if (group_aborted(context)) return false;
  const volatile int* slot = shapes->from_node[calls % 2][node];
  // Its signal counts its launches, so launch calls + 1 landed; a later one writes the other parity.
  if (static_cast<uint32_t>(slot[0]) != static_cast<uint32_t>(calls + 1) || slot[1] == shape.hash)
    return true;
  report_shape_mismatch(wait, peer, shape, reinterpret_cast<const volatile ShapeFingerprint*>(slot + 1));
  return false;
}

// One thread, before reading the first record of this launch from local rank `local` (NVLink).
__device__ __forceinline__ bool check_local_launch_shape(const InternodeContext& context, uint64_t calls,
                                                         const ShapeFingerprint& shape, int local,
                                                         WaitPhase phase) {
  const PeerContext& peers = context.peers;
  const int peer = own_node(context) * context.nodes.ranks_per_node + local;
  return check_launch_shape_at(
      wait_context(context), peer, &ForwardBufferMap::head(peers.local_base)->control.launch_shape[local],
      peers.abort.peers[peer] != nullptr ? AbortWordsMap::normal_launch_shape(peers.abort.local, peer)
                                         : nullptr,
      static_cast<uint32_t>(calls + 1), shape, phase);
}

// Whether local rank `local` has started this launch (posted its fingerprint here): a stalled stream it
// forwards waits for its source then, not for it.
__device__ __forceinline__ bool local_rank_started(const InternodeContext& context, uint64_t calls,
                                                   int local) {
  return launch_posted(device::ld_acquire_sys_u64(
                           &ForwardBufferMap::head(context.peers.local_base)->control.launch_shape[local]),
                       static_cast<uint32_t>(calls + 1));
}

// Output row `row` of dispatch from a queue record (which peers rewrite while the kernel runs, so it is read
// coherently): the token row, its scales, its top-k as local expert ids (-1 and weight 0 elsewhere), its
// source index. One warp; the fields' loads go out before the row's (record_fields.cuh).
// NOTES: bulk copies through shared memory (1.5 KiB pieces, four a warp, for all 32 warps) made the
// forwarders 30 % slower than these warp copies (2 x H100, 2 nodes of 1 rank, 12 SMs: BF16 copy phase 692 ->
// 898 µs); the staging leaves the block's register spills a small L1.
__device__ __forceinline__ void write_row_from_record(const InternodeDispatchArgs& args, int row,
                                                      const char* record, int lane) {
  const NormalRecord& r = args.record.normal;
  const RecordFields fields = load_record_fields(r, record, lane);
  warp_copy<true>(static_cast<char*>(args.out.recv_x) + static_cast<size_t>(row) * r.x_bytes, record,
                  r.x_bytes, lane);
  const FieldOutputs out{args.out.recv_x_scales, args.out.recv_topk_idx, args.out.recv_topk_weights,
                         args.handle.recv_src_idx};
  store_output_fields<true>(out, r, row, fields, record + r.scales_offset(), args.context.peers.rank,
                            args.num_experts / args.context.peers.num_ranks, lane);
}

// Output row `row` of dispatch from this rank's own token `token` (the inputs), as write_row_from_record does
// from a record. One warp.
__device__ __forceinline__ void write_row_from_inputs(const InternodeDispatchArgs& args, int row, int token,
                                                      int lane) {
  const NormalRecord& r = args.record.normal;
  const RecordFields fields =
      load_input_fields(r, args.in.x_scales, args.in.topk_idx, args.in.topk_weights, token, lane);
  warp_copy<false>(static_cast<char*>(args.out.recv_x) + static_cast<size_t>(row) * r.x_bytes,
                   static_cast<const char*>(args.in.x) + static_cast<size_t>(token) * r.x_bytes, r.x_bytes,
                   lane);
  const FieldOutputs out{args.out.recv_x_scales, args.out.recv_topk_idx, args.out.recv_topk_weights,
                         args.handle.recv_src_idx};
  store_output_fields<false>(out, r, row, fields,
                             args.in.x_scales + static_cast<size_t>(token) * r.num_scales,
                             args.context.peers.rank, args.num_experts / args.context.peers.num_ranks, lane);
}

// The rail peer a network sender group puts to: its rank, and its symmetric buffer as this GPU's loads and
// stores reach it (Remote::peer_pointer of this rank's base, looked up once per group), or nullptr when only
// the transport's puts do.
struct RailTarget {
  int rank;
  char* mapped;

  template <typename Remote>
  __device__ static RailTarget of(const InternodeContext& context, int rank) {
    return {rank, context.map_rail_peers ? static_cast<char*>(Remote::peer_pointer(context.rdma_base, rank))
                                         : nullptr};
  }
  // `rank`'s copy of this rank's symmetric address `symmetric` (in the buffer at `rdma_base`); mapped only.
  template <typename T>
  __device__ T* at(const void* rdma_base, T* symmetric) const {
    return reinterpret_cast<T*>(
        mapped + (reinterpret_cast<const char*>(symmetric) - static_cast<const char*>(rdma_base)));
  }
};

// Adds `value` to the uint64 word at `address` (a peer's, mapped) with release semantics at system scope and
// no result: releases what this thread ordered before it, cumulatively (what a barrier made its own: the
// group's stores), without waiting for the add's round trip.
__device__ __forceinline__ void red_add_release_sys_u64(uint64_t* address, uint64_t value) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(address), "l"(value) : "memory");
}

// Where a sender writes record `position` of its stream to `dst_node` on `channel`:
// - its own node: straight into its own receive queue;
// - a rail peer it maps (load/store: NVSHMEM's P2P transport, an NVLink fabric): straight into the peer's
// receive
//   queue, the slot the put would have filled (the sender writes a slot only once the receiver gave it back,
//   as for the put);
// - any other peer (a NIC): its send ring, which publish_records puts from.
__device__ __forceinline__ char* queue_record(const InternodeBufferMap& map, void* rdma_base,
                                              const RailTarget& target, int dst_node, int own_node_idx,
                                              int channel, uint64_t position) {
  if (dst_node == own_node_idx) return map.recv_record(rdma_base, own_node_idx, channel, position);
  if (target.mapped != nullptr) {
    return target.at(rdma_base, map.recv_record(rdma_base, own_node_idx, channel, position));
  }
  return map.send_record(rdma_base, dst_node, own_node_idx, channel, position);
}

// Publishes the group's records [first, first + count) towards `dst_node`, written where queue_record said,
// and adds `count` to the receiver's `tail` (this rank's symmetric address of it). Called by every warp of
// the group with the same arguments once the records are written (a __threadfence, for a NIC's reads, then a
// group barrier).
// - Own node: the leader stores the new tail with a system-scope release.
// - A mapped peer: the leader adds `count` to the mapped tail with a system-scope release.
// - Any other peer: warp 0 puts each piece of the send ring (split where the ring wraps) with a
// put-with-signal
//   adding its size (the policy orders it after warp 0's earlier puts); the other warps return at once, and
//   the put may still be running.
// NOTES: the barrier orders every warp's stores before the leader's release, and a release is cumulative (PTX
// memory model: those stores precede it in causality order), so a receiver whose acquire load of the tail
// sees the add sees every record it counts.
template <typename Remote>
__device__ __forceinline__ void publish_records(const InternodeBufferMap& map, void* rdma_base,
                                                const RailTarget& target, int dst_node, int own_node_idx,
                                                int channel, uint64_t first, int count, uint64_t* tail,
                                                const WarpGroup& group) {
  if (dst_node == own_node_idx) {
    if (group.leader()) device::st_release_sys_u64(tail, first + static_cast<uint64_t>(count));
    return;
  }
  if (target.mapped != nullptr) {
    if (group.leader()) red_add_release_sys_u64(target.at(rdma_base, tail), static_cast<uint64_t>(count));
    return;
  }
  if (group.warp != 0) return;
  while (count > 0) {
    const int slot = static_cast<int>(first % static_cast<uint64_t>(map.queue_tokens));
    const int piece = min(count, map.queue_tokens - slot);
    Remote::put_signal_warp(map.recv_record(rdma_base, own_node_idx, channel, first),
                            map.send_record(rdma_base, dst_node, own_node_idx, channel, first),
                            static_cast<size_t>(piece) * map.record_bytes, tail, static_cast<uint64_t>(piece),
                            target.rank);
    first += piece;
    count -= piece;
  }
}

}  // namespace epx::kernels::internode
