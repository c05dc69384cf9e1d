#include <algorithm>

#include "buffer_map/internode_buffer_map.hpp"
#include "device/ptx.cuh"
#include "gpu/cuda_check.hpp"
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

// The last block to finish posts this rank's counts into every rank's row of the layout board: for rank d,
// the tokens it gets, then its experts' tokens, each a tagged word of the notify sequence the layout feeds.
// Called by every thread of every block once the block's counts are added.
// NOTES: every thread fences before the block counts itself done, so the last block, which sees every other
// block's count, reads their sums complete. Each posting thread's closing system fence pushes its words out
// of the GPU's caches: the kernels queued behind may otherwise keep them there (kernels/host_counts.cuh), and
// a peer's host must see them no later than the notify counts that follow them.
__device__ void post_to_board(const LayoutArgs& args) {
  __shared__ bool is_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(args.blocks_done, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  const int num_local_experts = args.num_experts / args.num_ranks;
  const int words = 1 + num_local_experts;
  for (int i = threadIdx.x; i < args.num_ranks * words; i += blockDim.x) {
    const int dest = i / words;
    const int word = i % words;
    const int value = word == 0 ? __ldcg(&args.num_tokens_per_rank[dest])
                                : __ldcg(&args.num_tokens_per_expert[dest * num_local_experts + word - 1]);
    uint64_t* slot = args.board + args.board_map.slot(dest, args.board_sequence, args.rank);
    device::st_relaxed_sys_u64(slot + word, pack_tagged(args.board_sequence, value));
  }
  __threadfence_system();
  if (threadIdx.x == 0) *args.blocks_done = 0;  // for the next launch (stream order)
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
  for (int i = threadIdx.x; i < num_counts; i += blockDim.x) {
    if (shared_counts[i] == 0) continue;
    if (i < args.num_ranks) {
      atomicAdd(&args.num_tokens_per_rank[i], shared_counts[i]);
    } else if (i < args.num_ranks + args.num_experts) {
      atomicAdd(&args.num_tokens_per_expert[i - args.num_ranks], shared_counts[i]);
    } else {
      atomicAdd(&args.num_tokens_per_rdma_rank[i - args.num_ranks - args.num_experts], shared_counts[i]);
    }
  }
  if (args.board != nullptr) post_to_board(args);
}

}  // namespace

void launch_layout(const LayoutArgs& args, cudaStream_t stream) {
  EPX_CUDA_CHECK(cudaMemsetAsync(args.num_tokens_per_rank, 0, sizeof(int) * args.num_ranks, stream));
  if (args.num_experts > 0) {
    EPX_CUDA_CHECK(cudaMemsetAsync(args.num_tokens_per_expert, 0, sizeof(int) * args.num_experts, stream));
  }
  const int num_nodes = layout_num_nodes(args);
  if (num_nodes > 0) {
    EPX_CUDA_CHECK(cudaMemsetAsync(args.num_tokens_per_rdma_rank, 0, sizeof(int) * num_nodes, stream));
  }
  // With no tokens a block still runs when the counts (zeros) go to the board.
  if (args.num_tokens == 0 && args.board == nullptr) return;
  const int blocks = std::max((args.num_tokens + kLayoutThreads - 1) / kLayoutThreads, 1);
  const size_t shared_bytes = sizeof(int) * (args.num_ranks + args.num_experts + num_nodes);
  launch(layout_kernel, {unsigned(blocks), kLayoutThreads, shared_bytes, Residency::kIndependent}, stream,
         args);
}

void preload_normal_layout_kernels() {
  preload_kernel(layout_kernel);
}

}  // namespace epx::kernels
