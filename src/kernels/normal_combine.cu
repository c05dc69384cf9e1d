#include <cuda_bf16.h>

#include <type_traits>

#include "device/tma.cuh"
#include "gpu/cuda_check.hpp"
#include "kernels/bf16x8.cuh"
#include "kernels/combine_publish_ring.hpp"
#include "kernels/combine_warp_roles.hpp"
#include "kernels/launch.hpp"
#include "kernels/normal_kernels.hpp"
#include "kernels/normal_queue.cuh"
#include "kernels/phase_clock.cuh"
#include "kernels/preload.hpp"
#include "kernels/tma_copy.cuh"
#include "kernels/warp_copy.cuh"
#include "kernels/warp_scan.cuh"

namespace epx::kernels {

namespace {

// ---- Send: the rows this rank received from `dst` on `channel` (contiguous, in dst's token order) go back
// into dst's queue, each with its top-k weights. ----

// The `granted` rows the queue reserved, from row row0 + queue.pushed, into their records: warp `warp` of
// `num_warps` writes every num_warps-th.
__device__ __forceinline__ void write_reserved_rows(const CombineArgs& args, const QueueSender& queue,
                                                    int row0, int granted, int warp, int num_warps,
                                                    int lane) {
  const NormalRecord& r = args.record;
  for (int j = warp; j < granted; j += num_warps) {
    const size_t row = row0 + queue.pushed + j;
    char* record = queue.record(j);
    if (lane == 0) device::bulk_prefetch_l2(static_cast<const char*>(args.in.x) + row * r.x_bytes, r.x_bytes);
    write_combine_record(record, r, args.in.x, args.in.topk_weights, row, lane);
  }
}

__device__ void send_rows(const CombineArgs& args, int channel, int dst, const WarpGroup& group, int* shared,
                          int calls, bool two_reducers) {
  const int index = dst * args.map.num_channels + channel;
  const int row0 = args.handle.recv_channel_offset[index];
  const int num_rows = args.handle.recv_channel_offset[index + 1] - row0;
  QueueSender queue(args.peers, args.map, group, shared, dst, channel, args.chunk_tokens,
                    WaitPhase::kCombineSend, two_reducers);
  PhaseClock clock(args.phases, PhaseStream::kCombineSend,
                   channel == 0 && group.group == 0 && group.leader());
  queue.wait_until_peer_ready(calls);
  while (queue.pushed < num_rows) {
    const int granted = queue.reserve(num_rows - queue.pushed);
    clock.mark(0);
    write_reserved_rows(args, queue, row0, granted, group.warp, group.num_warps, group.lane);
    clock.mark(1);
    queue.publish(granted);
    clock.mark(2);
  }
  queue.finish();
  clock.add_to_report(queue.pushed, static_cast<int>(args.record.bytes()));
}

// What a sender group's writer warps and its publisher warp share (CombineArgs::publisher_warp; the rules:
// combine_publish_ring.hpp): the writers' chunks in a ring of slots, how many writer warps finished each, and
// the chunks published.
struct PublishRing {
  int end[kPublishRingSlots];  // chunk k's end (its slot): records reserved up to it, from the call's start
  int written[kPublishRingSlots];  // writer warps done with chunk k's records (its slot)
  int published;                   // chunks whose tail the publisher stored
  int granted;  // the writers' leader's grant, shared with the writers (QueueEnd::shared_value)
};

// Writer warps meet at named barrier kWriterBarrierBase + 1 + group (WarpGroup::sync adds the 1): past the
// groups' barriers (1 .. R - 1) and below the sender block's reducing warps' (15).
constexpr int kWriterBarrierBase = 7;
static_assert(kWriterBarrierBase + kMaxNvlRanks - 1 < 15, "writer barriers below kSenderReduceBarrier");

__device__ __forceinline__ int shared_load(const int* address) {
  return *reinterpret_cast<const volatile int*>(address);
}

// send_rows with the group's last warp publishing: the other warps write chunk after chunk and never wait for
// a system-scope release; the publisher waits until every writer warp finished chunk k, stores the queue's
// tail (the release covers what it observed the writers write) and frees chunk k's ring slot
// (combine_publish_ring.hpp). Needs group_takes_publisher.
__device__ void send_rows_published(const CombineArgs& args, int channel, int dst, const WarpGroup& group,
                                    PublishRing& ring, int calls, bool two_reducers) {
  const int index = dst * args.map.num_channels + channel;
  const int row0 = args.handle.recv_channel_offset[index];
  const int num_rows = args.handle.recv_channel_offset[index + 1] - row0;
  const int num_writers = group.num_warps - 1;
  const WarpGroup writers{kWriterBarrierBase + group.group, group.warp, num_writers, group.lane};
  // Every warp reads the queue's running count (QueueEnd::base) before the group meets: no writer finishes
  // (and advances it) before that.
  QueueSender queue(args.peers, args.map, writers, &ring.granted, dst, channel, args.chunk_tokens,
                    WaitPhase::kCombineSend, two_reducers);
  if (group.leader()) {
    for (int slot = 0; slot < kPublishRingSlots; ++slot) ring.written[slot] = 0;
    ring.published = 0;
  }
  group.sync();
  if (group.warp == num_writers) {  // the publisher
    auto* tail = &NormalBufferMap::counters(args.peers.peer_bases[dst])->tail[args.peers.rank][channel];
    int end = 0;
    for (int k = 0; end < num_rows; ++k) {
      if (group.lane == 0) {
        const int slot = publish_ring_slot(k);
        while (!publisher_may_take(shared_load(&ring.written[slot]), num_writers)) {
        }
        __threadfence_block();  // the writers' arrivals (and what they wrote) before what follows
        end = shared_load(&ring.end[slot]);
        ring.written[slot] = 0;
        device::st_release_sys(reinterpret_cast<int*>(tail), static_cast<int>(queue.base + end));
        __threadfence_block();  // the slot's reset before the writers see it free
        *reinterpret_cast<volatile int*>(&ring.published) = k + 1;
      }
      end = __shfl_sync(~0u, end, 0);
    }
    return;
  }
  PhaseClock clock(args.phases, PhaseStream::kCombineSend,
                   channel == 0 && group.group == 0 && writers.leader());
  queue.wait_until_peer_ready(calls);
  for (int k = 0; queue.pushed < num_rows; ++k) {
    if (writers.leader()) {
      while (!writers_may_start(k, shared_load(&ring.published))) {
      }
    }
    const int granted = queue.reserve(num_rows - queue.pushed);
    if (writers.leader()) ring.end[publish_ring_slot(k)] = queue.pushed + granted;
    clock.mark(0);
    write_reserved_rows(args, queue, row0, granted, writers.warp, num_writers, group.lane);
    __syncwarp();
    if (group.lane == 0) {
      __threadfence_block();  // this warp's records before its arrival
      atomicAdd(&ring.written[publish_ring_slot(k)], 1);
    }
    queue.pushed += granted;
    clock.mark(1);
  }
  queue.finish();
  clock.add_to_report(queue.pushed, static_cast<int>(args.record.bytes()));
}

// Which peers return their rows through the staging area (combine_staging_map.hpp) in this launch, as every
// block finds them (find_staged_peers); the same rule on both ends of each pair.
struct StagedPeers {
  unsigned in_mask;   // bit r: peer r returns this rank's rows into its staging area
  unsigned out_mask;  // bit r: this rank returns r's rows into r's area (the host copies them; no queue)
  int chunk_rows[kMaxNvlRanks];            // [r]: rows of each of r's copy chunks
  int prefix[kMaxNvlRanks][kMaxChannels];  // [r][c]: rows this rank sent r on the channels before c

