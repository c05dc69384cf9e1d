#pragma once

#include <cstdint>

#include "common/tagged_word.hpp"
#include "core/abort_word.hpp"
#include "device/ptx.cuh"
#include "device/wait.cuh"
#include "kernels/normal_kernels.hpp"
#include "kernels/record_fields.cuh"
#include "kernels/shape_check.cuh"
#include "kernels/wait_context.cuh"
#include "kernels/warp_copy.cuh"

// The queues of normal-mode dispatch and combine (map and invariants: NormalBufferMap). Every launch has
// 2C blocks: even blocks send for channel b / 2, odd blocks receive for it. Inside a block the warps form one
// group per peer, so a full queue to one peer never stalls the traffic to another.
namespace epx::kernels {

// The warps of a block that serve one peer. Group g synchronizes on named barrier 1 + g (0 is
// __syncthreads), so groups never wait for each other.
struct WarpGroup {
  int group;      // < kMaxNvlRanks
  int warp;       // index within the group
  int num_warps;  // warps in the group
  int lane;

  __device__ bool leader() const { return warp == 0 && lane == 0; }
  __device__ void sync() const { device::named_barrier_sync(group + 1, num_warps * 32); }
  // The leader's `value`, for every thread of the group, through `shared` (one int of shared memory).
  __device__ int share(int value, int* shared) const {
    if (leader()) *shared = value;
    sync();
    const int seen = *shared;
    sync();  // everybody read it before the leader may overwrite it
    return seen;
  }
};

// Dispatch and combine launches this rank finished before the running one. Every block reads it at its start;
// finish_launch advances it only after every block arrived, so all blocks see the same value.
__device__ __forceinline__ int calls_before(const PeerContext& peers) {
  return *reinterpret_cast<volatile int*>(&NormalBufferMap::control(peers.local_base)->calls_done);
}

// Called by every thread of every block at its end (finish_launch of normal and internode kernels). Thread 0
// of each block completes what the block sent (`complete_sends`, e.g. its network puts), fences at system
// scope and arrives; the last block to arrive resets the arrivals, counts the call as done
// (`control->calls_done = calls + 1`) and returns true in all its threads. The other blocks return false.
// NOTES: each block fences before arriving, so its reads of the queues are complete before the last arriver
// releases the done signal.
template <typename Control, typename Calls, typename CompleteSends>
__device__ __forceinline__ bool count_call_done_by_last_block(Control* control, Calls calls,
                                                              CompleteSends complete_sends) {
  __syncthreads();
  bool last_arrival = false;
  if (threadIdx.x == 0) {
    complete_sends();
    __threadfence_system();
    last_arrival = atomicAdd(&control->launch_arrivals, 1) == static_cast<int>(gridDim.x) - 1;
  }
  // Thread 0's answer reaches the block through the barrier's reduction (no shared flag to race on).
  if (__syncthreads_or(last_arrival) == 0) return false;
  __threadfence_system();
  if (threadIdx.x == 0) {
    control->launch_arrivals = 0;
    control->calls_done = calls + 1;
  }
  return true;
}

// Called by every thread of every block at its end: the last block to arrive counts the call as done and
// tells every peer, which may then write into this rank's queues with the next call's map.
__device__ __forceinline__ void finish_launch(const PeerContext& peers, int calls) {
  if (!count_call_done_by_last_block(NormalBufferMap::control(peers.local_base), calls, [] {})) return;
  const int peer = threadIdx.x;
  if (peer < peers.num_ranks && peer != peers.rank) {
    device::st_release_sys(&NormalBufferMap::control(peers.peer_bases[peer])->done_signal[peers.rank],
                           calls + 1);
  }
}

// ---- Launch fingerprints: a dispatch or combine whose shape (or operation) differs between ranks reads
// records of another map. Every launch posts its ShapeFingerprint to every peer at its start; a receiver
// checks a source's before it reads the source's first record. ----

// Block 0, threads r < R: this launch's fingerprint to peer r (shape_check.cuh). `calls`: calls_before().
__device__ __forceinline__ void post_launch_shape(const PeerContext& peers, int calls,
                                                  const ShapeFingerprint& shape) {
  const int peer = threadIdx.x;
  if (blockIdx.x != 0 || peer >= peers.num_ranks || peer == peers.rank) return;
  post_launch_shape_to(peers.abort.peers[peer] != nullptr
                           ? AbortWordsMap::normal_launch_shape(peers.abort.peers[peer], peers.rank)
                           : nullptr,
                       &NormalBufferMap::control(peers.peer_bases[peer])->launch_shape[peers.rank],
                       static_cast<uint32_t>(calls + 1), shape);
}

// One thread, before reading `src`'s records of this launch: false (the group aborted, naming the field)
// when src's launch has another fingerprint. Records of this launch follow its post, so it is there.
__device__ __forceinline__ bool check_launch_shape(const PeerContext& peers, int calls,
                                                   const ShapeFingerprint& shape, int src, WaitPhase phase) {
  return check_launch_shape_at(
      wait_context(peers), src, &NormalBufferMap::control(peers.local_base)->launch_shape[src],
      peers.abort.peers[src] != nullptr ? AbortWordsMap::normal_launch_shape(peers.abort.local, src)
                                        : nullptr,
      static_cast<uint32_t>(calls + 1), shape, phase);
}

// What the two ends of one queue share: who they are, and how a group agrees on a value its leader read.
// Entries count from the start of the call; `base` is the queue's running count when the call began.
struct QueueEnd {
  const PeerContext& peers;
  const NormalBufferMap& map;
  WarpGroup group;
  int* shared_value;  // one int of shared memory for this group
  int peer;           // the rank at the other end
  int channel;
  WaitPhase phase;
  uint32_t base;

