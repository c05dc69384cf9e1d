#pragma once

#include <cstddef>

#include "epx/bootstrap.hpp"

namespace epx {

// Host memory every rank of a group on one host maps, pinned and mapped into each rank's GPU too: a rank's
// GPU writes there and every rank's host reads it without a copy or a kernel. A POSIX shared-memory object
// that rank 0 creates and every rank opens by its name (unlinked once all have opened it), registered with
// CUDA in each process. Collective over the bootstrap. Where any rank cannot map it (no /dev/shm, a failed
// registration) every rank gets an empty one (valid() false) and nothing is thrown: it is an optimisation.
class SharedHostMemory {
 public:
  SharedHostMemory(Bootstrap& bootstrap, size_t bytes);
  ~SharedHostMemory();
  SharedHostMemory(const SharedHostMemory&) = delete;
  SharedHostMemory& operator=(const SharedHostMemory&) = delete;

  bool valid() const { return host_ != nullptr; }
  void* host() const { return host_; }
  void* device() const { return device_; }  // the same memory as this rank's GPU sees it
  size_t bytes() const { return bytes_; }
  void release() noexcept;

 private:
  void* host_ = nullptr;
  void* device_ = nullptr;
  size_t bytes_ = 0;
  bool registered_ = false;
};

}  // namespace epx
