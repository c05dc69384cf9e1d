#pragma once

#include <cstdint>
#include <vector>

#include "reference/normal.hpp"

// Normal mode across nodes, reference: R simulated ranks in nodes of ranks_per_node consecutive ranks. A
// token crosses the network to a node once (to its source's rail peer there), which forwards it over NVLink
// to the ranks of that node that hold one of its experts; combine reduces inside each node first.
namespace epx::reference {

// One token of a source rank travelling to one node, however many of that node's ranks need it.
struct InternodeRoute {
  int token_idx;       // on the source rank
  uint32_t rank_mask;  // bit j: local rank j of the destination node receives the token
};

struct InternodeDispatchResult {
  // What every rank receives and the handle: identical to normal_dispatch's (same rows, same order: by source
  // rank, then source token index). The path changes where a token travels, not what arrives.
  NormalDispatchResult normal;
  int ranks_per_node = 0;
  // routes[s][n]: the tokens of source rank s for node n, in token order. For a node other than s's own
  // they are what crosses the network (one record each); for s's own node they travel over NVLink only.
  // routes[s][n].size() is get_dispatch_layout's num_tokens_per_rdma_rank[n] of rank s.
  std::vector<std::vector<std::vector<InternodeRoute>>> routes;
};

// Throws epx::Error (naming the argument) on inconsistent input, as normal_dispatch does, and unless
// ranks_per_node passes validate_node_split and num_ranks <= 64.
InternodeDispatchResult internode_dispatch(const NormalDispatchParams& params, int ranks_per_node,
                                           const std::vector<NormalDispatchRankInput>& inputs);

// For each original token t of rank s, in float32:
//   for each node n ascending that received the token:
//     partial = -0.0f; for each rank d of n ascending that received it: partial += float(x_d[row])
//     acc += float(round_to_nearest_even_bf16(partial))      (acc starts at -0.0f)
//   acc += float(bias0[t]); acc += float(bias1[t]); combined_x = round_to_nearest_even_bf16(acc)
// (-0.0f is the identity of float addition; a token with no source at all is +0.0.)
// Every node's partial is rounded once, the token's own node included: it is the BF16 row a node's forwarder
// returns (over the network for the other nodes). No weights are applied. combined_topk_weights likewise:
// +0.0f + each node's float partial (+0.0f + the weights of its ranks, ascending), in node order, unrounded.
// With nodes of one rank this is normal_combine exactly; with one node it differs from normal_combine only
// by the rounding of the partial before the biases.
std::vector<NormalCombineRankOutput> internode_combine(const NormalHandle& handle, int ranks_per_node,
                                                       const NormalCombineParams& params,
                                                       const std::vector<NormalCombineRankInput>& inputs);

}  // namespace epx::reference
