#include <cuda_bf16.h>

#include "common/cuda_check.hpp"
#include "device/tma.cuh"
#include "kernels/normal_kernels.hpp"
#include "kernels/normal_queue.cuh"
#include "kernels/preload.hpp"
#include "kernels/tma_copy.cuh"
#include "kernels/warp_copy.cuh"

namespace epx::kernels {

namespace {

// ---- Send: the rows this rank received from `dst` on `channel` (contiguous, in dst's token order) go back
// into dst's queue, each with its top-k weights. ----
__device__ void send_rows(const CombineArgs& args, int channel, int dst, const WarpGroup& group, int* shared,
                          int calls) {
  const NormalRecord& r = args.record;
  const int index = dst * args.layout.num_channels + channel;
  const int row0 = args.handle.recv_channel_offset[index];
  const int num_rows = args.handle.recv_channel_offset[index + 1] - row0;
  QueueSender queue(args.peers, args.layout, group, shared, dst, channel, args.chunk_tokens,
                    WaitPhase::kCombineSend);
  queue.wait_until_peer_ready(calls);
  while (queue.pushed < num_rows) {
    const int granted = queue.reserve(num_rows - queue.pushed);
    for (int j = group.warp; j < granted; j += group.num_warps) {
      const size_t row = row0 + queue.pushed + j;
      char* record = queue.record(j);
      if (group.lane == 0)
        device::bulk_prefetch_l2(static_cast<const char*>(args.x) + row * r.x_bytes, r.x_bytes);
      warp_copy<false>(record, static_cast<const char*>(args.x) + row * r.x_bytes, r.x_bytes, group.lane);
      if (group.lane < r.num_topk_weights) {
        reinterpret_cast<float*>(record + r.topk_weights_offset())[group.lane] =
            args.topk_weights[row * r.num_topk_weights + group.lane];
      }
    }
    queue.publish(granted);
  }
  queue.finish();
}

__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const int4& packed) {
  const auto* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    acc[2 * i] += f.x;
    acc[2 * i + 1] += f.y;
  }
}

// Where rank r's copy of the token lies: this rank's own copy in the combine input, a peer's in the queue.
__device__ __forceinline__ const char* copy_row(const CombineArgs& args, int r, int entry, int channel,
                                                int own_row0) {
  if (r == args.peers.rank) {
    return static_cast<const char*>(args.x) + static_cast<size_t>(own_row0 + entry) * args.record.x_bytes;
  }
  return args.layout.record(args.peers.local_base, r, args.peers.rank, channel, static_cast<uint32_t>(entry));
}

// Output chunk c of token t: the sum, rounded once to BF16.
__device__ __forceinline__ void store_chunk(const CombineArgs& args, int t, int c, int num_chunks,
                                            const float (&acc)[8]) {
  int4 out;
  auto* pairs = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
  for (int h = 0; h < 4; ++h) pairs[h] = __floats2bfloat162_rn(acc[2 * h], acc[2 * h + 1]);
  static_cast<int4*>(args.combined_x)[static_cast<size_t>(t) * num_chunks + c] = out;
}

// Where source `j` of token t lies: its copies in ascending rank order, then the rows of bias0 and bias1.
__device__ __forceinline__ const char* token_source(const CombineArgs& args, int t, unsigned copies,
                                                    int entry, int j, int channel, int own_row0) {
  unsigned rest = copies;
  for (int i = 0; i < j && rest != 0; ++i) rest &= rest - 1;
  const int r = rest != 0 ? __ffs(rest) - 1 : 0;
  const int entry_r = __shfl_sync(~0u, entry, r);
  const int num_copies = __popc(copies);
  if (j < num_copies) return copy_row(args, r, entry_r, channel, own_row0);
  const size_t bias_row = static_cast<size_t>(t) * args.record.x_bytes;
  j -= num_copies;
  if (args.bias0 != nullptr) {
    if (j == 0) return static_cast<const char*>(args.bias0) + bias_row;
    --j;
  }
  if (args.bias1 != nullptr && j == 0) return static_cast<const char*>(args.bias1) + bias_row;
  return nullptr;
}

// A warp's bulk-copy stage for reducing: which phase each buffer's barrier is in.
struct ReduceStage {
  TmaWarpStage& buffers;
  uint32_t parities = 0;
};

