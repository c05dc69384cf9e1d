#include <algorithm>

#include "buffer_map/internode_buffer_map.hpp"
#include "device/ptx.cuh"
#include "kernels/launch.hpp"
#include "kernels/normal_kernels.hpp"
#include "kernels/preload.hpp"

namespace epx::kernels {

namespace {

constexpr int kLayoutThreads = 256;

// Nodes counted per token: num_ranks / ranks_per_node when the caller asked for num_tokens_per_rdma_rank.
__host__ __device__ int layout_num_nodes(const LayoutArgs& args) {
  return args.num_tokens_per_rdma_rank != nullptr ? args.num_ranks / args.ranks_per_node : 0;
}

// Where a block adds its counts (LayoutArgs::scratch): word 0 counts the finished blocks, the counts follow
// in the shared histogram's order (ranks, experts, nodes).
__device__ __forceinline__ unsigned* blocks_done(const LayoutArgs& args) {
  return reinterpret_cast<unsigned*>(args.scratch);
}
__device__ __forceinline__ int* scratch_counts(const LayoutArgs& args) {
  return args.scratch + 1;
}

// Count i of the histogram's order (ranks, experts, nodes) in the caller's outputs.
__device__ __forceinline__ int* output_count(const LayoutArgs& args, int i) {
  if (i < args.num_ranks) return &args.num_tokens_per_rank[i];
  i -= args.num_ranks;
  if (i < args.num_experts) return &args.num_tokens_per_expert[i];
  return &args.num_tokens_per_rdma_rank[i - args.num_experts];
}

// The last block to finish moves the counts from the scratch into the outputs (so nothing clears the outputs
// before the launch) and zeroes the scratch for the next launch; on one node it then posts this rank's counts
// into every rank's row of the layout board: for rank d, the tokens it gets, then its experts' tokens, each a
// tagged word of the notify sequence the layout feeds. Called by every thread of every block once the block's
// counts are added.
// NOTES: every thread fences before the block counts itself done, so the last block, which sees every other
// block's count, reads their sums complete. Each posting thread's closing system fence pushes its words out
// of the GPU's caches: the kernels queued behind may otherwise keep them there (kernels/host_counts.cuh), and
// a peer's host must see them no later than the notify counts that follow them.
__device__ void finish_layout(const LayoutArgs& args, int num_counts) {
  __shared__ bool is_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(blocks_done(args), 1u) == gridDim.x - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  int* counts = scratch_counts(args);
  for (int i = threadIdx.x; i < num_counts; i += blockDim.x) {
    *output_count(args, i) = __ldcg(&counts[i]);
    counts[i] = 0;
  }
  __syncthreads();  // the outputs written before the board's words are read from them
  if (args.board != nullptr) {
    const int num_local_experts = args.num_experts / args.num_ranks;
    const int words = 1 + num_local_experts;
    for (int i = threadIdx.x; i < args.num_ranks * words; i += blockDim.x) {
      const int dest = i / words;
      const int word = i % words;
      const int value = word == 0 ? args.num_tokens_per_rank[dest]
                                  : args.num_tokens_per_expert[dest * num_local_experts + word - 1];
      uint64_t* slot = args.board + args.board_map.slot(dest, args.board_sequence, args.rank);
      device::st_relaxed_sys_u64(slot + word, pack_tagged(args.board_sequence, value));
    }
    __threadfence_system();
  }
  if (threadIdx.x == 0) *blocks_done(args) = 0;  // for the next launch (stream order)
}

// One thread per token. Counts go through shared-memory histograms first so the global atomics are one per
// (block, rank/expert/node) instead of one per token. Counts are order-independent, so results are
// deterministic.
__global__ void __launch_bounds__(kLayoutThreads) layout_kernel(LayoutArgs args) {
  extern __shared__ int shared_counts[];  // [num_ranks + num_experts + num_nodes]
  const int num_nodes = layout_num_nodes(args);
  const int num_counts = args.num_ranks + args.num_experts + num_nodes;
  int* rank_counts = shared_counts;
  int* expert_counts = shared_counts + args.num_ranks;
  int* node_counts = expert_counts + args.num_experts;
  for (int i = threadIdx.x; i < num_counts; i += blockDim.x) shared_counts[i] = 0;
  __syncthreads();

  const int token_idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (token_idx < args.num_tokens) {
    const int experts_per_rank = args.num_experts / args.num_ranks;
    const int64_t* ids = args.topk_idx + static_cast<size_t>(token_idx) * args.num_topk;
    uint64_t rank_mask = 0;  // up to 64 ranks (the Buffer's limit)
    for (int k = 0; k < args.num_topk; ++k) {
      const int64_t expert = ids[k];
      if (expert == -1) continue;
      if (expert < -1 || expert >= args.num_experts) {
        atomicCAS(args.invalid_id_flag, 0, token_idx + 1);
        __threadfence_system();  // before the board's words, which tell the host the layout ran
        continue;
      }
      bool repeated = false;  // a token counts once per expert even if its top-k repeats it
      for (int j = 0; j < k; ++j) repeated |= ids[j] == expert;
      if (repeated) continue;
      atomicAdd(&expert_counts[expert], 1);
      rank_mask |= uint64_t{1} << (expert / experts_per_rank);
    }
    for (int r = 0; r < args.num_ranks; ++r) {
      const bool in_rank = (rank_mask >> r) & 1u;
      args.is_token_in_rank[static_cast<size_t>(token_idx) * args.num_ranks + r] = in_rank;
      if (in_rank) atomicAdd(&rank_counts[r], 1);
    }
    const NodeMap nodes{args.num_ranks, args.ranks_per_node};
    for (int n = 0; n < num_nodes; ++n) {
      if (nodes.local_mask(rank_mask, n) != 0) atomicAdd(&node_counts[n], 1);
    }
  }
  __syncthreads();
  int* counts = scratch_counts(args);
  for (int i = threadIdx.x; i < num_counts; i += blockDim.x) {
    if (shared_counts[i] != 0) atomicAdd(&counts[i], shared_counts[i]);
  }
  finish_layout(args, num_counts);
}

}  // namespace

void launch_layout(const LayoutArgs& args, cudaStream_t stream) {
  const int num_nodes = layout_num_nodes(args);
  // With no tokens a block still runs: it writes the counts (zeros) and posts them.
  const int blocks = std::max((args.num_tokens + kLayoutThreads - 1) / kLayoutThreads, 1);
  const size_t shared_bytes = sizeof(int) * (args.num_ranks + args.num_experts + num_nodes);
  launch(layout_kernel, {unsigned(blocks), kLayoutThreads, shared_bytes, Residency::kIndependent}, stream,
         args);
}

void preload_normal_layout_kernels() {
  preload_kernel(layout_kernel);
}

}  // namespace epx::kernels