  // Whether peer r returns this rank's rows through the staging area (else through r's queue).
  __device__ __forceinline__ bool comes_in(int r) const { return ((in_mask >> r) & 1u) != 0; }
  // Whether this rank returns r's rows through r's staging area (else its senders push them into the queue).
  __device__ __forceinline__ bool goes_out(int r) const { return ((out_mask >> r) & 1u) != 0; }
};

// Every thread of each block, before the block's roles: the staged peers of this launch. Peer r returns the
// rows this rank sent it: on channel c one more than the largest send_head entry of c's tokens for r (the
// block finds them all, a pass over [T, R] entries), scanned over the channels; this rank returns to r the
// rows it received from r.
__device__ void find_staged_peers(const CombineArgs& args, StagedPeers& staged) {
  const int num_ranks = args.peers.num_ranks;
  const int num_channels = args.map.num_channels;
  for (int i = threadIdx.x; i < num_ranks * num_channels; i += blockDim.x)
    staged.prefix[i / num_channels][i % num_channels] = 0;
  if (threadIdx.x == 0) staged.in_mask = staged.out_mask = 0;
  __syncthreads();
  const int per_channel = tokens_per_channel(args.num_tokens, num_channels);
  for (int t = threadIdx.x; t < args.num_tokens; t += blockDim.x) {
    for (int r = 0; r < num_ranks; ++r) {
      const int entry = args.handle.send_head[static_cast<size_t>(t) * num_ranks + r];
      if (r != args.peers.rank && entry >= 0) atomicMax(&staged.prefix[r][t / per_channel], entry + 1);
    }
  }
  __syncthreads();
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  for (int r = 0; r < num_ranks; ++r) {
    if (r == args.peers.rank) continue;
    int total = 0;
    for (int first = 0; first < num_channels; first += 32) {
      const int c = first + lane;
      const int n = c < num_channels ? staged.prefix[r][c] : 0;
      __syncwarp();
      const int inclusive = warp_inclusive_sum(n, lane);
      if (c < num_channels) staged.prefix[r][c] = total + inclusive - n;
      total += __shfl_sync(~0u, inclusive, 31);
    }
    const int returned = args.handle.recv_channel_offset[(r + 1) * num_channels] -
                         args.handle.recv_channel_offset[r * num_channels];
    if (lane == 0) {
      if (args.staging.fits(total)) {
        staged.in_mask |= 1u << r;
        staged.chunk_rows[r] = CombineStagingMap::chunk_rows(total);
      }
      if (args.staging.fits(returned)) staged.out_mask |= 1u << r;
    }
  }
}

// Where rank r's copy of the token lies: this rank's own copy in the combine input, a peer's in the queue
// (the queues' kernel; the staged kernel's ReduceContext::copy_row also knows the staging area).
__device__ __forceinline__ const char* queue_copy_row(const CombineArgs& args, int r, int entry, int channel,
                                                      int own_row0) {
  if (r == args.peers.rank) {
    return static_cast<const char*>(args.in.x) + static_cast<size_t>(own_row0 + entry) * args.record.x_bytes;
  }
  return args.map.record(args.peers.local_base, r, args.peers.rank, channel, static_cast<uint32_t>(entry));
}

// Output chunk c of token t: the sum, rounded once to BF16.
__device__ __forceinline__ void store_chunk(const CombineArgs& args, int t, int c, int num_chunks,
                                            const float (&acc)[8]) {
  static_cast<int4*>(args.out.combined_x)[static_cast<size_t>(t) * num_chunks + c] = round_bf16x8(acc);
}

// The tokens one warp reduces in one batch: first, first + stride, ..., `count` of them.
struct WarpTokens {
  int first;
  int stride;
  int count;
  __device__ int token(int k) const { return first + k * stride; }
};

// What the reducer of one channel shares between its warps and calls. kStaged: the staged combine's kernel
// (peers' rows may lie in the staging area; channel -1 interleaves tokens); without it the code is the queue
// kernel's alone.
struct NoStagingContext {};
struct StagingContext {
  const StagedPeers* staged;
  int calls;  // launches before this one (calls_before): a staged chunk's flag reads calls + 1 once it landed
};
template <bool kStaged>
struct ReduceContext : std::conditional_t<kStaged, StagingContext, NoStagingContext> {
  const CombineArgs& args;
  int channel;       // of the tokens; -1: tokens of every channel (interleaved over the grid's warps)
  int own_row0;      // first row of this rank's own copies on the channel (channel >= 0)
  bool with_queues;  // peers' copies arrive in queues (else there are none)
  uint32_t lane_base;
  int lane;
  bool lane_is_peer;  // lane r < R, r != rank, not staged: waits for and tracks peer r's queue

