#pragma once

#include <cstddef>
#include <cstdlib>
#include <memory>
#include <string_view>
#include <vector>

#include "epx/bootstrap.hpp"

namespace epx {

// EPX_INTERNODE_PUTS=1: ranks of other nodes are reached through the transport's puts even where it could map
// them (the path a NIC takes, run by the tests on GPUs that map each other). Read when asked: a test switches
// it between Buffers.
inline bool internode_puts_requested() {
  const char* puts = std::getenv("EPX_INTERNODE_PUTS");
  return puts != nullptr && std::string_view(puts) == "1";
}

// Low-latency memory for a group that spans several NVLink nodes (real ones, or virtual ones on one host):
// one symmetric allocation per rank that every rank reaches through the NVSHMEM transport, and that the
// ranks of this rank's node map directly, as do ranks of other nodes that the transport reaches by load and
// store (its P2P transport: an NVLink fabric across hosts, or virtual nodes of one host) unless
// internode_puts_requested().
struct RemoteMemory {
  void* local = nullptr;
  size_t bytes = 0;
  // [R]: rank r's allocation as seen from this GPU where mapped (own node always), nullptr for ranks reached
  // only by puts.
  std::vector<void*> bases;
  std::shared_ptr<void> owner;  // releasing the last reference frees the memory (collective)
};

// Collective over `bootstrap`; ranks [k * ranks_per_node, (k + 1) * ranks_per_node) form node k. Implemented
// by the NVSHMEM transport; throws epx::Error where EPX was built without it.
RemoteMemory allocate_remote_memory(Bootstrap& bootstrap, size_t bytes, int ranks_per_node);

}  // namespace epx
