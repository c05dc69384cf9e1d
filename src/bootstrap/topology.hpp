#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "epx/bootstrap.hpp"

// Which ranks form a node: ranks on one host that reach each other's GPUs directly (NVLink / P2P), found at
// Buffer construction by exchanging host identities and peer-access checks through the bootstrap.
namespace epx {

// Where a rank runs: the host (its name plus the kernel's boot id, which tells apart hosts that share a name,
// e.g. "localhost" in containers) and its GPU. Fixed size: it travels through Bootstrap::all_gather.
struct RankLocation {
  char hostname[64];
  char boot_id[40];
  char device_id[32];  // the GPU's PCI bus id ("" where unknown: CPU tests)

  bool same_host(const RankLocation& other) const;
  std::string host_name() const;  // for messages
};

// This process's host (hostname, /proc/sys/kernel/random/boot_id) with `device_id` as its GPU.
RankLocation local_rank_location(const std::string& device_id);

// reachable[a * R + b] != 0: rank a reaches rank b's GPU directly. Only pairs on one host are consulted.
// Ranks form nodes greedily in rank order: a rank joins the first node on its host whose members it and
// they all reach, else starts a new one. Returns the node size; throws epx::Error (naming the ranks and
// hosts) unless the nodes are equal blocks of consecutive ranks.
int detect_ranks_per_node(const std::vector<RankLocation>& locations, const std::vector<uint8_t>& reachable);

// What a rank brings to agree_ranks_per_node.
struct TopologyRequest {
  int ranks_per_node = 0;                 // the override (> 0), or 0: detect
  std::string source = "ranks_per_node";  // what set the override, for messages ("EPX_RANKS_PER_NODE")
  RankLocation location{};                // this rank's
  // Whether this rank reaches `peer`'s GPU directly (only asked for peers on this rank's host).
  std::function<bool(const RankLocation& peer)> can_reach;
  // Non-empty: this rank could not prepare its request (e.g. EPX_RANKS_PER_NODE is not a number); every
  // rank then raises it.
  std::string error;
};

// Collective over `bootstrap`: three all-gathers (locations, reachability rows, each rank's choice). Every
// rank returns the same ranks_per_node, or every rank throws the same epx::Error. The choice is the override
// when given (it must divide the detected node size: a node never spans hosts), else the detected size;
// either must pass validate_node_split. Ranks whose choices differ are an error, not a silent pick.
int agree_ranks_per_node(Bootstrap& bootstrap, const TopologyRequest& request);

}  // namespace epx