  // The leader's `value`, for every thread of the group.
  __device__ int share(int value) const { return group.share(value, shared_value); }
};

// One sender's stream of records into queue (this rank -> peer, channel) in the peer's buffer.
struct QueueSender : QueueEnd {
  int chunk_tokens;
  bool second_head;  // the peer consumes with two reducers (a combine's, QueueCounters::head_second)
  int pushed = 0;

  __device__ QueueSender(const PeerContext& p, const NormalBufferMap& l, const WarpGroup& g, int* shared,
                         int dst_rank, int channel_idx, int chunk, WaitPhase wait_phase,
                         bool two_heads = false)
      : QueueEnd{p,          l,
                 g,          shared,
                 dst_rank,   channel_idx,
                 wait_phase, NormalBufferMap::counters(p.local_base)->sent[dst_rank][channel_idx]},
        chunk_tokens(chunk),
        second_head(two_heads) {}

  // Before the first record: the peer finished every call before this one, so nothing of theirs is still
  // unread in its queues (whatever their map).
  __device__ void wait_until_peer_ready(int calls) {
    if (group.leader()) {
      device::wait_at_least(&NormalBufferMap::control(peers.local_base)->done_signal[peer], calls,
                            wait_context(peers), peer, WaitPhase::kPreviousCall);
    }
    group.sync();
  }

  // Waits for room and returns how many records (1 .. min(chunk, most)) the group may write now.
  __device__ int reserve(int most) {
    int granted = 0;
    if (group.leader()) {
      auto* counters = NormalBufferMap::counters(peers.local_base);
      const int needed = pushed - map.queue_tokens + 1;
      int consumed = device::wait_count_since(&counters->head[peer][channel], base, needed,
                                              wait_context(peers), peer, phase);
      if (second_head) {
        consumed = min(consumed, device::wait_count_since(&counters->head_second[peer][channel], base, needed,
                                                          wait_context(peers), peer, phase));
      }
      granted = min(min(queue_room(pushed, consumed, map.queue_tokens), chunk_tokens), most);
    }
    return share(granted);
  }

  // Record `j` of the reserved chunk, in the peer's buffer.
  __device__ char* record(int j) const {
    return map.record(peers.peer_bases[peer], peers.rank, peer, channel, static_cast<uint32_t>(pushed + j));
  }

  // The group wrote `count` records: the peer may read them.
  __device__ void publish(int count) {
    group.sync();
    pushed += count;
    if (count > 0 && group.leader()) {
      auto* tail = &NormalBufferMap::counters(peers.peer_bases[peer])->tail[peers.rank][channel];
      device::st_release_sys(reinterpret_cast<int*>(tail), static_cast<int>(base + pushed));
    }
  }

  __device__ void finish() const {
    if (group.leader()) NormalBufferMap::counters(peers.local_base)->sent[peer][channel] = base + pushed;
  }
};

// One receiver's stream of `count` records from queue (peer -> this rank, channel) in its own buffer.
struct QueueReceiver : QueueEnd {
  int count;
  int got = 0;

  __device__ QueueReceiver(const PeerContext& p, const NormalBufferMap& l, const WarpGroup& g, int* shared,
                           int src_rank, int channel_idx, int num_records, WaitPhase wait_phase)
      : QueueEnd{p,          l,
                 g,          shared,
                 src_rank,   channel_idx,
                 wait_phase, NormalBufferMap::counters(p.local_base)->consumed[src_rank][channel_idx]},
        count(num_records) {}

  __device__ bool done() const { return got >= count; }

  // Waits until at least one more record landed and returns how many are ready to read.
  __device__ int wait_ready() {
    int ready = 0;
    if (group.leader()) {
      const int landed =
          device::wait_count_since(&NormalBufferMap::counters(peers.local_base)->tail[peer][channel], base,
                                   got + 1, wait_context(peers), peer, phase);
      ready = min(landed, count) - got;
    }
    return share(ready);
  }

  __device__ const char* record(int j) const {
    return map.record(peers.local_base, peer, peers.rank, channel, static_cast<uint32_t>(got + j));
  }

  // The group copied `num` records out: the peer may overwrite them.
  __device__ void release(int num) {
    group.sync();
    got += num;
    if (group.leader()) {
      auto* head = &NormalBufferMap::counters(peers.peer_bases[peer])->head[peers.rank][channel];
      device::st_release_sys(reinterpret_cast<int*>(head), static_cast<int>(base + got));
    }
  }

  __device__ void finish() const {
    if (group.leader()) {
      auto* counters = NormalBufferMap::counters(peers.local_base);
      counters->consumed[peer][channel] = base + count;
      counters->consumed_second[peer][channel] = base + count;  // a combine's second reducer starts there
    }
  }
};

// Peer index -> rank, skipping this rank.
__device__ __forceinline__ int peer_rank(int peer_idx, int rank) {
  return peer_idx < rank ? peer_idx : peer_idx + 1;
}

// Lanes below this one.
__device__ __forceinline__ unsigned lanes_below(int lane) {
  return (1u << lane) - 1u;
}

// Of a 32-token window's selected tokens (`mask`, one bit per lane), those that fall to warp `worker` of
// `num_workers`: the token whose entry is first + (its rank among the selected) belongs to the warp with
// entry % num_workers == worker. One ballot, so a warp visits its own tokens only (testing all 32 in every
// warp cost a 1-rank dispatch ~20 % of its time: the driving lane issued its copies that much later).
__device__ __forceinline__ unsigned worker_tokens(unsigned mask, int first, int worker, int num_workers,
                                                  int lane) {
  const bool selected = ((mask >> lane) & 1u) != 0;
  const int entry = first + __popc(mask & lanes_below(lane));
  return __ballot_sync(~0u, selected && entry % num_workers == worker);
}

}  // namespace epx::kernels
