#include "reference/layout.hpp"

#include <cstddef>

#include "buffer_map/internode_buffer_map.hpp"
#include "epx/error.hpp"

namespace epx::reference {

void check_topk_idx(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts) {
  EPX_CHECK(num_tokens >= 0, "num_tokens", num_tokens, "must be >= 0");
  EPX_CHECK(num_topk >= 0, "num_topk", num_topk, "must be >= 0");
  const size_t num_ids = static_cast<size_t>(num_tokens) * num_topk;
  EPX_CHECK(num_ids == 0 || topk_idx != nullptr, "topk_idx", "null",
            "must be given when num_tokens * num_topk > 0");
  for (size_t i = 0; i < num_ids; ++i) {
    EPX_CHECK(topk_idx[i] >= -1, "topk_idx", topk_idx[i], "ids must be >= -1 (-1 means no expert)");
    EPX_CHECK(topk_idx[i] < num_experts, "topk_idx", topk_idx[i], "ids must be < num_experts");
  }
}

DispatchLayout get_dispatch_layout(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts,
                                   int num_ranks, int ranks_per_node) {
  EPX_CHECK(num_ranks >= 1, "num_ranks", num_ranks, "must be >= 1");
  EPX_CHECK(ranks_per_node >= 0, "ranks_per_node", ranks_per_node, "must be >= 0 (0: one node)");
  const NodeMap nodes{num_ranks, ranks_per_node == 0 ? num_ranks : ranks_per_node};
  validate_node_split(num_ranks, nodes.ranks_per_node);
  EPX_CHECK(num_experts >= 1, "num_experts", num_experts, "must be >= 1");
  EPX_CHECK(num_experts % num_ranks == 0, "num_experts", num_experts, "must be a multiple of num_ranks");
  check_topk_idx(topk_idx, num_tokens, num_topk, num_experts);

  const int experts_per_rank = num_experts / num_ranks;
  DispatchLayout layout;
  layout.num_tokens = num_tokens;
  layout.num_ranks = num_ranks;
  layout.num_experts = num_experts;
  layout.num_tokens_per_rank.assign(num_ranks, 0);
  layout.num_tokens_per_expert.assign(num_experts, 0);
  layout.is_token_in_rank.assign(static_cast<size_t>(num_tokens) * num_ranks, 0);
  if (nodes.spans_nodes()) layout.num_tokens_per_rdma_rank.assign(nodes.num_nodes(), 0);

  for (int t = 0; t < num_tokens; ++t) {
    const int64_t* ids = topk_idx + static_cast<size_t>(t) * num_topk;
    uint8_t* in_rank = layout.is_token_in_rank.data() + static_cast<size_t>(t) * num_ranks;
    for (int k = 0; k < num_topk; ++k) {
      const int64_t expert = ids[k];
      if (expert < 0) continue;
      bool repeated = false;
      for (int j = 0; j < k; ++j) repeated = repeated || ids[j] == expert;
      if (repeated) continue;
      ++layout.num_tokens_per_expert[expert];
      in_rank[expert / experts_per_rank] = 1;
    }
    for (int r = 0; r < num_ranks; ++r) layout.num_tokens_per_rank[r] += in_rank[r];
    for (int n = 0; n < static_cast<int>(layout.num_tokens_per_rdma_rank.size()); ++n) {
      bool in_node = false;
      for (int r = n * nodes.ranks_per_node; r < (n + 1) * nodes.ranks_per_node; ++r)
        in_node = in_node || in_rank[r];
      layout.num_tokens_per_rdma_rank[n] += in_node;
    }
  }
  return layout;
}

}  // namespace epx::reference
