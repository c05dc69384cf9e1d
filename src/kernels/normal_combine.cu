#include <cuda_bf16.h>

#include "common/cuda_check.hpp"
#include "kernels/normal_kernels.hpp"
#include "kernels/nvl_barrier.cuh"
#include "kernels/preload.hpp"

namespace epx::kernels {

namespace {

constexpr int kCopyThreads = 1024;  // 32 warps per SM: more rows in flight per SM of the budget
constexpr int kCopyWarps = kCopyThreads / 32;
// The reduce keeps 4 chunks x 8 floats of accumulators per lane: 512 threads leave it 128 registers, no
// spills.
constexpr int kReduceThreads = 512;
constexpr int kReduceWarps = kReduceThreads / 32;

// ---- Stage: the rows this rank returns to each peer go into its own buffer, where that peer's reduce reads
// them after the barrier (a local copy, then one remote read fused into the reduce, instead of a remote write
// and a local re-read). Rows this rank received from itself stay where they are: the reduce reads them from
// `x`. ----
__global__ void __launch_bounds__(kCopyThreads) stage_kernel(CombineStageArgs args) {
  __shared__ int offsets[kMaxNvlRanks + 1];
  const NormalLayout& layout = args.layout;
  const int num_ranks = args.peers.num_ranks;
  const int rank = args.peers.rank;
  const int parity = parity_before_barrier(args.peers);
  if (threadIdx.x <= num_ranks) offsets[threadIdx.x] = args.handle.recv_offsets[threadIdx.x];
  __syncthreads();
  const int lane = threadIdx.x % 32;
  const int num_topk = layout.shape.num_topk;
  const size_t row_bytes = layout.combine_row_bytes();
  const int num_warps = gridDim.x * kCopyWarps;
  const int num_own = offsets[rank + 1] - offsets[rank];
  const int num_staged = offsets[num_ranks] - num_own;
  for (int i = blockIdx.x * kCopyWarps + threadIdx.x / 32; i < num_staged; i += num_warps) {
    const int row = i < offsets[rank] ? i : i + num_own;  // rows of every source but this rank
    int src = 0;
    while (row >= offsets[src + 1]) ++src;
    const int slot = row - offsets[src];
    warp_copy<false>(layout.combine_x_row(args.peers.local_base, parity, src, slot),
                     static_cast<const char*>(args.x) + row * row_bytes, row_bytes, lane);
    if (args.topk_weights != nullptr && lane < num_topk) {
      layout.combine_weights_row(args.peers.local_base, parity, src, slot)[lane] =
          args.topk_weights[static_cast<size_t>(row) * num_topk + lane];
    }
  }
}

__global__ void barrier_kernel(PeerContext peers) {
  nvl_barrier_block(peers);
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

// ---- Reduce: each token sums its returned copies in ascending rank order, then the biases. ----
// Peers' copies are read from their buffers (staged there for this rank), its own copy straight from the
// combine input.
__global__ void __launch_bounds__(kReduceThreads) reduce_kernel(ReduceArgs args) {
  const NormalLayout& layout = args.layout;
  const int num_ranks = args.peers.num_ranks;
  const int rank = args.peers.rank;
  const int parity = parity_after_barrier(args.peers);
  const int lane = threadIdx.x % 32;
  const int num_topk = layout.shape.num_topk;
  const int num_chunks = layout.shape.hidden / 8;
  const int num_warps = gridDim.x * kReduceWarps;
  // Row of `x` holding own slot 0: rows received from this rank follow in slot order.
  const int own_offset = args.handle.recv_offsets[rank];
  for (int t = blockIdx.x * kReduceWarps + threadIdx.x / 32; t < args.num_tokens; t += num_warps) {
    // Slot of the token's copy returned by each rank (-1: not sent there); registers, so indexed by
    // constants.
    int slots[kMaxNvlRanks];
#pragma unroll
    for (int r = 0; r < kMaxNvlRanks; ++r) {
      slots[r] = r < num_ranks ? args.handle.send_pos[static_cast<size_t>(t) * num_ranks + r] : -1;
    }
    constexpr int kUnroll = 4;
    for (int c0 = lane; c0 < num_chunks; c0 += 32 * kUnroll) {
      float acc[kUnroll][8] = {};
      // Copies are added in ascending rank order, the summation order the reference defines. Two ranks'
      // chunks are loaded before either is added, so a remote read and a local one overlap.
#pragma unroll
      for (int r0 = 0; r0 < kMaxNvlRanks; r0 += 2) {
        int4 v[2][kUnroll];
#pragma unroll
        for (int p = 0; p < 2; ++p) {
          const int r = r0 + p;
          if (slots[r] < 0) continue;
          const auto* row = reinterpret_cast<const int4*>(
              r == rank ? static_cast<const char*>(args.x) +
                              static_cast<size_t>(own_offset + slots[r]) * layout.combine_row_bytes()
                        : layout.combine_x_row(args.peers.peer_bases[r], parity, rank, slots[r]));
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            if (c0 + u * 32 < num_chunks) v[p][u] = device::ld_v4(row + c0 + u * 32);
          }
        }
#pragma unroll
        for (int p = 0; p < 2; ++p) {
          if (slots[r0 + p] < 0) continue;
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            if (c0 + u * 32 < num_chunks) add_bf16x8(acc[u], v[p][u]);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int c = c0 + u * 32;
        if (c >= num_chunks) continue;
        const size_t offset = static_cast<size_t>(t) * num_chunks + c;
        if (args.bias0 != nullptr) add_bf16x8(acc[u], static_cast<const int4*>(args.bias0)[offset]);
        if (args.bias1 != nullptr) add_bf16x8(acc[u], static_cast<const int4*>(args.bias1)[offset]);
        int4 out;
        auto* pairs = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
        for (int i = 0; i < 4; ++i) pairs[i] = __floats2bfloat162_rn(acc[u][2 * i], acc[u][2 * i + 1]);
        static_cast<int4*>(args.combined_x)[offset] = out;
      }
    }
    if (args.combined_topk_weights != nullptr && lane < num_topk) {
      float sum = 0.0f;
#pragma unroll
      for (int r = 0; r < kMaxNvlRanks; ++r) {
        if (slots[r] < 0) continue;
        sum += r == rank ? args.topk_weights[static_cast<size_t>(own_offset + slots[r]) * num_topk + lane]
                         : layout.combine_weights_row(args.peers.peer_bases[r], parity, rank, slots[r])[lane];
      }
      args.combined_topk_weights[static_cast<size_t>(t) * num_topk + lane] = sum;
    }
  }
}

}  // namespace

void launch_combine_stage(const CombineStageArgs& args, cudaStream_t stream) {
  stage_kernel<<<args.num_sms, kCopyThreads, 0, stream>>>(args);
  EPX_CUDA_CHECK_LAUNCH();
}

void launch_barrier(const PeerContext& peers, cudaStream_t stream) {
  barrier_kernel<<<1, 32, 0, stream>>>(peers);
  EPX_CUDA_CHECK_LAUNCH();
}

void launch_combine_reduce(const ReduceArgs& args, cudaStream_t stream) {
  if (args.num_tokens == 0) return;
  reduce_kernel<<<args.num_sms, kReduceThreads, 0, stream>>>(args);
  EPX_CUDA_CHECK_LAUNCH();
}

void preload_normal_combine_kernels() {
  preload_kernel(stage_kernel);
  preload_kernel(barrier_kernel);
  preload_kernel(reduce_kernel);
}

}  // namespace epx::kernels
