#pragma once

#include <cstdint>
#include <vector>

// CPU reference of EPX (the oracle every GPU test compares against): plain loops over R simulated ranks in
// one process. Host vectors, row-major; BF16 is carried as uint16_t bits; top-k ids are int64 with -1 = none.
namespace epx::reference {

// What get_dispatch_layout computes for one rank's tokens.
struct DispatchLayout {
  int num_tokens = 0;
  int num_ranks = 0;
  int num_experts = 0;
  // [R] tokens that have at least one expert on rank r (a token counts once per rank).
  std::vector<int> num_tokens_per_rank;
  // [E] tokens that chose expert e (a token listing e twice in its top-k still counts once).
  std::vector<int> num_tokens_per_expert;
  // [T, R] 1 when token t has at least one expert on rank r, else 0.
  std::vector<uint8_t> is_token_in_rank;
  // [N] tokens that have at least one expert on node n (a token counts once per node), when the ranks form
  // N > 1 nodes of ranks_per_node; empty within one node (DeepEP's num_tokens_per_rdma_rank).
  std::vector<int> num_tokens_per_rdma_rank;
};

// Routing facts of one rank's top-k ids [num_tokens, num_topk] (row-major, -1 = no expert).
// Experts live on ranks in contiguous blocks: expert e is on rank e / (num_experts / num_ranks).
// Throws epx::Error unless num_tokens >= 0, num_topk >= 0, num_ranks >= 1, num_experts >= 1,
// num_experts % num_ranks == 0 and every id is in [-1, num_experts). topk_idx may be null when T*K == 0.
// ranks_per_node: nodes of that many consecutive ranks (0: one node); it must pass validate_node_split.
DispatchLayout get_dispatch_layout(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts,
                                   int num_ranks, int ranks_per_node = 0);

// Just the id checks of get_dispatch_layout (ids in [-1, num_experts)).
void check_topk_idx(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts);

}  // namespace epx::reference