// Token t's sum over the ranks it went to (`copies`; lane r holds rank r's `entry`), in ascending rank order
// in float, then the biases, rounded once to BF16: the order reference::normal_combine defines.
// Lane 0 streams piece p of every source in turn through the warp's buffers with bulk copies (up to
// kTmaBuffers - 1 in flight); every lane adds its chunks of each landed piece from shared memory, so the
// warp's instructions go to the sums, not to issuing loads.
__device__ void reduce_token(const CombineArgs& args, int t, unsigned copies, int entry, int channel,
                             int own_row0, int lane, ReduceStage& stage) {
  constexpr int kPieceChunks = kTmaPieceBytes / 16;
  constexpr int kChunksPerLane = kPieceChunks / 32;
  static_assert(kPieceChunks % 32 == 0, "whole chunks per lane");
  const int row_bytes = args.record.x_bytes;
  const int num_chunks = row_bytes / 16;
  const int num_pieces = (row_bytes + kTmaPieceBytes - 1) / kTmaPieceBytes;
  const int num_sources = __popc(copies) + (args.bias0 != nullptr ? 1 : 0) + (args.bias1 != nullptr ? 1 : 0);
  const char* my_source = token_source(args, t, copies, entry, lane, channel, own_row0);  // lane j: source j
  const int num_items = num_pieces * num_sources;  // (piece, source), source-minor

  int issue_piece = 0, issue_source = 0;
  const auto issue = [&](int item) {  // every lane calls it; lane 0 copies
    if (item >= num_items) return;
    const auto* row = reinterpret_cast<const char*>(
        __shfl_sync(~0u, reinterpret_cast<unsigned long long>(my_source), issue_source));
    if (lane == 0) {
      const int offset = issue_piece * kTmaPieceBytes;
      const int bytes = min(kTmaPieceBytes, row_bytes - offset);
      const int b = item % kTmaBuffers;
      device::fence_proxy_async_shared();  // the lanes' reads of this buffer come before the copy's writes
      device::mbarrier_expect_bytes(&stage.buffers.barriers[b], bytes);
      device::bulk_load(stage.buffers.pieces[b], row + offset, bytes, &stage.buffers.barriers[b]);
    }
    if (++issue_source == num_sources) {
      issue_source = 0;
      ++issue_piece;
    }
  };
  // Copies in the queues were written by peers through the generic proxy; the bulk copies read through the
  // async proxy.
  if (lane == 0) device::fence_proxy_async();
  for (int item = 0; item < kTmaBuffers - 1; ++item) issue(item);

  float acc[kChunksPerLane][8] = {};
  int piece = 0, source = 0;
  for (int item = 0; item < num_items; ++item) {
    issue(item + kTmaBuffers - 1);  // into the buffer every lane finished reading last iteration
    const int b = item % kTmaBuffers;
    device::mbarrier_wait(&stage.buffers.barriers[b], (stage.parities >> b) & 1u);
    stage.parities ^= 1u << b;
    const auto* landed = reinterpret_cast<const int4*>(stage.buffers.pieces[b]);
    const int first = piece * kPieceChunks;
#pragma unroll
    for (int u = 0; u < kChunksPerLane; ++u) {
      const int k = lane + 32 * u;
      if (first + k < num_chunks && k < kPieceChunks) add_bf16x8(acc[u], landed[k]);
    }
    if (++source == num_sources) {
#pragma unroll
      for (int u = 0; u < kChunksPerLane; ++u) {
        const int k = lane + 32 * u;
        if (first + k < num_chunks) store_chunk(args, t, first + k, num_chunks, acc[u]);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[u][i] = 0.0f;
      }
      source = 0;
      ++piece;
    }
    __syncwarp();
  }
  if (num_sources == 0) {  // a token no rank holds and no bias: zeros
    for (int c = lane; c < num_chunks; c += 32) store_chunk(args, t, c, num_chunks, acc[0]);
  }
  const int num_topk = args.record.num_topk_weights;
  if (args.combined_topk_weights != nullptr) {
    float sum = 0.0f;
#pragma unroll
    for (int r = 0; r < kMaxNvlRanks; ++r) {
      const int entry_r = __shfl_sync(~0u, entry, r);
      if (((copies >> r) & 1u) == 0 || lane >= num_topk) continue;
      if (r == args.peers.rank) {
        sum += args.topk_weights[static_cast<size_t>(own_row0 + entry_r) * num_topk + lane];
      } else {
        const char* record = copy_row(args, r, entry_r, channel, own_row0);
        sum += reinterpret_cast<const volatile float*>(record + args.record.topk_weights_offset())[lane];
      }
    }
    if (lane < num_topk) args.combined_topk_weights[static_cast<size_t>(t) * num_topk + lane] = sum;
  }
}

