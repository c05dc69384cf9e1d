#include <cuda_bf16.h>

#include "common/cuda_check.hpp"
#include "kernels/normal_kernels.hpp"
#include "kernels/nvl_barrier.cuh"

namespace epx::kernels {

namespace {

constexpr int kCopyThreads = 512;
constexpr int kCopyWarps = kCopyThreads / 32;

// ---- Push: every received row goes back to its source rank, into the slot it was sent from. ----
__global__ void __launch_bounds__(kCopyThreads) push_kernel(PushArgs args) {
  __shared__ int offsets[kMaxNvlRanks + 1];
  const NormalLayout& layout = args.layout;
  const int num_ranks = args.peers.num_ranks;
  const int parity = parity_before_barrier(args.peers);
  if (threadIdx.x <= num_ranks) offsets[threadIdx.x] = args.handle.recv_offsets[threadIdx.x];
  __syncthreads();
  const int lane = threadIdx.x % 32;
  const int num_rows = offsets[num_ranks];
  const int num_topk = layout.shape.num_topk;
  const size_t row_bytes = layout.combine_row_bytes();
  const int num_warps = gridDim.x * kCopyWarps;
  for (int row = blockIdx.x * kCopyWarps + threadIdx.x / 32; row < num_rows; row += num_warps) {
    int src = 0;
    while (row >= offsets[src + 1]) ++src;
    const int slot = row - offsets[src];
    void* peer = args.peers.peer_bases[src];
    warp_copy<false>(layout.combine_x_row(peer, parity, args.peers.rank, slot),
                     static_cast<const char*>(args.x) + row * row_bytes, row_bytes, lane);
    if (args.topk_weights != nullptr && lane < num_topk) {
      layout.combine_weights_row(peer, parity, args.peers.rank, slot)[lane] =
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
__global__ void __launch_bounds__(kCopyThreads) reduce_kernel(ReduceArgs args) {
  const NormalLayout& layout = args.layout;
  const int num_ranks = args.peers.num_ranks;
  const int parity = parity_after_barrier(args.peers);
  const int lane = threadIdx.x % 32;
  const int num_topk = layout.shape.num_topk;
  const int num_chunks = layout.shape.hidden / 8;
  const int num_warps = gridDim.x * kCopyWarps;
  void* local = args.peers.local_base;
  for (int t = blockIdx.x * kCopyWarps + threadIdx.x / 32; t < args.num_tokens; t += num_warps) {
    int slots[kMaxNvlRanks];
#pragma unroll
    for (int r = 0; r < kMaxNvlRanks; ++r) {
      slots[r] = r < num_ranks ? args.handle.send_pos[static_cast<size_t>(t) * num_ranks + r] : -1;
    }
    for (int c = lane; c < num_chunks; c += 32) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
      for (int r = 0; r < kMaxNvlRanks; ++r) {
        if (slots[r] < 0) continue;
        const auto* row = reinterpret_cast<const int4*>(layout.combine_x_row(local, parity, r, slots[r]));
        add_bf16x8(acc, device::ld_v4(row + c));
      }
      const size_t offset = static_cast<size_t>(t) * num_chunks + c;
      if (args.bias0 != nullptr) add_bf16x8(acc, static_cast<const int4*>(args.bias0)[offset]);
      if (args.bias1 != nullptr) add_bf16x8(acc, static_cast<const int4*>(args.bias1)[offset]);
      int4 out;
      auto* pairs = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
      for (int i = 0; i < 4; ++i) pairs[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
      static_cast<int4*>(args.combined_x)[offset] = out;
    }
    if (args.combined_topk_weights != nullptr && lane < num_topk) {
      float sum = 0.0f;
#pragma unroll
      for (int r = 0; r < kMaxNvlRanks; ++r) {
        if (slots[r] >= 0) sum += layout.combine_weights_row(local, parity, r, slots[r])[lane];
      }
      args.combined_topk_weights[static_cast<size_t>(t) * num_topk + lane] = sum;
    }
  }
}

}  // namespace

void launch_combine_push(const PushArgs& args, cudaStream_t stream) {
  push_kernel<<<args.num_sms, kCopyThreads, 0, stream>>>(args);
  EPX_CUDA_CHECK_LAUNCH();
}

void launch_barrier(const PeerContext& peers, cudaStream_t stream) {
  barrier_kernel<<<1, 32, 0, stream>>>(peers);
  EPX_CUDA_CHECK_LAUNCH();
}

void launch_combine_reduce(const ReduceArgs& args, cudaStream_t stream) {
  if (args.num_tokens == 0) return;
  reduce_kernel<<<args.num_sms, kCopyThreads, 0, stream>>>(args);
  EPX_CUDA_CHECK_LAUNCH();
}

}  // namespace epx::kernels
