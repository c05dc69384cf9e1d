#pragma once

#include <cstdint>

#include "device/ptx.cuh"
#include "device/wait.cuh"
#include "kernels/bf16x8.cuh"
#include "kernels/low_latency_kernels.hpp"
#include "kernels/low_latency_transport.cuh"
#include "kernels/shape_check.cuh"
#include "kernels/wait_context.cuh"
#include "kernels/warp_scan.cuh"
#include "kernels/work_split.hpp"

// Pieces shared by the low-latency dispatch and combine kernels: signalling between ranks, and the
// (local expert, source rank) bookkeeping that turns a flat row index into a row of one expert's block.
namespace epx::kernels::low_latency {

constexpr int kNumThreads = 512;
constexpr int kNumWarps = kNumThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;

// Thread 0 of the block stamps `stamp` (see LowLatencyStamp); a uniform branch when stamps are off.
__device__ __forceinline__ void stamp_phase(uint64_t* stamps, LowLatencyStamp stamp) {
  if (stamps != nullptr && threadIdx.x == 0)
    stamps[size_t(blockIdx.x) * kNumPhaseStamps + stamp] = device::global_timer_ns();
}

// stamp_phase once every warp of the block got there (every thread calls it): thread 0 alone would stamp when
// its own warp finished, and a phase whose warps finish unevenly (the sends) would read short. The barrier
// runs only when stamps are on (a uniform branch), so timed calls without them are unchanged.
__device__ __forceinline__ void stamp_phase_of_block(uint64_t* stamps, LowLatencyStamp stamp) {
  if (stamps == nullptr) return;
  __syncthreads();
  stamp_phase(stamps, stamp);
}

template <typename T>
__device__ __forceinline__ T* local_at(const PeerContext& peers, size_t offset) {
  return LowLatencyBufferMap::at<T>(peers.local_base, offset);
}

template <typename T>
__device__ __forceinline__ T* peer_at(const PeerContext& peers, int rank, size_t offset) {
  return LowLatencyBufferMap::at<T>(peers.peer_bases[rank], offset);
}

// ---- Rank masks ----

__device__ __forceinline__ bool rank_masked(unsigned long long masked, int rank) {
  return ((masked >> rank) & 1ull) != 0;
}

// The mask as this launch sees it. Loaded by thread 0 of each block at the start of a kernel and handed to
// the other threads through shared memory at the block's first barrier (one load per block).
__device__ __forceinline__ unsigned long long load_rank_mask(const LowLatencyMaskArgs& mask) {
  return __ldcg(mask.masked);
}

// enable_shrink: every block of a receive must agree on whether it reads source `src`, even when one block's
// wait timed out while the flag arrived for another. The first block done waiting for the source decides,
// with a CAS on the source's decision word (+expected: read it, -expected: leave it out; older values belong
// to earlier operations). Returns the decision.
__device__ __forceinline__ bool decide_source(int* word, int expected, bool arrived) {
  const int mine = arrived ? expected : -expected;
  int seen = __ldcg(word);
  while (seen != expected && seen != -expected) {  // at most one CAS per block that decides (bounded)
    const int previous = atomicCAS(word, seen, mine);
    if (previous == seen) return arrived;
    seen = previous;
  }
  return seen == expected;
}

// enable_shrink: a wait of this rank timed out on `peer` and the receive left it out. From now on the peer is
// masked (recorded in masked_by_timeout as well, for the host to report).
__device__ __forceinline__ void mask_timed_out_peer(const LowLatencyMaskArgs& mask, int peer) {
  atomicOr(mask.masked_by_timeout, 1ull << peer);
  atomicOr(mask.masked, 1ull << peer);
}

// Operations of kind `op` this rank has completely received in `half`. Senders publish this + 1, receivers
// wait for it: every rank runs the same sequence of operations, so the counts agree.
// NOTES: it only changes at the very end of a receive phase (finish_receive), after every block of that
// launch read it, and the next operation on this half starts after that launch (stream order and the host's
// pending-receive check), so reading it anywhere in a launch gives the same value.
__device__ __forceinline__ int read_num_uses(const PeerContext& peers, const LowLatencyBufferMap& map,
                                             int half, LowLatencyOp op) {
  return __ldcg(local_at<int>(peers, map.num_uses_offset(half, op)));
}

// The cleans this rank ran (clean_low_latency_buffer's barrier count): the same on every rank between calls.
__device__ __forceinline__ int read_num_cleans(const PeerContext& peers, const LowLatencyBufferMap& map) {
  return __ldcg(local_at<int>(peers, map.barrier_count_offset()));
}

// The ranks this rank reaches by puts (bit r), by the calling warp: none in the NVLink-only kernels.
template <typename Remote>
__device__ __forceinline__ unsigned long long ranks_reached_by_puts(const PeerContext& peers) {
  if constexpr (!Remote::kEnabled) return 0ull;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const unsigned low = __ballot_sync(kFullMask, lane < peers.num_ranks && !is_direct<Remote>(peers, lane));
  const unsigned high =
      __ballot_sync(kFullMask, lane + 32 < peers.num_ranks && !is_direct<Remote>(peers, lane + 32));
  return low | static_cast<unsigned long long>(high) << 32;
}

// Called by every thread of every publishing block (Publishers, work_split.hpp: every block computes the same
// from values all blocks share) once its sends are issued: operation `num_ops` of this rank's sends is
// published to every unmasked destination.
// Mapped destinations (NVLink peers, other nodes' ranks the transport maps): each block adds its share
// (publish_share, work_split.hpp) to the destination's flag for this rank with one release reduction at
// system scope, so the flag reaches flag_target(num_ops) when the last block's add lands, and no block waits
// for a round trip. Destinations reached by puts: the last of the `count` blocks to arrive at this rank's
// counter for the destination puts the flag's new value. NOTES: the barrier puts every store and completed
// put of the block before the publishing thread's add or arrival, a release at system scope that covers them
// (cumulatively). Adds are read-modify-writes, so the receiver's acquire of the final value synchronizes with
// every block's release (the shape fingerprints post_shapes posted at the start of the send phase included).
// For puts, the last arriver's arrival acquires the other blocks' arrivals, and its put after them orders
// every block's data first; the counter is reset after the flag: the next operation on this half is a later
// launch. Masked destinations get nothing (their flags and counters stay untouched until a clean).
template <typename Remote>
__device__ __forceinline__ void publish_sends(const PeerContext& peers, const LowLatencyBufferMap& map,
                                              int half, LowLatencyOp op, int num_ops,
                                              unsigned long long masked, Publishers publishers) {
  if (!publishers.this_block) return;
  // With no rank reached by puts nothing is to complete, and a quiet would still cost every thread a fence.
  if (ranks_reached_by_puts<Remote>(peers) != 0ull) Remote::quiet();
  __syncthreads();
  const int share = publish_share(static_cast<int>(blockIdx.x), publishers);
  for (int dst = threadIdx.x; dst < peers.num_ranks; dst += blockDim.x) {
    if (rank_masked(masked, dst)) continue;
    if (is_direct<Remote>(peers, dst)) {
      device::red_add_release_sys(peer_at<int>(peers, dst, map.recv_flag_offset(half, op, peers.rank)),
                                  share);
      continue;
    }
    int* finish = local_at<int>(peers, map.send_finish_offset(half, op, dst));
    if (device::atomic_add_acq_rel_sys(finish, 1) == publishers.count - 1) {
      signal_rank<Remote>(peers, dst, map.recv_flag_offset(half, op, peers.rank), flag_target(num_ops));
      atomicExch(finish, 0);
    }
  }
}

static_assert(sizeof(ShapeFingerprint) <= kLowLatencyShapeSlotBytes,
              "a shape fingerprint must fit its slot of the low-latency buffer");

// Called by every thread of every block at the start of a send phase: block 0 posts this rank's shape
// fingerprint to every unmasked destination, early, so it is long complete when publish_sends releases it
// with the flag (it adds nothing to the flag's latency). The node's ranks get plain stores into their
// abort-words allocation; other nodes' ranks get this rank's fingerprint in their remote_shapes slot for this
// rank: a plain store where this GPU maps them, else a put of the staged fingerprint (put_warp is
// warp-collective: block 0's warps share the destinations, so many remote ranks do not hold one warp, and
// with it block 0's first token, for long). NOTES: the puts are complete before any flag that releases them,
// in dispatch and in combine alike: block 0 is always a publishing block (dispatch_publishers and
// combine_publishers, work_split.hpp, count it even with nothing else to send), and in publish_sends every
// thread of it, the warps that issued these puts included, calls Remote::quiet() before the barrier and its
// arrival, which the last arriver for a destination acquires before it signals the flag. The staged slot is
// rewritten only by the next send of this op on this half, a later launch, so never while a put still reads
// it.
template <typename Remote>
__device__ __forceinline__ void post_shapes(const PeerContext& peers, const LowLatencyBufferMap& map,
                                            int half, LowLatencyOp op, const ShapeFingerprint& shape,
                                            unsigned long long masked) {
  if (blockIdx.x != 0) return;
  for (int dst = threadIdx.x; dst < peers.num_ranks; dst += blockDim.x) {
    if (rank_masked(masked, dst)) continue;
    if (same_node(peers, dst)) {
      post_shape(
          AbortWordsMap::low_latency_shape(peers.abort.peers[dst], half, static_cast<int>(op), peers.rank),
          shape);
    } else if (Remote::kEnabled && is_direct<Remote>(peers, dst)) {
      // Another node's rank this GPU maps: straight into its remote_shapes slot for this rank.
      post_shape(peer_at<ShapeFingerprint>(peers, dst, map.remote_shape_offset(half, op, peers.rank)), shape);
    }
  }
  if constexpr (Remote::kEnabled) {
    auto* staged = local_at<ShapeFingerprint>(peers, map.staged_shape_offset(half, op));
    if (threadIdx.x == 0) {
      post_shape(staged, shape);
      __threadfence_system();  // visible to a transport that reads it from outside the SM
    }
    // The staged slot is complete before any warp's put reads it (as for every staged row).
    __syncthreads();
    for (int dst = threadIdx.x / 32; dst < peers.num_ranks; dst += blockDim.x / 32) {
      if (is_direct<Remote>(peers, dst) || rank_masked(masked, dst)) continue;  // warp-uniform
      Remote::put_warp(local_at<ShapeFingerprint>(peers, map.remote_shape_offset(half, op, peers.rank)),
                       staged, sizeof(ShapeFingerprint), dst);
    }
  }
}

// After acquiring source `src`'s flag: whether the fingerprint the flag released is this rank's shape (else
// the group is aborted, naming the field). A source of this node posted it into this rank's abort words, a
// source on another node stored or put it into remote_shapes.
template <typename Remote>
__device__ __forceinline__ bool source_shape_agrees(const device::WaitContext& ctx, const PeerContext& peers,
                                                    const LowLatencyBufferMap& map, int half, LowLatencyOp op,
                                                    int src, const ShapeFingerprint& shape) {
  if (same_node(peers, src)) {
    return check_shape(ctx, src, shape,
                       AbortWordsMap::low_latency_shape(peers.abort.local, half, static_cast<int>(op), src));
  }
  if constexpr (Remote::kEnabled) {
    return check_shape(ctx, src, shape,
                       local_at<ShapeFingerprint>(peers, map.remote_shape_offset(half, op, src)));
  }
  return true;
}

// What a receive's wait for its sources found.
struct SourceWait {
  bool arrived;  // every source not left out published `expected` with this rank's shapes
  // Sources left out (read nothing of them): masked when the kernel started, or (enable_shrink) whose wait
  // timed out in this receive. The same in every block.
  unsigned long long left_out;
};

// How one source's wait ended (wait_source).
enum class SourceOutcome {
  kArrived,  // the flag reached its target and the source's shapes are this rank's
  kLeftOut,  // enable_shrink: left out (this block's wait or another's timed out); read nothing of it
  kFailed,   // abandoned (group aborted), timed out, or shapes that differ (this rank aborts the group)
};

// The bounded wait of one unmasked source `src` for operation `expected` (wait_all_sources' per source).
// Block 0 adds the waited time to wait_cost_stats[src]; a left-out source's bit goes into `left_out` (block
// shared memory).
template <typename Remote>
__device__ __forceinline__ SourceOutcome wait_source(const PeerContext& peers, const LowLatencyBufferMap& map,
                                                     int half, LowLatencyOp op, int expected, WaitPhase phase,
                                                     int64_t* wait_cost_stats, const ShapeFingerprint& shape,
                                                     const LowLatencyMaskArgs& mask,
                                                     unsigned long long* left_out, int src, uint64_t start) {
  const device::WaitContext ctx = wait_context(peers);
  const int* flag = local_at<int>(peers, map.recv_flag_offset(half, op, src));
  bool ok = true;
  if (!mask.shrink) {
    ok = device::try_wait_at_least(flag, flag_target(expected), ctx, src, phase);
  } else {
    const device::WaitOutcome outcome = device::wait_at_least_outcome(flag, flag_target(expected), ctx, src,
                                                                      phase, device::OnTimeout::kGiveUp);
    ok = outcome == device::WaitOutcome::kArrived;
    if (outcome != device::WaitOutcome::kAborted) {
      int* decision = local_at<int>(peers, map.source_decision_offset(half, op, src));
      if (decide_source(decision, expected, ok)) {
        // Another block saw the flag: it is there, this look finds it.
        if (!ok) ok = device::try_wait_at_least(flag, flag_target(expected), ctx, src, phase);
      } else {
        if (!ok) mask_timed_out_peer(mask, src);  // the block whose wait timed out (not a late flag)
        atomicOr(left_out, 1ull << src);
        return SourceOutcome::kLeftOut;
      }
    }
  }
  if (ok) ok = source_shape_agrees<Remote>(ctx, peers, map, half, op, src, shape);
  if (wait_cost_stats != nullptr && blockIdx.x == 0) {
    atomicAdd(reinterpret_cast<unsigned long long*>(wait_cost_stats + src),
              static_cast<unsigned long long>(device::global_timer_ns() - start));
  }
  return ok ? SourceOutcome::kArrived : SourceOutcome::kFailed;
}

// Every block waits until every unmasked source in `wanted` (all by default) published operation `expected`
// (its flag reached flag_target(expected)); block 0 adds the waited time per source. `arrived` is false (for
// the whole block) when a wait was abandoned (the group is aborted) or a source's shapes differ (then this
// rank aborts it): nothing the sources were to write may be read then. With enable_shrink a wait that times
// out leaves its source out instead of aborting (every block agrees through decide_source) and masks it.
// `left_out` (block shared memory) holds the mask at entry and is complete after the call.
template <typename Remote>
__device__ __forceinline__ SourceWait wait_all_sources(
    const PeerContext& peers, const LowLatencyBufferMap& map, int half, LowLatencyOp op, int expected,
    WaitPhase phase, int64_t* wait_cost_stats, const ShapeFingerprint& shape, const LowLatencyMaskArgs& mask,
    unsigned long long* left_out, unsigned long long wanted = ~0ull) {
  const uint64_t start = device::global_timer_ns();
  const unsigned long long masked = *left_out;
  bool arrived = true;
  for (int src = threadIdx.x; src < peers.num_ranks; src += blockDim.x) {
    if (rank_masked(masked, src) || ((wanted >> src) & 1ull) == 0) continue;
    arrived &= wait_source<Remote>(peers, map, half, op, expected, phase, wait_cost_stats, shape, mask,
                                   left_out, src, start) != SourceOutcome::kFailed;
  }
  // The waiting threads' acquires (and left_out) extend to the whole block through the barrier.
  const bool all_arrived = __syncthreads_and(arrived) != 0;
  return SourceWait{all_arrived, *left_out};
}

// Called by every thread of every block at the end of a receive phase: the last block bumps num_uses, which
// moves the expected flag value of the next operation on this half.
__device__ __forceinline__ void finish_receive(const PeerContext& peers, const LowLatencyBufferMap& map,
                                               int half, LowLatencyOp op, int num_uses) {
  __syncthreads();
  if (threadIdx.x == 0) {
    int* done = local_at<int>(peers, map.recv_done_offset(half, op));
    if (atomicAdd(done, 1) == static_cast<int>(gridDim.x) - 1) {
      atomicExch(done, 0);
      atomicExch(local_at<int>(peers, map.num_uses_offset(half, op)), num_uses + 1);
    }
  }
}

// In-place exclusive prefix sum of data[0, n) in shared memory by warps [first_warp, kNumWarps) of the block,
// which alone call it (first_warp 0: the whole block, its barrier; else named barrier 1 over those warps);
// data[n] = total. warp_sums: kNumWarps ints of shared scratch. The caller writes data[i] from the calling
// thread i (i < n <= its threads) or synchronizes first: with more values than threads a thread reads values
// other threads wrote, so the scan's barrier comes first.
__device__ __forceinline__ void warps_exclusive_scan(int* data, int n, int* warp_sums, int first_warp) {
  const int num_threads = kNumThreads - 32 * first_warp;
  const auto sync = [&] {
    if (first_warp == 0) {
      __syncthreads();
    } else {
      device::named_barrier_sync(1, num_threads);
    }
  };
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int thread = static_cast<int>(threadIdx.x) - 32 * first_warp;
  const int per_thread = (n + num_threads - 1) / num_threads;
  const int begin = min(n, thread * per_thread);
  const int end = min(n, begin + per_thread);
  if (per_thread > 1) sync();
  int sum = 0;
  for (int i = begin; i < end; ++i) sum += data[i];
  const int inclusive = warp_inclusive_sum(sum, lane);
  if (lane == 31) warp_sums[warp] = inclusive;
  sync();
  if (warp == first_warp) {
    const bool mine = lane >= first_warp && lane < kNumWarps;
    const int warp_total = warp_inclusive_sum(mine ? warp_sums[lane] : 0, lane);
    if (mine) warp_sums[lane] = warp_total;
  }
  sync();
  int running = inclusive - sum + (warp > first_warp ? warp_sums[warp - 1] : 0);
  for (int i = begin; i < end; ++i) {
    const int value = data[i];
    data[i] = running;
    running += value;
  }
  if (thread == 0) data[n] = warp_sums[kNumWarps - 1];
  sync();
}

// warps_exclusive_scan by the whole block.
__device__ __forceinline__ void block_exclusive_scan(int* data, int n, int* warp_sums) {
  warps_exclusive_scan(data, n, warp_sums, 0);
}

// A prefix sum over the whole block of one value per thread, held in registers: the sum of the values of the
// threads below this one, and the block's total. Every warp scans the warps' sums itself, so one barrier does
// where block_exclusive_scan, whose values lie in shared memory, needs three after the caller's. warp_sums:
// kNumWarps ints of shared scratch, read until every thread has passed the caller's next barrier.
struct BlockSum {
  int exclusive;
  int total;
};
__device__ __forceinline__ BlockSum block_exclusive_sum(int value, int* warp_sums) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int inclusive = warp_inclusive_sum(value, lane);
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  const int warps_inclusive = warp_inclusive_sum(lane < kNumWarps ? warp_sums[lane] : 0, lane);
  const int warp_base = __shfl_sync(kFullMask, warps_inclusive, warp > 0 ? warp - 1 : 0);
  const int total = __shfl_sync(kFullMask, warps_inclusive, kNumWarps - 1);
  return {(warp > 0 ? warp_base : 0) + inclusive - value, total};
}

