#include "common/cuda_check.hpp"
#include "kernels/normal_kernels.hpp"
#include "kernels/normal_queue.cuh"
#include "kernels/preload.hpp"
#include "kernels/tma_copy.cuh"
#include "kernels/warp_copy.cuh"

namespace epx::kernels {

namespace {

// Writes output row `row`: the token row from `x_row` (a bulk copy driven by the copier's lane), its scales,
// its top-k as this rank's local expert ids (-1 and weight 0 for other ranks' experts) and its source index.
// `kFromQueue`: the inputs lie in a queue record that peers rewrite while the kernel runs, so they are read
// coherently.
template <bool kFromQueue>
__device__ __forceinline__ void write_row(const DispatchArgs& args, int row, const char* x_row,
                                          const float* scales, const int* topk_idx32,
                                          const int64_t* topk_idx64, const float* weights, int src_idx,
                                          int lane, TmaRowCopier& copier) {
  const size_t row_bytes = args.record.x_bytes;
  if (copier.driver()) copier.copy(static_cast<char*>(args.recv_x) + row * row_bytes, x_row, row_bytes);
  // The small fields go to lanes 1.., so lane 0 keeps the bulk copies flowing.
  const int num_scales = args.record.num_scales;
  for (int g = lane - 1; g >= 0 && g < num_scales; g += 31) {
    args.recv_x_scales[static_cast<size_t>(row) * num_scales + g] =
        kFromQueue ? *reinterpret_cast<const volatile float*>(scales + g) : scales[g];
  }
  const int num_topk = args.record.num_topk_idx;
  const int k = lane - 1;
  if (args.recv_topk_idx != nullptr && k >= 0 && k < num_topk) {
    const int experts_per_rank = args.num_experts / args.peers.num_ranks;
    const int global =
        kFromQueue ? *reinterpret_cast<const volatile int*>(topk_idx32 + k) : static_cast<int>(topk_idx64[k]);
    const float weight = weights == nullptr ? 0.0f
                         : kFromQueue       ? *reinterpret_cast<const volatile float*>(weights + k)
                                            : weights[k];
    const int local = to_local_expert(global, args.peers.rank, experts_per_rank);
    args.recv_topk_idx[static_cast<size_t>(row) * num_topk + k] = local;
    args.recv_topk_weights[static_cast<size_t>(row) * num_topk + k] = local >= 0 ? weight : 0.0f;
  }
  if (lane == 31) args.handle.recv_src_idx[row] = src_idx;
}

// Copies token `token` of this rank into a queue record in a peer's buffer (posted NVLink stores).
__device__ __forceinline__ void write_record(const DispatchArgs& args, char* record, int token, int lane) {
  const NormalRecord& r = args.record;
  if (lane == 0)
    device::bulk_prefetch_l2(static_cast<const char*>(args.x) + static_cast<size_t>(token) * r.x_bytes,
                             r.x_bytes);
  write_token_record(record, r, args.x, args.x_scales, args.topk_idx, args.topk_weights, token, lane);
}

// ---- Rows this rank keeps: straight from x into recv_x, no queue. Warp `worker` of `num_workers` (possibly
// spread over two blocks) takes every num_workers-th row; all of them scan the whole channel, so they agree
// on every row's position. ----
__device__ void copy_own_rows(const DispatchArgs& args, int channel, int worker, int num_workers, int lane,
                              TmaRowCopier& copier) {
  const int num_ranks = args.peers.num_ranks;
  const int rank = args.peers.rank;
  const TokenRange range = channel_token_range(args.num_tokens, args.layout.num_channels, channel);
  const int row0 = args.handle.recv_channel_offset[rank * args.layout.num_channels + channel];
  const int num_topk = args.record.num_topk_idx;
  int count = 0;
  const auto flag_at = [&](int t) {
    return t < range.end && args.is_token_in_rank[static_cast<size_t>(t) * num_ranks + rank] != 0;
  };
  bool next_in = flag_at(range.begin + lane);  // one window ahead, so its load overlaps this window's rows
  for (int t0 = range.begin, window = 0; t0 < range.end; t0 += 32, ++window) {
    const int t = t0 + lane;
    const bool in = next_in;
    next_in = flag_at(t + 32);
    const unsigned mask = __ballot_sync(~0u, in);
    if (window % num_workers == worker && t < range.end) {
      args.handle.send_head[static_cast<size_t>(t) * num_ranks + rank] =
          in ? count + __popc(mask & lanes_below(lane)) : -1;
    }
    for (unsigned todo = mask; todo != 0; todo &= todo - 1) {
      const int bit = __ffs(todo) - 1;
      const int entry = count + __popc(mask & lanes_below(bit));
      if (entry % num_workers != worker) continue;
      const int token = t0 + bit;
      const size_t k = static_cast<size_t>(token) * num_topk;
      write_row<false>(args, row0 + entry,
                       static_cast<const char*>(args.x) + static_cast<size_t>(token) * args.record.x_bytes,
                       args.x_scales + static_cast<size_t>(token) * args.record.num_scales, nullptr,
                       args.topk_idx + k, args.topk_weights == nullptr ? nullptr : args.topk_weights + k,
                       token, lane, copier);
    }
    count += __popc(mask);
  }
}

// ---- Send: the channel's tokens for `dst`, in token order, into dst's queue, a chunk at a time. ----
__device__ void send_tokens(const DispatchArgs& args, int channel, int dst, const WarpGroup& group,
                            int* shared, int calls) {
  const int num_ranks = args.peers.num_ranks;
  QueueSender queue(args.peers, args.layout, group, shared, dst, channel, args.chunk_tokens,
                    WaitPhase::kDispatchSend);
  queue.wait_until_peer_ready(calls);
  const TokenRange range = channel_token_range(args.num_tokens, args.layout.num_channels, channel);
  const int lane = group.lane;
  int window = 0;
  for (int t0 = range.begin; t0 < range.end;) {
    const int granted = queue.reserve(args.chunk_tokens);
    int taken = 0;
    // Scan 32 tokens at a time; a window that holds more than the chunk has room for is cut after the last
    // token taken, and the next scan resumes there. Every warp scans identically.
    while (taken < granted && t0 < range.end) {
      const int t = t0 + lane;
      const bool in = t < range.end && args.is_token_in_rank[static_cast<size_t>(t) * num_ranks + dst] != 0;
      unsigned mask = __ballot_sync(~0u, in);
      int width = 32;
      const int room = granted - taken;
      if (__popc(mask) > room) {
        unsigned last = mask;
        for (int i = 1; i < room; ++i) last &= last - 1;
        width = __ffs(last);  // one past the room-th token
        mask &= width == 32 ? ~0u : (1u << width) - 1u;
      }
      if (window % group.num_warps == group.warp && lane < width && t < range.end) {
        const bool sent = (mask >> lane) & 1u;
        args.handle.send_head[static_cast<size_t>(t) * num_ranks + dst] =
            sent ? queue.pushed + taken + __popc(mask & lanes_below(lane)) : -1;
      }
      for (unsigned todo = mask; todo != 0; todo &= todo - 1) {
        const int bit = __ffs(todo) - 1;
        const int entry = taken + __popc(mask & lanes_below(bit));
        if (entry % group.num_warps == group.warp) write_record(args, queue.record(entry), t0 + bit, lane);
      }
      taken += __popc(mask);
      t0 += width;
      ++window;
    }
    queue.publish(taken);
  }
  queue.finish();
}

// ---- Receive: the channel's rows from `src`, copied out of this rank's queue into their final rows. ----
__device__ void receive_tokens(const DispatchArgs& args, int channel, int src, const WarpGroup& group,
                               int* shared, TmaRowCopier& copier) {
  const int index = src * args.layout.num_channels + channel;
  const int row0 = args.handle.recv_channel_offset[index];
  QueueReceiver queue(args.peers, args.layout, group, shared, src, channel,
                      args.handle.recv_channel_offset[index + 1] - row0, WaitPhase::kDispatchReceive);
  const NormalRecord& r = args.record;
  while (!queue.done()) {
    const int ready = queue.wait_ready();
    // The records were written by a peer and published to this rank's generic proxy; the bulk copies read
    // through the async proxy.
    if (copier.driver()) device::fence_proxy_async();
    for (int j = group.warp; j < ready; j += group.num_warps) {
      const char* record = queue.record(j);
      write_row<true>(
          args, row0 + queue.got + j, record, reinterpret_cast<const float*>(record + r.scales_offset()),
          reinterpret_cast<const int*>(record + r.topk_idx_offset()), nullptr,
          reinterpret_cast<const float*>(record + r.topk_weights_offset()),
          *reinterpret_cast<const volatile int*>(record + r.src_idx_offset()), group.lane, copier);
    }
    if (copier.driver()) copier.wait_loads();  // the rows left the queue before its slots are released
    queue.release(ready);
  }
  queue.finish();
}

// Padding rows of the worst-case layout (after every received row): no source, no experts.
__device__ void mark_padding_rows(const DispatchArgs& args, int channel) {
  const int num_rows = args.handle.recv_channel_offset[args.peers.num_ranks * args.layout.num_channels];
  const int num_topk = args.record.num_topk_idx;
  const int stride = args.layout.num_channels * kQueueThreads;
  for (int row = num_rows + channel * kQueueThreads + threadIdx.x; row < args.num_out_rows; row += stride) {
    args.handle.recv_src_idx[row] = -1;
    if (args.recv_topk_idx == nullptr) continue;
    for (int k = 0; k < num_topk; ++k) {
      args.recv_topk_idx[static_cast<size_t>(row) * num_topk + k] = -1;
      args.recv_topk_weights[static_cast<size_t>(row) * num_topk + k] = 0.0f;
    }
  }
}

// Block 2c sends channel c's tokens to the peers, block 2c + 1 receives channel c's rows from them and copies
// the rows this rank keeps. With one rank there are no queues and both blocks copy.
__global__ void __launch_bounds__(kQueueThreads, 1) dispatch_kernel(DispatchArgs args) {
  __shared__ int group_values[kMaxNvlRanks];
  extern __shared__ TmaWarpStage tma_stages[];  // [kQueueWarps]
  const int calls = calls_before(args.peers);
  // After an aborted notify (worst-case mode launches this without the host's look at the counts) the
  // offsets may be anything: write nothing.
  if (device::block_sees_abort(wait_context(args.peers), WaitPhase::kDispatchReceive)) return;
  const int channel = blockIdx.x / 2;
  const bool is_sender = blockIdx.x % 2 == 0;
  const int num_ranks = args.peers.num_ranks;
  const int rank = args.peers.rank;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  TmaRowCopier copier(&tma_stages[warp], lane == 0);

  if (num_ranks == 1) {
    copy_own_rows(args, channel, warp + (is_sender ? kQueueWarps : 0), 2 * kQueueWarps, lane, copier);
  } else if (is_sender) {
    const int warps_per_peer = kQueueWarps / (num_ranks - 1);
    const int peer_idx = warp / warps_per_peer;
    if (peer_idx < num_ranks - 1) {
      const WarpGroup group{peer_idx, warp % warps_per_peer, warps_per_peer, lane};
      send_tokens(args, channel, peer_rank(peer_idx, rank), group, &group_values[peer_idx], calls);
    }
  } else {
    const int warps_per_rank = kQueueWarps / num_ranks;
    const int src = warp / warps_per_rank;
    if (src == rank) {
      copy_own_rows(args, channel, warp % warps_per_rank, warps_per_rank, lane, copier);
    } else if (src < num_ranks) {
      const WarpGroup group{src, warp % warps_per_rank, warps_per_rank, lane};
      receive_tokens(args, channel, src, group, &group_values[src], copier);
    }
  }
  if (!is_sender) mark_padding_rows(args, channel);
  copier.finish();
  finish_launch(args.peers, calls);
}

}  // namespace

constexpr size_t kDispatchSharedBytes = sizeof(TmaWarpStage) * kQueueWarps;

void launch_dispatch(const DispatchArgs& args, cudaStream_t stream) {
  dispatch_kernel<<<2 * args.layout.num_channels, kQueueThreads, kDispatchSharedBytes, stream>>>(args);
  EPX_CUDA_CHECK_LAUNCH();
}

void preload_normal_dispatch_kernels() {
  preload_kernel(dispatch_kernel);
  allow_dynamic_smem(dispatch_kernel, kDispatchSharedBytes);
}

}  // namespace epx::kernels
