#include "reference/internode.hpp"

#include <cstddef>

#include "buffer_map/internode_buffer_map.hpp"
#include "epx/error.hpp"
#include "reference/combine_by_groups.hpp"

namespace epx::reference {

namespace {

void check_nodes(int num_ranks, int ranks_per_node) {
  EPX_CHECK(num_ranks <= kMaxInternodeRanks, "num_ranks", num_ranks, "must be <= 64");
  validate_node_split(num_ranks, ranks_per_node);
}

}  // namespace

InternodeDispatchResult internode_dispatch(const NormalDispatchParams& params, int ranks_per_node,
                                           const std::vector<NormalDispatchRankInput>& inputs) {
  check_nodes(params.num_ranks, ranks_per_node);
  InternodeDispatchResult result;
  result.normal = normal_dispatch(params, inputs);
  result.ranks_per_node = ranks_per_node;

  const NormalHandle& handle = result.normal.handle;
  const NodeMap nodes{params.num_ranks, ranks_per_node};
  result.routes.assign(params.num_ranks, std::vector<std::vector<InternodeRoute>>(nodes.num_nodes()));
  for (int s = 0; s < params.num_ranks; ++s) {
    for (int t = 0; t < handle.num_tokens[s]; ++t) {
      uint64_t rank_mask = 0;  // the ranks that received token t of s
      for (int d = 0; d < params.num_ranks; ++d) {
        if (handle.recv_row[s][static_cast<size_t>(t) * params.num_ranks + d] >= 0)
          rank_mask |= uint64_t{1} << d;
      }
      for (int n = 0; n < nodes.num_nodes(); ++n) {
        const uint32_t local = nodes.local_mask(rank_mask, n);
        if (local != 0) result.routes[s][n].push_back({t, local});
      }
    }
  }
  return result;
}

std::vector<NormalCombineRankOutput> internode_combine(const NormalHandle& handle, int ranks_per_node,
                                                       const NormalCombineParams& params,
                                                       const std::vector<NormalCombineRankInput>& inputs) {
  check_nodes(handle.num_ranks, ranks_per_node);
  return detail::combine_by_groups(handle, params, inputs, ranks_per_node, true);
}

}  // namespace epx::reference