// The (local expert, source rank) pair p, flattened as le * R + src, holding flat row j: the largest p with
// prefix[p] <= j, for 0 <= j < prefix[n] (so the pair is never empty).
__device__ __forceinline__ int find_pair(const int* prefix, int n, int row) {
  int lo = 0;
  int hi = n;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (prefix[mid] <= row) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// An expert id of topk_idx, or -1 for "no expert" (ids outside [0, E) are treated as -1).
__device__ __forceinline__ int expert_of(int64_t id, int num_experts) {
  return id >= 0 && id < num_experts ? static_cast<int>(id) : -1;
}
__device__ __forceinline__ int expert_at(const int64_t* topk_idx, size_t i, int num_experts) {
  return expert_of(topk_idx[i], num_experts);
}

// Whether no lower lane among the top-k lanes 0..num_topk-1 holds this lane's `value`: the lane of its first
// top-k position. Warp-collective (it shuffles): every lane calls it, so callers test their own validity
// after the call, not before.
__device__ __forceinline__ bool first_lane_with(int value, int num_topk, int lane) {
  bool first = true;
  for (int k = 0; k < num_topk; ++k) {
    const int other = __shfl_sync(kFullMask, value, k);
    if (k < lane && other == value) first = false;
  }
  return first;
}

// The expert of top-k entry `entry` (flat t * K + k) if it is that token's first listing of it, else -1: a
// token listing an expert twice is one row (the first listing's), and combine weights that row once per
// listing.
// NOTES: the earlier listings are loaded unrolled and predicated, so their loads are in flight together
// instead of one round trip each (this runs on the routing block's critical path).
// `id`: topk_idx[entry], loaded by the caller (the routing block loads its first round's early).
__device__ __forceinline__ int first_listed_expert(const int64_t* topk_idx, int entry,
                                                   const SmallDivisor& topk, int num_experts, int64_t id) {
  const int first = entry - static_cast<int>(topk.mod(entry));
  int64_t earlier[kMaxTopk - 1];
#pragma unroll
  for (int j = 0; j < kMaxTopk - 1; ++j) earlier[j] = first + j < entry ? __ldg(topk_idx + first + j) : -1;
  const int expert = expert_of(id, num_experts);
  bool repeated = false;
#pragma unroll
  for (int j = 0; j < kMaxTopk - 1; ++j) repeated |= earlier[j] == expert;
  return repeated ? -1 : expert;
}

}  // namespace epx::kernels::low_latency
