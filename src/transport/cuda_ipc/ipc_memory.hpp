#pragma once

#include <cstddef>
#include <vector>

#include "epx/bootstrap.hpp"

namespace epx {

// A device allocation of the same size on every rank, mapped with CUDA IPC into every rank of the same node
// (ranks [k * ranks_per_node, (k + 1) * ranks_per_node); 0: every rank is one node). Construction and
// release() are collective.
class IpcMemory {
 public:
  IpcMemory(Bootstrap& bootstrap, size_t bytes, const char* what, int ranks_per_node = 0);
  ~IpcMemory();
  IpcMemory(const IpcMemory&) = delete;
  IpcMemory& operator=(const IpcMemory&) = delete;

  void* local() const { return bases_.empty() ? nullptr : bases_[rank_]; }
  size_t bytes() const { return bytes_; }
  // bases()[r] is rank r's allocation as seen from this GPU (own rank included; nullptr on other nodes).
  const std::vector<void*>& bases() const { return bases_; }
  // Unmaps the peers and frees the local allocation. Peers must have stopped using it (callers barrier
  // first).
  void release() noexcept;

 private:
  int rank_ = 0;
  size_t bytes_ = 0;
  std::vector<void*> bases_;
};

}  // namespace epx
