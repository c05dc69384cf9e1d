#pragma once

#include <cstddef>

#include "epx/bootstrap.hpp"

// The NVSHMEM transport's host side: brings NVSHMEM up on the ranks of a Bootstrap and owns one symmetric
// allocation. Plain types only; NVSHMEM headers stay inside this folder's sources.
namespace epx::transport::nvshmem {

// NVSHMEM is process-global: one NvshmemHeap may exist per process at a time. Construction and destruction
// are collective (every rank of the bootstrap, same size).
class NvshmemHeap {
 public:
  // Initialises NVSHMEM with a unique id from rank 0, all-gathered through `bootstrap`, on the current CUDA
  // device, then allocates `bytes` (zeroed) on the symmetric heap.
  NvshmemHeap(Bootstrap& bootstrap, size_t bytes);
  ~NvshmemHeap();
  NvshmemHeap(const NvshmemHeap&) = delete;
  NvshmemHeap& operator=(const NvshmemHeap&) = delete;

  void* base() const { return base_; }  // symmetric: the same offsets are valid on every rank
  size_t bytes() const { return bytes_; }
  int rank() const { return rank_; }
  int num_ranks() const { return num_ranks_; }
  // Address of `offset` in `rank`'s allocation if this GPU can load/store it directly (NVLink), else nullptr.
  void* peer_pointer(int rank, size_t offset) const;
  // All ranks meet; every put issued before it on the device is complete (nvshmem_barrier_all on the host).
  void barrier() const;

 private:
  void* base_ = nullptr;
  size_t bytes_ = 0;
  int rank_ = 0;
  int num_ranks_ = 0;
};

}  // namespace epx::transport::nvshmem