  __device__ __forceinline__ bool is_staged(int r) const {
    if constexpr (kStaged) {
      return this->staged->comes_in(r);
    } else {
      return false;
    }
  }
  __device__ __forceinline__ int channel_of(int t) const {
    if constexpr (kStaged) {
      return channel >= 0 ? channel : t / tokens_per_channel(args.num_tokens, args.map.num_channels);
    } else {
      return channel;
    }
  }
  // Peer r's copy `entry` of token t in r's staging slot: its row index there (the staged kernel's).
  __device__ __forceinline__ int staged_row(int r, int entry, int t) const {
    if constexpr (kStaged) {
      return this->staged->prefix[r][channel_of(t)] + entry;
    } else {
      return entry;
    }
  }
  // This rank's own copy `entry` of token t: its row in the combine input.
  __device__ __forceinline__ size_t own_row(int entry, int t) const {
    if constexpr (kStaged) {
      const int first =
          channel >= 0
              ? own_row0
              : args.handle.recv_channel_offset[args.peers.rank * args.map.num_channels + channel_of(t)];
      return static_cast<size_t>(first + entry);
    } else {
      return static_cast<size_t>(own_row0 + entry);
    }
  }

  // Where rank r's copy `entry` of token t lies: this rank's own copy in the combine input, a peer's in the
  // staging area or the queue.
  __device__ __forceinline__ const char* copy_row(int r, int entry, int t) const {
    if constexpr (!kStaged) return queue_copy_row(args, r, entry, channel, own_row0);
    if (r == args.peers.rank)
      return static_cast<const char*>(args.in.x) + own_row(entry, t) * args.record.x_bytes;
    if (is_staged(r)) {
      return args.staging.rows(args.peers.local_base, r, args.peers.rank) +
             static_cast<size_t>(staged_row(r, entry, t)) * args.record.x_bytes;
    }
    return args.map.record(args.peers.local_base, r, args.peers.rank, channel, static_cast<uint32_t>(entry));
  }
  // Rank r's top-k weights of copy `entry` of token t (num_topk floats).
  __device__ __forceinline__ const float* copy_weights(int r, int entry, int t) const {
    const int num_topk = args.record.num_topk_weights;
    if (r == args.peers.rank) return args.in.topk_weights + own_row(entry, t) * num_topk;
    if (is_staged(r)) {
      return args.staging.weights(args.peers.local_base, r, args.peers.rank) +
             static_cast<size_t>(staged_row(r, entry, t)) * num_topk;
    }
    return reinterpret_cast<const float*>(copy_row(r, entry, t) + args.record.topk_weights_offset());
  }

  // Where source `j` of token t lies: its copies in ascending rank order, then the rows of bias0 and bias1.
  __device__ __forceinline__ const char* token_source(int t, unsigned copies, int entry, int j) const {
    unsigned rest = copies;
    for (int i = 0; i < j && rest != 0; ++i) rest &= rest - 1;
    const int r = rest != 0 ? __ffs(rest) - 1 : 0;
    const int entry_r = __shfl_sync(~0u, entry, r);
    const int num_copies = __popc(copies);
    if (j < num_copies) return copy_row(r, entry_r, t);
    const size_t bias_row = static_cast<size_t>(t) * args.record.x_bytes;
    j -= num_copies;
    if (args.in.bias0 != nullptr) {
      if (j == 0) return static_cast<const char*>(args.in.bias0) + bias_row;
      --j;
    }
    if (args.in.bias1 != nullptr && j == 0) return static_cast<const char*>(args.in.bias1) + bias_row;
    return nullptr;
  }

