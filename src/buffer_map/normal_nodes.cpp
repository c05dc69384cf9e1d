#include "buffer_map/normal_nodes.hpp"

#include "buffer_map/normal_buffer_map.hpp"
#include "epx/error.hpp"

namespace epx {

void check_normal_node_layout(int num_ranks, int ranks_per_node, const char* name) {
  const int num_nodes = num_ranks / ranks_per_node;
  if (num_nodes == 1) {
    EPX_CHECK(num_ranks <= kMaxNvlRanks, "num_ranks", num_ranks,
              "must be <= 8 for the normal-mode NVLink buffer on one node (nodes of up to 8 ranks beyond)");
    return;
  }
  EPX_CHECK(ranks_per_node <= kMaxNvlRanks, name, ranks_per_node,
            detail::concat("must be <= 8 for normal mode across nodes (", num_ranks,
                           " ranks): a node is one NVLink domain")
                .c_str());
  EPX_CHECK(num_nodes <= kMaxNormalNodes, name, ranks_per_node,
            detail::concat("must give at most ", kMaxNormalNodes, " nodes for normal mode across nodes (",
                           num_ranks, " ranks make ", num_nodes, ")")
                .c_str());
}

void check_normal_forward_queues(const Config& config, int num_nodes) {
  EPX_CHECK(
      num_nodes == 1 || config.num_max_nvl_chunked_recv_tokens >= num_nodes,
      "num_max_nvl_chunked_recv_tokens", config.num_max_nvl_chunked_recv_tokens,
      detail::concat("must be >= the number of nodes (", num_nodes,
                     ") across nodes: every source node gets num_max_nvl_chunked_recv_tokens / nodes records "
                     "of each NVLink queue")
          .c_str());
}

void check_normal_dispatch_nodes(int num_nodes, int num_worst_tokens) {
  EPX_CHECK(num_worst_tokens == 0 || num_nodes == 1, "num_worst_tokens", num_worst_tokens,
            "must be 0 across nodes (the CPU-sync-free mode needs one node, as in DeepEP)");
}

}  // namespace epx
