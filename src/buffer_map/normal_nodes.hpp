#pragma once

#include "epx/config.hpp"

// The node layouts normal mode runs on, checked on the host before anything is allocated or launched (the
// Buffer's constructor, the size hints, dispatch_notify). Every rule names the argument, its value and the
// rule, and leaves nothing changed, so the next call works.
namespace epx {

// Nodes a normal-mode group may span: the internode kernels give every destination (source) node one warp
// group with its own named barrier, and barrier 0 is the block's, so 16 barriers leave 15 nodes.
constexpr int kMaxNormalNodes = 15;

// A Buffer of `num_ranks` ranks in nodes of `ranks_per_node` that serves normal mode (an NVLink buffer):
// one node of at most 8 ranks (the NVLink queues join every pair of ranks), or at most 15 nodes of at most 8
// ranks. `name` is the argument the node size came from ("ranks_per_node", "EPX_RANKS_PER_NODE"). Assumes
// the split itself passed validate_node_split.
void check_normal_node_layout(int num_ranks, int ranks_per_node, const char* name = "ranks_per_node");

// A normal-mode call with `config` on `num_nodes` nodes: every source node gets
// num_max_nvl_chunked_recv_tokens / nodes records of each NVLink forwarding queue, so at least one.
void check_normal_forward_queues(const Config& config, int num_nodes);

// A normal-mode dispatch on `num_nodes` nodes: the CPU-sync-free worst-case mode (num_worst_tokens > 0)
// needs one node, as in DeepEP (across nodes the receive counts come from the count exchange only).
void check_normal_dispatch_nodes(int num_nodes, int num_worst_tokens);

}  // namespace epx