  // Lane r: where rank r's copy of token t lies in its queue or in x (-1: none).
  __device__ __forceinline__ int entry_of(int t) const {
    const int num_ranks = args.peers.num_ranks;
    return lane < num_ranks ? args.handle.send_head[static_cast<size_t>(t) * num_ranks + lane] : -1;
  }
  __device__ __forceinline__ int num_sources(unsigned copies) const {
    return __popc(copies) + (args.in.bias0 != nullptr ? 1 : 0) + (args.in.bias1 != nullptr ? 1 : 0);
  }
};

// One warp's tokens, streamed piece by piece through its bulk-copy buffers: lane 0 loads piece p of each
// source of a token in turn (copies in ascending rank order, then the biases), up to kTmaBuffers - 1 pieces
// ahead and across token boundaries; every lane adds its chunks of each landed piece from shared memory, so
// the warp's instructions go to the sums, not to issuing loads. Each chunk is summed in float in that order
// and rounded once to BF16: the order reference::normal_combine defines.
template <bool kStaged>
class WarpReducer {
 public:
  static constexpr int kPieceChunks = kTmaPieceBytes / 16;
  static constexpr int kChunksPerLane = kPieceChunks / 32;
  static_assert(kPieceChunks % 32 == 0, "whole chunks per lane");
  static constexpr int kRing = kTmaBuffers;  // tokens the loads may be ahead of the sums, plus one

  // `clock`: the phase clock of the lane that leads the reduce stream (off in every other lane).
  __device__ WarpReducer(const ReduceContext<kStaged>& context, TmaWarpStage& buffers, int* entry_ring,
                         PhaseClock& clock)
      : c_(context), buffers_(buffers), entry_ring_(entry_ring), clock_(clock) {
    row_bytes_ = c_.args.record.x_bytes;
    num_chunks_ = row_bytes_ / 16;
    num_pieces_ = (row_bytes_ + kTmaPieceBytes - 1) / kTmaPieceBytes;
    if (c_.lane == 0) {
      for (int b = 0; b < kTmaBuffers; ++b) device::mbarrier_init(&buffers_.barriers[b], 1);
    }
    __syncwarp();
  }

  // Reduces every token of `tokens`; `consumed[r]` ends at least at the entries of peer r's queue they used.
  __device__ void reduce(const WarpTokens& tokens, int* consumed) {
    tokens_ = tokens;
    issue_token_ = -1;
    issue_left_ = 0;
    issued_ = 0;
    for (int i = 0; i < kTmaBuffers - 1; ++i) issue_next();
    int item = 0;
    for (int k = 0; k < tokens.count; ++k) {
      const int t = tokens.token(k);
      const int entry = entry_ring_[(k % kRing) * 32 + c_.lane];
      const unsigned copies = __ballot_sync(~0u, entry >= 0);
      const int num_sources = c_.num_sources(copies);
      float weights[kMaxNvlRanks];
      load_topk_weights(t, copies, entry, weights);  // used at the token's end: the loads fly meanwhile
      if (num_sources == 0) {  // a token no rank holds and no bias: zeros (one item, no load)
        issue_next();
        const float zeros[8] = {};
        for (int chunk = c_.lane; chunk < num_chunks_; chunk += 32)
          store_chunk(c_.args, t, chunk, num_chunks_, zeros);
        ++item;
        __syncwarp();
      }
      // One source: the sum is that row bit for bit, so its chunks are copied, with no arithmetic.
      if (num_sources == 1) {
        for (int piece = 0; piece < num_pieces_; ++piece, ++item) {
          const int4* landed = next_landed(item);
          auto* out = static_cast<int4*>(c_.args.out.combined_x) + static_cast<size_t>(t) * num_chunks_;
          const int first = piece * kPieceChunks;
#pragma unroll
          for (int u = 0; u < kChunksPerLane; ++u) {
            const int chunk = c_.lane + 32 * u;
            if (first + chunk < num_chunks_) out[first + chunk] = landed[chunk];
          }
          __syncwarp();
        }
      }
      for (int piece = 0; num_sources > 1 && piece < num_pieces_; ++piece) {
        float acc[kChunksPerLane][8];
#pragma unroll
        for (int u = 0; u < kChunksPerLane; ++u) start_sum(acc[u]);
        const int first = piece * kPieceChunks;
        for (int source = 0; source < num_sources; ++source, ++item) {
          const int4* landed = next_landed(item);
#pragma unroll
          for (int u = 0; u < kChunksPerLane; ++u) {
            const int chunk = c_.lane + 32 * u;
            if (first + chunk < num_chunks_) add_bf16x8(acc[u], landed[chunk]);
          }
          __syncwarp();
        }
#pragma unroll
        for (int u = 0; u < kChunksPerLane; ++u) {
          const int chunk = first + c_.lane + 32 * u;
          if (chunk < num_chunks_) store_chunk(c_.args, t, chunk, num_chunks_, acc[u]);
        }
      }
      store_topk_weights(t, copies, weights);
      if (c_.lane_is_peer && entry >= 0) atomicMax(&consumed[c_.lane], entry + 1);
    }
  }