// ---- Reduce: the channel's tokens (or `tokens`, a part of them, without queues) in batches of one token per
// warp. A warp waits only for its own token's copies; after each batch, each peer learns how far its queue
// was consumed.
// NOTES: a batch needs at most `batch` <= Q new records of each queue, and senders write whatever room
// allows, so every record a batch waits for fits in the queue: no deadlock for any chunk sizes. ----
__device__ void reduce_tokens(const CombineArgs& args, int channel, TokenRange tokens, bool with_queues,
                              TmaWarpStage* stages) {
  __shared__ int consumed[kMaxNvlRanks];  // records of each peer's queue used so far in this call
  const int num_ranks = args.peers.num_ranks;
  const int rank = args.peers.rank;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int own_row0 = args.handle.recv_channel_offset[rank * args.layout.num_channels + channel];
  const bool lane_is_peer = lane < num_ranks && lane != rank;
  auto* counters = NormalLayout::counters(args.peers.local_base);
  const uint32_t lane_base = lane_is_peer ? counters->consumed[lane][channel] : 0;
  if (threadIdx.x < kMaxNvlRanks) consumed[threadIdx.x] = 0;
  ReduceStage stage{stages[warp]};
  if (lane == 0) {
    for (int b = 0; b < kTmaBuffers; ++b) device::mbarrier_init(&stage.buffers.barriers[b], 1);
  }
  int published = 0;  // thread r < R: what peer r was last told
  __syncthreads();

  const int batch = with_queues ? min(kQueueWarps, args.layout.queue_tokens) : kQueueWarps;
  for (int first = tokens.begin; first < tokens.end; first += batch) {
    const int t = first + warp;
    if (warp < batch && t < tokens.end) {
      const int entry =
          lane < num_ranks ? args.handle.send_head[static_cast<size_t>(t) * num_ranks + lane] : -1;
      if (lane_is_peer && entry >= 0) {
        device::wait_count_since(&counters->tail[lane][channel], lane_base, entry + 1,
                                 wait_context(args.peers), lane, WaitPhase::kCombineReduce);
      }
      __syncwarp();
      const unsigned copies = __ballot_sync(~0u, entry >= 0);
      reduce_token(args, t, copies, entry, channel, own_row0, lane, stage);
      if (lane_is_peer && entry >= 0) atomicMax(&consumed[lane], entry + 1);
    }
    __syncthreads();
    if (with_queues && threadIdx.x < num_ranks && threadIdx.x != rank && consumed[threadIdx.x] > published) {
      published = consumed[threadIdx.x];
      auto* head = &NormalLayout::counters(args.peers.peer_bases[threadIdx.x])->head[rank][channel];
      device::st_release_sys(reinterpret_cast<int*>(head), static_cast<int>(lane_base + published));
    }
    __syncthreads();  // the next batch's progress is not published before it is read
  }
  if (with_queues && lane_is_peer && warp == 0)
    counters->consumed[lane][channel] = lane_base + consumed[lane];
}

// Block 2c sends the rows received on channel c back to their sources, block 2c + 1 reduces channel c's
// tokens. With one rank there are no queues and both blocks reduce, half of the channel each.
__global__ void __launch_bounds__(kQueueThreads, 1) combine_kernel(CombineArgs args) {
  __shared__ int group_values[kMaxNvlRanks];
  extern __shared__ TmaWarpStage stages[];  // [kQueueWarps], reducer blocks only
  const int calls = calls_before(args.peers);
  const int channel = blockIdx.x / 2;
  const bool is_sender = blockIdx.x % 2 == 0;
  const int num_ranks = args.peers.num_ranks;
  const TokenRange range = channel_token_range(args.num_tokens, args.layout.num_channels, channel);
  if (num_ranks == 1) {
    const int middle = range.begin + (range.end - range.begin) / 2;
    reduce_tokens(args, channel, is_sender ? TokenRange{range.begin, middle} : TokenRange{middle, range.end},
                  false, stages);
  } else if (is_sender) {
    const int warp = threadIdx.x / 32;
    const int warps_per_peer = kQueueWarps / (num_ranks - 1);
    const int peer_idx = warp / warps_per_peer;
    if (peer_idx < num_ranks - 1) {
      const WarpGroup group{peer_idx, warp % warps_per_peer, warps_per_peer,
                            static_cast<int>(threadIdx.x % 32)};
      send_rows(args, channel, peer_rank(peer_idx, args.peers.rank), group, &group_values[peer_idx], calls);
    }
  } else {
    reduce_tokens(args, channel, range, true, stages);
  }
  finish_launch(args.peers, calls);
}

}  // namespace

constexpr size_t kCombineSharedBytes = sizeof(TmaWarpStage) * kQueueWarps;

void launch_combine(const CombineArgs& args, cudaStream_t stream) {
  combine_kernel<<<2 * args.layout.num_channels, kQueueThreads, kCombineSharedBytes, stream>>>(args);
  EPX_CUDA_CHECK_LAUNCH();
}

void preload_normal_combine_kernels() {
  preload_kernel(combine_kernel);
  allow_dynamic_smem(combine_kernel, kCombineSharedBytes);
}

}  // namespace epx::kernels
