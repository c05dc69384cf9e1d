#include <cub/block/block_scan.cuh>

#include "common/cuda_check.hpp"
#include "kernels/normal_kernels.hpp"
#include "kernels/nvl_barrier.cuh"
#include "kernels/preload.hpp"

namespace epx::kernels {

namespace {

constexpr int kCopyThreads = 1024;  // 32 warps per SM: more rows in flight per SM of the budget
constexpr int kCopyWarps = kCopyThreads / 32;
constexpr int kNotifyThreads = 1024;

__device__ __forceinline__ int to_local_expert(int global_expert, int rank, int experts_per_rank) {
  const int local = global_expert - rank * experts_per_rank;
  return (global_expert >= 0 && local >= 0 && local < experts_per_rank) ? local : -1;
}

// Called by every thread of every stage block at its end: the last block tells every rank that this rank's
// stage is complete (monotonic count, like the barrier signals).
// NOTES: each thread fences its own staged stores at system scope before its block's arrival is counted; the
// last arriver fences again and releases the signal, so a puller that acquired it sees every staged row.
__device__ __forceinline__ void publish_staged(const PeerContext& peers, int num_blocks) {
  __shared__ bool is_last;
  auto* local = NormalLayout::control(peers.local_base);
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(&local->stage_arrivals, 1) == num_blocks - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence_system();
  const int count = local->stage_count + 1;
  if (threadIdx.x < peers.num_ranks) {
    device::st_release_sys(&NormalLayout::control(peers.peer_bases[threadIdx.x])->staged_signal[peers.rank],
                           count);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    local->stage_arrivals = 0;
    local->stage_count = count;
  }
}

// ---- Stage: this rank's tokens go into its own buffer (half `parity`), where the destinations will pull
// them from; `num_blocks` blocks share the rows. Publishes its completion; the pull waits for that per
// source. ----
__device__ void stage_rows(const StageArgs& args, int parity, int block, int num_blocks) {
  const NormalLayout& layout = args.layout;
  const int lane = threadIdx.x % 32;
  const int num_warps = num_blocks * kCopyWarps;
  const int num_scales = layout.shape.num_scales;
  const int num_topk = layout.shape.num_topk;
  for (int t = block * kCopyWarps + threadIdx.x / 32; t < args.num_tokens; t += num_warps) {
    const size_t row_bytes = layout.shape.x_row_bytes;
    warp_copy<false>(layout.stage_x_row(args.peers.local_base, parity, t),
                     static_cast<const char*>(args.x) + t * row_bytes, row_bytes, lane);
    float* scales = layout.stage_scales_row(args.peers.local_base, parity, t);
    for (int g = lane; g < num_scales; g += 32)
      scales[g] = args.x_scales[static_cast<size_t>(t) * num_scales + g];
    if (lane < num_topk) {
      const size_t k = static_cast<size_t>(t) * num_topk + lane;
      layout.stage_topk_idx_row(args.peers.local_base, parity, t)[lane] = static_cast<int>(args.topk_idx[k]);
      layout.stage_topk_weights_row(args.peers.local_base, parity, t)[lane] =
          args.topk_weights != nullptr ? args.topk_weights[k] : 0.0f;
    }
  }
  publish_staged(args.peers, num_blocks);
}

// ---- Notify: publish send lists and counts, meet, then learn what arrives from whom. One block; the
// barrier holds the operation counter until `num_parity_readers` stage blocks have read it. ----
__device__ void notify_counts(const NotifyArgs& args, int num_parity_readers) {
  using BlockScan = cub::BlockScan<int, kNotifyThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ int running_count;
  __shared__ int recv_counts[kMaxNvlRanks];

  const NormalLayout& layout = args.layout;
  const int num_ranks = args.peers.num_ranks;
  const int rank = args.peers.rank;
  const int num_experts = layout.shape.num_experts;
  const int parity = parity_before_barrier(args.peers);
  void* local = args.peers.local_base;

  // Send lists: for each destination, its tokens in ascending order (a block-wide scan per chunk).
  for (int dst = 0; dst < num_ranks; ++dst) {
    int* list = layout.send_list(local, parity, dst);
    if (threadIdx.x == 0) running_count = 0;
    __syncthreads();
    for (int base = 0; base < args.num_tokens; base += kNotifyThreads) {
      const int t = base + threadIdx.x;
      const size_t cell = static_cast<size_t>(t) * num_ranks + dst;
      const int flag = t < args.num_tokens ? (args.is_token_in_rank[cell] != 0) : 0;
      int position = 0, chunk_total = 0;
      BlockScan(scan_storage).ExclusiveSum(flag, position, chunk_total);
      position += running_count;
      if (t < args.num_tokens) {
        if (flag) list[position] = t;
        args.handle.send_pos[cell] = flag ? position : -1;
        if (args.handle.is_token_in_rank != args.is_token_in_rank) args.handle.is_token_in_rank[cell] = flag;
      }
      __syncthreads();
      if (threadIdx.x == 0) running_count += chunk_total;
      __syncthreads();
    }
    if (threadIdx.x == 0) layout.send_counts(local, parity)[dst] = running_count;
  }
  int* expert_counts = layout.expert_counts(local, parity);
  for (int e = threadIdx.x; e < num_experts; e += kNotifyThreads) {
    expert_counts[e] = args.num_tokens_per_expert != nullptr ? args.num_tokens_per_expert[e] : 0;
  }

  nvl_barrier_block(args.peers, num_parity_readers);

  if (threadIdx.x < num_ranks) {
    const NormalLayout& l = layout;
    recv_counts[threadIdx.x] =
        device::ld_relaxed_sys(&l.send_counts(args.peers.peer_bases[threadIdx.x], parity)[rank]);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int offset = 0;
    for (int src = 0; src < num_ranks; ++src) {
      args.handle.recv_offsets[src] = offset;
      offset += recv_counts[src];
    }
    args.handle.recv_offsets[num_ranks] = offset;
    args.host_counts[0] = offset;
    if (args.num_worst_tokens > 0 && offset > args.num_worst_tokens) {
      const device::WaitContext ctx{args.peers.timeout_record, rank, args.peers.timeout_ns};
      device::report_and_trap(ctx, -1, WaitPhase::kCapacity, args.num_worst_tokens, offset, 0);
    }
  }
  const int experts_per_rank = num_experts / num_ranks;
  for (int le = threadIdx.x; le < experts_per_rank; le += kNotifyThreads) {
    int count = 0;
    for (int src = 0; src < num_ranks; ++src) {
      count += device::ld_relaxed_sys(
          &layout.expert_counts(args.peers.peer_bases[src], parity)[rank * experts_per_rank + le]);
    }
    const int aligned = (count + args.expert_alignment - 1) / args.expert_alignment * args.expert_alignment;
    args.handle.num_recv_tokens_per_expert[le] = aligned;
    args.host_counts[1 + le] = aligned;
  }
  // The host spins on the ready word, not on the launch: it reads the counts while the stage blocks still
  // run.
  if (args.host_ready != nullptr) {
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) device::st_release_sys(args.host_ready, args.ready_value);
  }
}

// Notify (the last block) and the stage (the others) in one launch, so the count exchange and the host's
// wait for it overlap the stage copy.
// NOTES: the stage writes the half of the operation about to start (op_count before notify's barrier), as a
// stage launched before notify would; each stage block reads op_count and acknowledges, and the barrier does
// not advance op_count before every acknowledgement arrived.
__global__ void __launch_bounds__(kNotifyThreads, 1) notify_stage_kernel(NotifyStageArgs args) {
  const int num_stage_blocks = static_cast<int>(gridDim.x) - 1;
  if (blockIdx.x == gridDim.x - 1) {
    notify_counts(args.notify, num_stage_blocks);
    return;
  }
  __shared__ int parity;
  if (threadIdx.x == 0) {
    auto* control = NormalLayout::control(args.stage.peers.local_base);
    parity = *reinterpret_cast<volatile int*>(&control->op_count) & 1;
    __threadfence();  // the read completes before the acknowledgement can be seen
    atomicAdd(&control->parity_acks, 1);
  }
  __syncthreads();
  stage_rows(args.stage, parity, blockIdx.x, num_stage_blocks);
}

// ---- Pull: each warp fetches whole rows from the source rank's staging area into the outputs. ----
__global__ void __launch_bounds__(kCopyThreads) pull_kernel(PullArgs args) {
  __shared__ int offsets[kMaxNvlRanks + 1];
  const NormalLayout& layout = args.layout;
  const int num_ranks = args.peers.num_ranks;
  const int rank = args.peers.rank;
  const int parity = parity_after_barrier(args.peers);
  if (threadIdx.x <= num_ranks) offsets[threadIdx.x] = args.handle.recv_offsets[threadIdx.x];
  // Every source staged this operation's rows: its stage count reached this rank's (every rank stages once
  // per dispatch, and a source can not stage the next one before this rank's next notify).
  if (threadIdx.x < num_ranks) {
    const auto* control = NormalLayout::control(args.peers.local_base);
    const device::WaitContext ctx{args.peers.timeout_record, rank, args.peers.timeout_ns};
    device::wait_at_least(&control->staged_signal[threadIdx.x], control->stage_count, ctx, threadIdx.x,
                          WaitPhase::kDispatchReceive);
  }
  __syncthreads();

  const int lane = threadIdx.x % 32;
  const int num_rows = offsets[num_ranks];
  const int num_scales = layout.shape.num_scales;
  const int num_topk = layout.shape.num_topk;
  const int experts_per_rank = layout.shape.num_experts / num_ranks;
  const size_t row_bytes = layout.shape.x_row_bytes;
  const int num_warps = gridDim.x * kCopyWarps;
  const int first_warp = blockIdx.x * kCopyWarps + threadIdx.x / 32;
  // Padding rows of the worst-case layout.
  for (int row = num_rows + first_warp; row < args.num_out_rows; row += num_warps) {
    if (lane == 0) args.handle.recv_src_idx[row] = -1;
    if (args.recv_topk_idx != nullptr && lane < num_topk) {
      args.recv_topk_idx[static_cast<size_t>(row) * num_topk + lane] = -1;
      args.recv_topk_weights[static_cast<size_t>(row) * num_topk + lane] = 0.0f;
    }
  }
  int max_rows_per_src = 0;
  for (int src = 0; src < num_ranks; ++src)
    max_rows_per_src = max(max_rows_per_src, offsets[src + 1] - offsets[src]);
  for (int j = first_warp; j < max_rows_per_src * num_ranks; j += num_warps) {
    int src = 0;
    const int row = interleaved_row(j, offsets, num_ranks, rank, src);
    if (row < 0) continue;
    void* peer = args.peers.peer_bases[src];
    const int token_idx = layout.send_list(peer, parity, rank)[row - offsets[src]];
    warp_copy<true>(static_cast<char*>(args.recv_x) + row * row_bytes,
                    layout.stage_x_row(peer, parity, token_idx), row_bytes, lane);
    if (num_scales > 0) {
      const float* scales = layout.stage_scales_row(peer, parity, token_idx);
      for (int g = lane; g < num_scales; g += 32)
        args.recv_x_scales[static_cast<size_t>(row) * num_scales + g] = scales[g];
    }
    if (args.recv_topk_idx != nullptr && lane < num_topk) {
      const int local_expert =
          to_local_expert(layout.stage_topk_idx_row(peer, parity, token_idx)[lane], rank, experts_per_rank);
      const float weight = layout.stage_topk_weights_row(peer, parity, token_idx)[lane];
      args.recv_topk_idx[static_cast<size_t>(row) * num_topk + lane] = local_expert;
      args.recv_topk_weights[static_cast<size_t>(row) * num_topk + lane] = local_expert >= 0 ? weight : 0.0f;
    }
    if (lane == 0) args.handle.recv_src_idx[row] = token_idx;
  }
}

}  // namespace

void launch_dispatch_notify_stage(const NotifyStageArgs& args, cudaStream_t stream) {
  notify_stage_kernel<<<args.stage.num_sms + 1, kNotifyThreads, 0, stream>>>(args);
  EPX_CUDA_CHECK_LAUNCH();
}

void launch_dispatch_pull(const PullArgs& args, cudaStream_t stream) {
  pull_kernel<<<args.num_sms, kCopyThreads, 0, stream>>>(args);
  EPX_CUDA_CHECK_LAUNCH();
}

void preload_normal_dispatch_kernels() {
  preload_kernel(notify_stage_kernel);
  preload_kernel(pull_kernel);
}

}  // namespace epx::kernels