 private:
  // Issues the next load into the buffer every lane finished reading last item, then waits until item
  // `item`'s piece has landed in its buffer and returns it (every lane calls it with the same state).
  __device__ const int4* next_landed(int item) {
    issue_next();
    clock_.mark(1);
    const int b = item % kTmaBuffers;
    device::mbarrier_wait(&buffers_.barriers[b], (parities_ >> b) & 1u);
    clock_.mark(3);
    parities_ ^= 1u << b;
    return reinterpret_cast<const int4*>(buffers_.pieces[b]);
  }

  // Issues the next (token, piece, source) of the stream into buffer issued_ % kTmaBuffers, if any is left.
  // Every lane calls it with the same state.
  __device__ void issue_next() {
    if (issue_left_ == 0) {
      if (issue_token_ + 1 >= tokens_.count) return;
      start_issue_token(++issue_token_);
    }
    const int b = issued_ % kTmaBuffers;
    ++issued_;
    --issue_left_;
    if (issue_sources_ == 0) return;  // the empty token's one item
    const auto* row = reinterpret_cast<const char*>(
        __shfl_sync(~0u, reinterpret_cast<unsigned long long>(issue_row_), issue_source_));
    if (c_.lane == 0) {
      const int offset = issue_piece_ * kTmaPieceBytes;
      const int bytes = min(kTmaPieceBytes, row_bytes_ - offset);
      device::fence_proxy_async_shared();  // the lanes' reads of this buffer come before the copy's writes
      device::mbarrier_expect_bytes(&buffers_.barriers[b], bytes);
      device::bulk_load(buffers_.pieces[b], row + offset, bytes, &buffers_.barriers[b]);
    }
    if (++issue_source_ == issue_sources_) {
      issue_source_ = 0;
      ++issue_piece_;
    }
  }

  // Token k's copies have landed (waited for here) and its sources are known to the issuing lanes.
  __device__ void start_issue_token(int k) {
    const int t = tokens_.token(k);
    const int entry = c_.entry_of(t);
    // Lane r (a peer): waits for the copy unless a wait already saw the peer's tail past it (then the fence
    // after that wait covers it too).
    bool saw_more = false;
    if (c_.with_queues && c_.lane_is_peer && entry >= seen_) {  // seen_ >= 0 > a missing copy's -1
      auto* counters = NormalBufferMap::counters(c_.args.peers.local_base);
      clock_.mark(1);
      seen_ = device::wait_count_since(&counters->tail[c_.lane][c_.channel], c_.lane_base, entry + 1,
                                       wait_context(c_.args.peers), c_.lane, WaitPhase::kCombineReduce);
      clock_.mark(0);
      saw_more = true;
    }
    // Lane r (staged): waits for the flag of the chunk that holds the copy, unless an earlier wait covered
    // it.
    if constexpr (kStaged) {
      if (c_.lane < c_.args.peers.num_ranks && entry >= 0 && c_.is_staged(c_.lane)) {
        const int chunk = c_.staged_row(c_.lane, entry, t) / c_.staged->chunk_rows[c_.lane];
        if (chunk >= staged_chunks_) {
          clock_.mark(1);
          device::wait_at_least(
              reinterpret_cast<const int*>(c_.args.staging.flag(c_.args.peers.local_base, c_.lane, chunk)),
              static_cast<int>(c_.calls + 1), wait_context(c_.args.peers), c_.lane,
              WaitPhase::kCombineReduce);
          clock_.mark(0);
          staged_chunks_ = chunk + 1;
          saw_more = true;
        }
      }
    }
    // Copies in the queues and the staging area were written through the generic proxy (peers' stores, the
    // copy engine); bulk copies read through the async proxy: lane 0 fences after the waits that saw new
    // copies, before its loads of them.
    if (__ballot_sync(~0u, saw_more) != 0 && c_.lane == 0) device::fence_proxy_async();
    const unsigned copies = __ballot_sync(~0u, entry >= 0);
    entry_ring_[(k % kRing) * 32 + c_.lane] = entry;
    issue_sources_ = c_.num_sources(copies);
    issue_row_ = c_.token_source(t, copies, entry, c_.lane);
    issue_left_ = issue_sources_ == 0 ? 1 : num_pieces_ * issue_sources_;
    issue_piece_ = 0;
    issue_source_ = 0;
  }

  // Lane k < top-k: rank r's weight k of the token, for each rank r that holds a copy.
  __device__ void load_topk_weights(int t, unsigned copies, int entry, float (&weights)[kMaxNvlRanks]) const {
    const int num_topk = c_.args.record.num_topk_weights;
#pragma unroll
    for (int r = 0; r < kMaxNvlRanks; ++r) {
      const int entry_r = __shfl_sync(~0u, entry, r);
      weights[r] = 0.0f;
      if (c_.args.out.combined_topk_weights == nullptr || ((copies >> r) & 1u) == 0 || c_.lane >= num_topk)
        continue;
      if constexpr (!kStaged) {
        if (r == c_.args.peers.rank) {
          weights[r] = c_.args.in.topk_weights[c_.own_row(entry_r, t) * num_topk + c_.lane];
        } else {
          const char* record = queue_copy_row(c_.args, r, entry_r, c_.channel, c_.own_row0);
          weights[r] =
              reinterpret_cast<const volatile float*>(record + c_.args.record.topk_weights_offset())[c_.lane];
        }
      } else {
        weights[r] = reinterpret_cast<const volatile float*>(c_.copy_weights(r, entry_r, t))[c_.lane];
      }
    }
  }

