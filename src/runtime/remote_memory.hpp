#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "epx/bootstrap.hpp"

namespace epx {

// Low-latency memory for a group that spans several NVLink nodes (real ones, or virtual ones on one host):
// one symmetric allocation per rank that every rank reaches through the NVSHMEM transport, and that the
// ranks of this rank's node also map directly.
struct RemoteMemory {
  void* local = nullptr;
  size_t bytes = 0;
  // [R]: rank r's allocation as seen from this GPU for the ranks of this rank's node (own included),
  // nullptr for ranks reached only by puts.
  std::vector<void*> bases;
  // [R]: every rank's allocation this GPU reaches by loads and stores (the transport maps it: NVLink or PCIe
  // peers, an NVLink fabric), its node's and other nodes'; nullptr for ranks reached only by puts.
  std::vector<void*> reachable;
  std::shared_ptr<void> owner;  // releasing the last reference frees the memory (collective)
};

// Collective over `bootstrap`; ranks [k * ranks_per_node, (k + 1) * ranks_per_node) form node k. Implemented
// by the NVSHMEM transport; throws epx::Error where EPX was built without it.
RemoteMemory allocate_remote_memory(Bootstrap& bootstrap, size_t bytes, int ranks_per_node);

}  // namespace epx
