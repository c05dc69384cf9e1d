#include "buffer_map/internode_buffer_map.hpp"

#include <algorithm>

#include "buffer_map/buffer_map_checks.hpp"
#include "buffer_map/normal_nodes.hpp"
#include "epx/error.hpp"

namespace epx {

void validate_node_split(int num_ranks, int ranks_per_node, const char* name) {
  EPX_CHECK(num_ranks >= 1, "num_ranks", num_ranks, "must be >= 1");
  EPX_CHECK(ranks_per_node >= 1, name, ranks_per_node, "must be >= 1");
  EPX_CHECK(
      num_ranks % ranks_per_node == 0, name, ranks_per_node,
      detail::concat("must divide num_ranks (", num_ranks, "): nodes are equal blocks of consecutive ranks")
          .c_str());
  EPX_CHECK(ranks_per_node == num_ranks || ranks_per_node <= kMaxNvlRanks, name, ranks_per_node,
            detail::concat("must be <= 8 when the group spans nodes (", num_ranks,
                           " ranks): a node is one NVLink domain")
                .c_str());
}

void check_internode_map_fits(const InternodeBufferMap& map, size_t buffer_bytes) {
  detail::check_queues_fit(map.total_bytes(), buffer_bytes, "num_rdma_bytes",
                           detail::concat(map.num_nodes, " nodes"), map.num_channels, map.queue_tokens,
                           map.record_bytes, "Config::get_rdma_buffer_size_hint");
}

void check_forward_map_fits(const ForwardBufferMap& map, size_t buffer_bytes) {
  EPX_CHECK(map.queue_tokens >= 1, "num_max_nvl_chunked_recv_tokens", map.queue_tokens * map.num_nodes,
            detail::concat("must be >= the number of nodes (", map.num_nodes,
                           ") across nodes: every source node gets num_max_nvl_chunked_recv_tokens / nodes "
                           "records of each NVLink queue")
                .c_str());
  detail::check_queues_fit(map.total_bytes(), buffer_bytes, "num_nvl_bytes",
                           detail::concat(map.num_nodes, " nodes of ", map.ranks_per_node, " ranks"),
                           map.num_channels, map.queue_tokens, map.record_bytes,
                           "Config::get_nvl_buffer_size_hint");
}

size_t forward_nvl_buffer_size_hint(size_t hidden_bytes, int num_ranks, const Config& config) {
  size_t most = 0;
  for (int ranks_per_node = 1; ranks_per_node <= kMaxNvlRanks && ranks_per_node < num_ranks;
       ++ranks_per_node) {
    const int num_nodes = num_ranks / ranks_per_node;
    if (num_ranks % ranks_per_node != 0 || num_nodes > kMaxNormalNodes) continue;
    const ForwardBufferMap map =
        ForwardBufferMap::of(ranks_per_node, num_nodes, config, InternodeRecord::largest(hidden_bytes));
    most = std::max(most, align_up(map.total_bytes(), kNormalAlign));
  }
  return most;
}

size_t internode_rdma_buffer_size_hint(size_t hidden_bytes, int num_ranks, int ranks_per_node,
                                       const Config& config) {
  detail::check_hidden_bytes(hidden_bytes);
  EPX_CHECK(num_ranks <= kMaxInternodeRanks, "num_ranks", num_ranks, "must be <= 64");
  validate_node_split(num_ranks, ranks_per_node);
  validate_config(config);
  const NodeMap nodes{num_ranks, ranks_per_node};
  if (!nodes.spans_nodes()) return 0;
  check_normal_node_layout(num_ranks, ranks_per_node);
  const InternodeBufferMap map =
      InternodeBufferMap::of(nodes.num_nodes(), config, InternodeRecord::largest(hidden_bytes));
  return align_up(map.total_bytes(), kNormalAlign);
}

size_t Config::get_rdma_buffer_size_hint(size_t hidden_bytes, int num_ranks, int ranks_per_node) const {
  EPX_CHECK(num_ranks >= 1, "num_ranks", num_ranks, "must be >= 1");
  EPX_CHECK(ranks_per_node >= 0, "ranks_per_node", ranks_per_node,
            "must be >= 0 (0: one node up to 8 ranks, nodes of 8 above)");
  if (ranks_per_node == 0) {
    EPX_CHECK(num_ranks <= kMaxNvlRanks || num_ranks % kMaxNvlRanks == 0, "num_ranks", num_ranks,
              "must be a multiple of 8 above 8 ranks (nodes of 8; pass ranks_per_node for other node sizes)");
    ranks_per_node = num_ranks <= kMaxNvlRanks ? num_ranks : kMaxNvlRanks;
  }
  return internode_rdma_buffer_size_hint(hidden_bytes, num_ranks, ranks_per_node, *this);
}

}  // namespace epx
