#pragma once

#include <cstdint>

#include "common/tagged_word.hpp"
#include "device/ptx.cuh"
#include "device/tma.cuh"
#include "device/wait.cuh"
#include "kernels/normal_kernels.hpp"
#include "kernels/normal_queue.cuh"
#include "kernels/record_fields.cuh"
#include "kernels/wait_context.cuh"
#include "kernels/warp_copy.cuh"

// A within-node dispatch of a Buffer with an output window (DispatchArgs::window_posts): every receiver posts
// how it receives, and each source sends each destination that way. Into the window (DispatchArgs::to_window)
// the rows that cross go straight from the source's x into the receiver's outputs, so each crosses an SM's
// port once (the queue's way passes three: the source's store, the receiver's load and store out of the
// queue): the receiver posts where its outputs are and where each (source, channel)'s rows start, a source's
// senders store there and say when they are done, and the receiver's kernel ends once every source said so.
// A receiver whose outputs are elsewhere posts that it receives through its queues. The choice is each
// receiver's own, so ranks need not agree on it. Posts and the done words carry the launch number (calls + 1,
// the same on every rank), so nothing of an earlier call is taken for this one's.
namespace epx::kernels {

// The outputs of one receiver as its sources address them.
struct WindowOutputs {
  char* x;
  float* x_scales;
  int64_t* topk_idx;
  float* topk_weights;
  // Where the rows' source indices go (the receiver's idle queues), or null (a cached dispatch).
  int* src_idx;
};

// Whether this rank receives into its window: its outputs lie there (to_window), or a guess there holds the
// rows (window_guess). Read after the channel offsets are known (the rows are their last entry).
__device__ __forceinline__ bool receives_into_window(const DispatchArgs& args) {
  if (args.to_window) return true;
  if (!args.window_guess) return false;
  const int rows = args.handle.recv_channel_offset[args.peers.num_ranks * args.map.num_channels];
  return rows <= args.guess_rows;
}

// Block 1, threads below R: tells every source how this rank receives, as where its outputs are (recv_x's
// offset -1: through the queues). First thing in the launch, so a source never waits on this rank's host
// (published outputs) to learn it; with a guess in the window once the counts say whether the rows fit it.
__device__ __forceinline__ void post_window_way(const DispatchArgs& args, int calls, bool into_window) {
  const int src = threadIdx.x;
  if (src >= args.peers.num_ranks || src == args.peers.rank) return;
  auto* posts = NormalBufferMap::direct(args.peers.peer_bases[src]);
  for (int i = 0; i < NormalBufferMap::kDirectOutputs; ++i) {
    const int offset = into_window ? args.window_outputs[i] : -1;
    device::st_relaxed_sys_u64(&posts->outputs[args.peers.rank][i],
                               pack_tagged(static_cast<uint32_t>(calls + 1), offset));
  }
}

// Receiver block of `channel` into the window, threads below R: tells every source where its rows of this
// channel start in this rank's outputs.
__device__ __forceinline__ void post_window_rows(const DispatchArgs& args, int channel, int calls) {
  const int src = threadIdx.x;
  if (src >= args.peers.num_ranks || src == args.peers.rank) return;
  auto* posts = NormalBufferMap::direct(args.peers.peer_bases[src]);
  const int first = args.handle.recv_channel_offset[src * args.map.num_channels + channel];
  device::st_relaxed_sys_u64(&posts->first_row[args.peers.rank][channel],
                             pack_tagged(static_cast<uint32_t>(calls + 1), first));
}

// Receiver block of `channel`, every thread: waits until every source stored its rows of the channel (threads
// below R wait), then copies their source indices from where the sources put them (this rank's idle queues)
// into the handle, when they went there (not for a cached dispatch).
__device__ __forceinline__ void wait_window_rows(const DispatchArgs& args, int channel, int calls) {
  const int num_ranks = args.peers.num_ranks;
  const int src = threadIdx.x;
  if (src < num_ranks && src != args.peers.rank) {
    auto* posts = NormalBufferMap::direct(args.peers.local_base);
    device::try_wait_at_least(&posts->rows_done[src][channel], calls + 1, wait_context(args.peers), src,
                              WaitPhase::kDispatchReceive);
  }
  const int scratch = args.window_outputs[NormalBufferMap::kDirectSrcIdx];
  if (scratch < 0) return;
  // The waits' acquires, then the barrier, order the sources' stores before these loads.
  __syncthreads();
  const int* src_idx =
      reinterpret_cast<const int*>(static_cast<char*>(args.peers.local_base) + size_t(scratch) * 16);
  const int* offsets = args.handle.recv_channel_offset;
  for (int s = 0; s < num_ranks; ++s) {
    if (s == args.peers.rank) continue;
    const int index = s * args.map.num_channels + channel;
    for (int row = offsets[index] + threadIdx.x; row < offsets[index + 1]; row += blockDim.x)
      args.handle.recv_src_idx[row] = static_cast<int>(load_word<true>(src_idx + row));
  }
}

// How `dst` receives this channel's rows, for every lane of the group: kWindow (`out` and `first_row` say
// where), kQueue, or kNone (the wait was abandoned, or dst's launch has another shape, which the group's
// leader reported).
enum class WindowWay { kNone, kQueue, kWindow };
__device__ __forceinline__ WindowWay window_way(const DispatchArgs& args, int channel, int dst,
                                                const WarpGroup& group, int* shared, int calls,
                                                WindowOutputs& out, int& first_row) {
  // dst's fingerprint first: a dst of another shape or without a window is named at once.
  const bool same = group.share(group.leader() ? check_launch_shape(args.peers, calls, args.shape, dst,
                                                                    WaitPhase::kDispatchSend)
                                               : 1,
                                shared) != 0;
  if (!same) return WindowWay::kNone;
  const uint32_t launch = static_cast<uint32_t>(calls + 1);
  const auto* posts = NormalBufferMap::direct(args.peers.local_base);
  const device::WaitContext ctx = wait_context(args.peers);
  const int lane = group.lane;
  // The outputs' words side by side, one a lane; then, into a window, the channel's first row.
  constexpr int kOutputs = NormalBufferMap::kDirectOutputs;
  int value = -1;
  bool arrived = true;
  if (lane < kOutputs)
    arrived = device::try_wait_tagged(&posts->outputs[dst][lane], launch, ctx, dst, WaitPhase::kDispatchSend,
                                      value);
  if (!__all_sync(~0u, arrived)) return WindowWay::kNone;
  if (__shfl_sync(~0u, value, NormalBufferMap::kDirectX) < 0) return WindowWay::kQueue;
  int first = 0;
  if (lane == 0)
    arrived = device::try_wait_tagged(&posts->first_row[dst][channel], launch, ctx, dst,
                                      WaitPhase::kDispatchSend, first);
  if (__shfl_sync(~0u, static_cast<int>(arrived), 0) == 0) return WindowWay::kNone;
  char* base = static_cast<char*>(args.peers.peer_bases[dst]);
  const auto at = [&](int i) -> void* {
    const int units = __shfl_sync(~0u, value, i);
    return units < 0 ? nullptr : base + static_cast<size_t>(units) * 16;
  };
  out = {static_cast<char*>(at(NormalBufferMap::kDirectX)),
         static_cast<float*>(at(NormalBufferMap::kDirectScales)),
         static_cast<int64_t*>(at(NormalBufferMap::kDirectTopkIdx)),
         static_cast<float*>(at(NormalBufferMap::kDirectTopkWeights)),
         static_cast<int*>(at(NormalBufferMap::kDirectSrcIdx))};
  first_row = __shfl_sync(~0u, first, 0);
  return WindowWay::kWindow;
}

// ---- Send: the channel's tokens for `dst`, in token order, straight into dst's outputs (window_way). ----
__device__ void send_tokens_to_window(const DispatchArgs& args, int channel, int dst, const WarpGroup& group,
                                      const WindowOutputs& out, int first_row, int calls) {
  const int num_ranks = args.peers.num_ranks;
  const NormalRecord& r = args.record;
  const FieldOutputs field_out{out.x_scales, out.topk_idx, out.topk_weights, out.src_idx};
  const TokenRange range = channel_token_range(args.num_tokens, args.map.num_channels, channel);
  const int lane = group.lane;
  int taken = 0;
  for (int t0 = range.begin, window = 0; t0 < range.end; t0 += 32, ++window) {
    const int t = t0 + lane;
    const bool in = t < range.end && args.is_token_in_rank[static_cast<size_t>(t) * num_ranks + dst] != 0;
    const unsigned mask = __ballot_sync(~0u, in);
    // Entries count as the queue's do, so the combine reads send_head the same way.
    if (window % group.num_warps == group.warp && t < range.end)
      args.handle.send_head[static_cast<size_t>(t) * num_ranks + dst] =
          in ? taken + __popc(mask & lanes_below(lane)) : -1;
    for (unsigned todo = worker_tokens(mask, taken, group.warp, group.num_warps, lane); todo != 0;
         todo &= todo - 1) {
      const int bit = __ffs(todo) - 1;
      const int token = t0 + bit;
      const int row = first_row + taken + __popc(mask & lanes_below(bit));
      const char* x_row = static_cast<const char*>(args.in.x) + static_cast<size_t>(token) * r.x_bytes;
      if (lane == 0) device::bulk_prefetch_l2(x_row, r.x_bytes);
      const RecordFields fields =
          load_input_fields(r, args.in.x_scales, args.in.topk_idx, args.in.topk_weights, token, lane);
      warp_copy<false>(out.x + static_cast<size_t>(row) * r.x_bytes, x_row, r.x_bytes, lane);
      store_output_fields<false>(field_out, r, row, fields,
                                 args.in.x_scales + static_cast<size_t>(token) * r.num_scales, dst,
                                 args.num_experts / num_ranks, lane);
    }
    taken += __popc(mask);
  }
  // Every warp's stores are ordered before the leader's release by the barrier (the queue's publish does
  // the same).
  group.sync();
  if (group.leader()) {
    device::st_release_sys(
        &NormalBufferMap::direct(args.peers.peer_bases[dst])->rows_done[args.peers.rank][channel], calls + 1);
  }
}

}  // namespace epx::kernels