  // The weights summed in ascending rank order.
  __device__ void store_topk_weights(int t, unsigned copies, const float (&weights)[kMaxNvlRanks]) const {
    const int num_topk = c_.args.record.num_topk_weights;
    if (c_.args.out.combined_topk_weights == nullptr || c_.lane >= num_topk) return;
    float sum = 0.0f;
#pragma unroll
    for (int r = 0; r < kMaxNvlRanks; ++r) {
      if ((copies >> r) & 1u) sum += weights[r];
    }
    c_.args.out.combined_topk_weights[static_cast<size_t>(t) * num_topk + c_.lane] = sum;
  }

  const ReduceContext<kStaged>& c_;
  TmaWarpStage& buffers_;
  int* entry_ring_;  // [kRing][32]: each lane's entry of the tokens the loads started
  PhaseClock& clock_;
  int row_bytes_ = 0, num_chunks_ = 0, num_pieces_ = 0;
  uint32_t parities_ = 0;  // the phase each buffer's barrier waits for next
  WarpTokens tokens_{};
  int issue_token_ = -1, issue_left_ = 0, issued_ = 0;
  int issue_sources_ = 0, issue_piece_ = 0, issue_source_ = 0;
  int seen_ = 0;           // lane r (a peer): the records of r's queue a wait saw, from the call's start
  int staged_chunks_ = 0;  // lane r (staged): r's chunks a wait saw arrive
  const char* issue_row_ = nullptr;  // lane j: source j of the token being issued
};

// ---- Reduce: the channel's tokens (or `tokens`, a part of them, without queues) in batches; in a batch each
// warp streams up to CombineBatches::per_warp tokens (without queues: all of its tokens in one batch). With
// queues the batches alternate between the reducer block and the sender block's reducing warps
// (combine_batches: both blocks' reads then bound the call, not the reducer's alone). A warp waits only for
// its own tokens' copies; after each batch a part tells each peer how far it no longer needs the peer's
// queue (its next batch's first record). ----

// The warps of a block that reduce, [first_warp, first_warp + num_warps), and the named barrier they meet at
// (0 with the whole block).
struct ReduceWarps {
  int part;  // 0: the reducer block, 1: the sender block's reducing warps (CombineBatches)
  int first_warp;
  int num_warps;
  int barrier;
  __device__ void sync() const { device::named_barrier_sync(barrier, num_warps * 32); }
};

// The sender block's reducing warps meet at this named barrier (the peers' send groups take 1 .. R - 1).
constexpr int kSenderReduceBarrier = 15;

// One warp, every lane, after a part's batches before token `next` (its next batch starts there): for each
// peer r, the records of r's queue before `next` (the entry after that of the last token before `next` of
// which r holds a copy) into claims[r]. Scans [scanned, next) backwards, 32 tokens a step; where no token
// there has a copy, claims[r] keeps the count of the earlier scans.
template <bool kStaged>
__device__ void claim_records_before(const CombineArgs& args, const StagedPeers& staged, int scanned,
                                     int next, int lane, int* claims) {
  const int num_ranks = args.peers.num_ranks;
  for (int r = 0; r < num_ranks; ++r) {
    if (r == args.peers.rank || (kStaged && staged.comes_in(r))) continue;
    for (int hi = next; hi > scanned; hi -= 32) {
      const int t = hi - 1 - lane;
      const int entry = t >= scanned ? args.handle.send_head[static_cast<size_t>(t) * num_ranks + r] : -1;
      const unsigned found = __ballot_sync(~0u, entry >= 0);
      if (found != 0) {
        const int last = __shfl_sync(~0u, entry, __ffs(found) - 1);  // the lowest lane has the latest token
        if (lane == 0) claims[r] = last + 1;
        break;
      }
    }
  }
}

// The staged kernel's part of a ReduceContext (none for the queues' kernel).
template <bool kStaged>
__device__ std::conditional_t<kStaged, StagingContext, NoStagingContext> staging_context(
    const StagedPeers& staged, int calls) {
  if constexpr (kStaged) {
    return StagingContext{&staged, calls};
  } else {
    return NoStagingContext{};
  }
}

template <bool kStaged>
__device__ void reduce_tokens(const CombineArgs& args, int channel, TokenRange tokens, bool with_queues,
                              const ReduceWarps& part, const CombineBatches& batches, TmaWarpStage* stages,
                              int calls, const StagedPeers& staged) {
  __shared__ int consumed[kMaxNvlRanks];  // records of each peer's queue used so far in this call
  __shared__ int claims[kMaxNvlRanks];  // with two parts: records of each peer's queue this part is done with
  __shared__ int entry_rings[kQueueWarps][WarpReducer<kStaged>::kRing * 32];
  const int num_ranks = args.peers.num_ranks;
  const int rank = args.peers.rank;
  const int thread = static_cast<int>(threadIdx.x) - part.first_warp * 32;  // within the part
  const int warp = thread / 32;
  const int lane = thread % 32;
  const bool lane_is_peer = lane < num_ranks && lane != rank && (!kStaged || !staged.comes_in(lane));
  const bool two_parts = with_queues && batches.warps[1] > 0;
  auto* counters = NormalBufferMap::counters(args.peers.local_base);
  const uint32_t lane_base =
      !lane_is_peer ? 0u : (part.part == 0 ? counters->consumed : counters->consumed_second)[lane][channel];
  const ReduceContext<kStaged> context{
      staging_context<kStaged>(staged, calls),
      args,
      channel,
      !kStaged || channel >= 0 ? args.handle.recv_channel_offset[rank * args.map.num_channels + channel] : 0,
      with_queues,
      lane_base,
      lane,
      lane_is_peer};
  if (thread < kMaxNvlRanks) consumed[thread] = claims[thread] = 0;
  // Records of another shape are not reduced as this one's: the group aborts, naming the field (the waits
  // below then end at once).
  if ((with_queues || (kStaged && staged.in_mask != 0)) && thread < num_ranks && thread != rank)
    check_launch_shape(args.peers, calls, args.shape, thread, WaitPhase::kCombineReduce);
  // The stream's leader: the reducer block's warp 0's lane of the next rank, which waits for that peer's
  // copies.
  PhaseClock clock(
      args.phases, PhaseStream::kCombineReduce,
      with_queues && part.part == 0 && channel == 0 && warp == 0 && lane == (rank + 1) % num_ranks);
  WarpReducer<kStaged> reducer(context, stages[part.first_warp + warp], entry_rings[part.first_warp + warp],
                               clock);
  part.sync();

  // Thread r < R of the part (lane r of its warp 0): tells peer r the records of its queue this part is done
  // with (`force`: even when not more than last time).
  int published = 0;  // thread r < R: what peer r was last told
  const auto publish = [&](int value, bool force) {
    if (!with_queues || thread >= num_ranks || thread == rank || (kStaged && staged.comes_in(thread)) ||
        (value <= published && !force))
      return;
    published = value;
    auto* peer = NormalBufferMap::counters(args.peers.peer_bases[thread]);
    uint32_t* head = part.part == 0 ? &peer->head[rank][channel] : &peer->head_second[rank][channel];
    device::st_release_sys(reinterpret_cast<int*>(head), static_cast<int>(context.lane_base + value));
  };
  int scanned = tokens.begin;
  if (two_parts && part.part == 1) {
    // head_second is stale from an earlier call (dispatches advance head only): this part's first word is due
    // at once, before any of its waits.
    scanned = min(tokens.end, tokens.begin + batches.start(1, 0));
    if (warp == 0) claim_records_before<kStaged>(args, staged, tokens.begin, scanned, lane, claims);
    part.sync();
    if (thread < kMaxNvlRanks) publish(claims[thread], true);
  }

  const int num_tokens = tokens.end - tokens.begin;
  // Channel -1: the grid's warps interleave over the tokens (warp w of block b takes the tokens from
  // b * num_warps + w on, every gridDim.x * num_warps-th).
  const bool interleaved = kStaged && channel < 0;
  const int my_warp = interleaved ? static_cast<int>(blockIdx.x) * part.num_warps + warp : warp;
  const int warps = with_queues
                        ? batches.warps[part.part]
                        : (interleaved ? static_cast<int>(gridDim.x) * part.num_warps : part.num_warps);
  const int size = with_queues ? batches.size[part.part] : num_tokens;
  const int step = with_queues ? batches.cycle() : num_tokens;
  for (int first = tokens.begin + (with_queues ? batches.start(part.part, 0) : 0);
       first < tokens.end && size > 0; first += step) {
    const int batch_end = min(tokens.end, first + size);
    if (my_warp < warps) {
      const int mine = first + my_warp;
      const int count = mine < batch_end ? (batch_end - mine + warps - 1) / warps : 0;
      reducer.reduce(WarpTokens{mine, warps, count}, consumed);
    }
    clock.mark(1);
    part.sync();  // every warp's reads of the batch's records are done
    if (two_parts) {
      // claims[] is warp 0's alone: the other warps go on to the next batch while it scans and publishes.
      // The last batch scans up to tokens.end (a part whose loop runs none starts there).
      if (warp == 0) {
        const int next = min(tokens.end, first + step);
        claim_records_before<kStaged>(args, staged, scanned, next, lane, claims);
        scanned = next;
        __syncwarp();
        if (thread < kMaxNvlRanks) publish(claims[thread], false);
      }
    } else {
      if (thread < kMaxNvlRanks) publish(consumed[thread], false);
      part.sync();  // the next batch's progress is not published before it is read
    }
    clock.mark(2);
  }
  // The running counts the next call starts from: every record of this call (a part that reduced none of a
  // peer's tokens still counts them). Each part keeps its own; a part alone keeps both.
  if (with_queues && lane_is_peer && warp == 0) {
    const uint32_t done = context.lane_base + (two_parts ? claims[lane] : consumed[lane]);
    if (part.part == 0) counters->consumed[lane][channel] = done;
    if (part.part == 1 || !two_parts) counters->consumed_second[lane][channel] = done;
  }
  clock.add_to_report(lane_is_peer ? consumed[lane] : 0, static_cast<int>(args.record.bytes()));
}

// Block 2c sends the rows received on channel c back to their sources with its first warps and reduces a
// share of channel c's tokens with the rest (combine_sender_roles); block 2c + 1 reduces the others. With
// one rank, or when every peer's rows come and go through the staging areas, there are no queues and both
// blocks reduce, half of the channel each. A sender group whose peer takes its rows from the staging area
// (the host copied them there) has nothing to do. kStaged: the kernel of a combine through the staging area
// (CombineArgs::staging enabled); the other instantiation is the queues' alone.
template <bool kStaged>
__global__ void __launch_bounds__(kQueueThreads, 1) combine_kernel(CombineArgs args) {
  __shared__ int group_values[kMaxNvlRanks];
  __shared__ PublishRing rings[kMaxNvlRanks];
  __shared__ StagedPeers staged;
  extern __shared__ TmaWarpStage stages[];  // [kQueueWarps]: the reducing warps'
  const int calls = calls_before(args.peers);
  // After an aborted dispatch the handle's arrays may be anything: read and write nothing.
  if (device::block_sees_abort(wait_context(args.peers), WaitPhase::kCombineReduce)) return;
  post_launch_shape(args.peers, calls, args.shape);
  const int channel = blockIdx.x / 2;
  const bool is_sender = blockIdx.x % 2 == 0;
  const int num_ranks = args.peers.num_ranks;
  const TokenRange range = channel_token_range(args.num_tokens, args.map.num_channels, channel);
  const int warp = threadIdx.x / 32;
  if constexpr (kStaged) {
    find_staged_peers(args, staged);
    __syncthreads();
  }
  const unsigned peers = ((1u << num_ranks) - 1) & ~(1u << args.peers.rank);
  if (kStaged && num_ranks > 1 && staged.in_mask == peers && staged.out_mask == peers) {
    // Every peer's rows come in and go out through the staging areas: the grid's warps interleave over all
    // tokens. A peer's rows lie in token order, so its copy chunks land in token order and every SM reduces
    // each chunk as it lands (per channel, the last channels' blocks would wait for the last chunk alone).
    reduce_tokens<kStaged>(args, -1, TokenRange{0, args.num_tokens}, false, ReduceWarps{0, 0, kQueueWarps, 0},
                           CombineBatches{}, stages, calls, staged);
  } else if (num_ranks == 1) {
    const int middle = range.begin + (range.end - range.begin) / 2;
    reduce_tokens<kStaged>(args, channel,
                           is_sender ? TokenRange{range.begin, middle} : TokenRange{middle, range.end}, false,
                           ReduceWarps{0, 0, kQueueWarps, 0}, CombineBatches{}, stages, calls, staged);
  } else {
    const CombineSenderRoles roles = combine_sender_roles(kQueueWarps, num_ranks, args.sender_reduce_warps);
    const CombineBatches batches = combine_batches(args.map.queue_tokens, kQueueWarps, roles.reduce);
    if (!is_sender) {
      reduce_tokens<kStaged>(args, channel, range, true, ReduceWarps{0, 0, kQueueWarps, 0}, batches, stages,
                             calls, staged);
    } else if (warp >= roles.send) {
      reduce_tokens<kStaged>(args, channel, range, true,
                             ReduceWarps{1, roles.send, roles.reduce, kSenderReduceBarrier}, batches, stages,
                             calls, staged);
    } else {
      const int warps_per_peer = roles.send / (num_ranks - 1);
      const int peer_idx = warp / warps_per_peer;
      if (peer_idx < num_ranks - 1 && (!kStaged || !staged.goes_out(peer_rank(peer_idx, args.peers.rank)))) {
        const WarpGroup group{peer_idx, warp % warps_per_peer, warps_per_peer,
                              static_cast<int>(threadIdx.x % 32)};
        if (args.publisher_warp && group_takes_publisher(warps_per_peer)) {
          send_rows_published(args, channel, peer_rank(peer_idx, args.peers.rank), group, rings[peer_idx],
                              calls, batches.warps[1] > 0);
        } else {
          send_rows(args, channel, peer_rank(peer_idx, args.peers.rank), group, &group_values[peer_idx],
                    calls, batches.warps[1] > 0);
        }
      }
    }
  }
  finish_launch(args.peers, calls);
}

}  // namespace

constexpr size_t kCombineSharedBytes = sizeof(TmaWarpStage) * kQueueWarps;

void launch_combine(const CombineArgs& args, cudaStream_t stream) {
  launch(args.staging.enabled() ? combine_kernel<true> : combine_kernel<false>,
         {unsigned(2 * args.map.num_channels), kQueueThreads, kCombineSharedBytes, Residency::kCoResident},
         stream, args);
}

void preload_normal_combine_kernels() {
  for (auto* kernel : {combine_kernel<false>, combine_kernel<true>}) {
    preload_kernel(kernel);
    allow_dynamic_smem(kernel, kCombineSharedBytes);
  }
}

}  // namespace epx::kernels
