#include <cuda_bf16.h>

#include "common/cuda_check.hpp"
#include "device/tma.cuh"
#include "kernels/normal_kernels.hpp"
#include "kernels/normal_queue.cuh"
#include "kernels/preload.hpp"
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

// Output chunk c of token t: the sum so far plus the biases, rounded once to BF16.
__device__ __forceinline__ void store_combined(const CombineArgs& args, int t, int c, int num_chunks,
                                               float (&acc)[8]) {
  const size_t offset = static_cast<size_t>(t) * num_chunks + c;
  if (args.bias0 != nullptr) add_bf16x8(acc, static_cast<const int4*>(args.bias0)[offset]);
  if (args.bias1 != nullptr) add_bf16x8(acc, static_cast<const int4*>(args.bias1)[offset]);
  int4 out;
  auto* pairs = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
  for (int h = 0; h < 4; ++h) pairs[h] = __floats2bfloat162_rn(acc[2 * h], acc[2 * h + 1]);
  static_cast<int4*>(args.combined_x)[offset] = out;
}

// Token t's sum over the ranks it went to (`entries[r]` >= 0), in ascending rank order in float, then the
// biases, rounded once to BF16: the order reference::normal_combine defines. Each lane loads four chunks of a
// copy before adding them, so several reads are in flight.
__device__ void reduce_token(const CombineArgs& args, int t, const int (&entries)[kMaxNvlRanks], int channel,
                             int own_row0, int lane) {
  constexpr int kUnroll = 4;
  const int num_chunks = args.record.x_bytes / 16;
  if (lane < kMaxNvlRanks && entries[lane] >= 0) {
    device::bulk_prefetch_l2(copy_row(args, lane, entries[lane], channel, own_row0), args.record.x_bytes);
  }
  for (int c0 = lane; c0 < num_chunks; c0 += 32 * kUnroll) {
    float acc[kUnroll][8] = {};
#pragma unroll
    for (int r = 0; r < kMaxNvlRanks; ++r) {
      if (entries[r] < 0) continue;
      const auto* row = reinterpret_cast<const int4*>(copy_row(args, r, entries[r], channel, own_row0));
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (c0 + u * 32 < num_chunks) v[u] = device::ld_v4(row + c0 + u * 32);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (c0 + u * 32 < num_chunks) add_bf16x8(acc[u], v[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + u * 32;
      if (c < num_chunks) store_combined(args, t, c, num_chunks, acc[u]);
    }
  }
  const int num_topk = args.record.num_topk_weights;
  if (args.combined_topk_weights != nullptr && lane < num_topk) {
    float sum = 0.0f;
#pragma unroll
    for (int r = 0; r < kMaxNvlRanks; ++r) {
      if (entries[r] < 0) continue;
      if (r == args.peers.rank) {
        sum += args.topk_weights[static_cast<size_t>(own_row0 + entries[r]) * num_topk + lane];
      } else {
        const char* record = copy_row(args, r, entries[r], channel, own_row0);
        sum += reinterpret_cast<const volatile float*>(record + args.record.topk_weights_offset())[lane];
      }
    }
    args.combined_topk_weights[static_cast<size_t>(t) * num_topk + lane] = sum;
  }
}

// ---- Reduce: the channel's tokens (or `tokens`, a part of them, without queues) in batches of one token per
// warp. A warp waits only for its own token's copies; after each batch, each peer learns how far its queue
// was consumed.
// NOTES: a batch needs at most `batch` <= Q new records of each queue, and senders write whatever room
// allows, so every record a batch waits for fits in the queue: no deadlock for any chunk sizes. ----
__device__ void reduce_tokens(const CombineArgs& args, int channel, TokenRange tokens, bool with_queues) {
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
      int entries[kMaxNvlRanks];
#pragma unroll
      for (int r = 0; r < kMaxNvlRanks; ++r) entries[r] = __shfl_sync(~0u, entry, r);
#pragma unroll
      for (int r = 0; r < kMaxNvlRanks; ++r) entries[r] = r < num_ranks ? entries[r] : -1;
      reduce_token(args, t, entries, channel, own_row0, lane);
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
  const int calls = calls_before(args.peers);
  const int channel = blockIdx.x / 2;
  const bool is_sender = blockIdx.x % 2 == 0;
  const int num_ranks = args.peers.num_ranks;
  const TokenRange range = channel_token_range(args.num_tokens, args.layout.num_channels, channel);
  if (num_ranks == 1) {
    const int middle = range.begin + (range.end - range.begin) / 2;
    reduce_tokens(args, channel, is_sender ? TokenRange{range.begin, middle} : TokenRange{middle, range.end},
                  false);
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
    reduce_tokens(args, channel, range, true);
  }
  finish_launch(args.peers, calls);
}

}  // namespace

void launch_combine(const CombineArgs& args, cudaStream_t stream) {
  combine_kernel<<<2 * args.layout.num_channels, kQueueThreads, 0, stream>>>(args);
  EPX_CUDA_CHECK_LAUNCH();
}

void preload_normal_combine_kernels() {
  preload_kernel(combine_kernel);
}

}  // namespace epx::kernels
