#pragma once

#include <cstddef>

#include "bootstrap/shared_object.hpp"
#include "epx/bootstrap.hpp"

namespace epx {

// Host memory every rank of a group on one host maps, pinned and mapped into each rank's GPU too: a rank's
// GPU writes there and every rank's host reads it without a copy or a kernel. A SharedObject registered with
// CUDA in each process. Collective over the bootstrap. Where any rank cannot map or register it, every rank
// gets an empty one (valid() false) and nothing is thrown: it is an optimisation.
class SharedHostMemory {
 public:
  SharedHostMemory(Bootstrap& bootstrap, size_t bytes);
  ~SharedHostMemory();
  SharedHostMemory(const SharedHostMemory&) = delete;
  SharedHostMemory& operator=(const SharedHostMemory&) = delete;

  bool valid() const { return device_ != nullptr; }
  void* host() const { return valid() ? object_.base() : nullptr; }
  void* device() const { return device_; }  // the same memory as this rank's GPU sees it
  void release() noexcept;

 private:
  SharedObject object_;
  void* device_ = nullptr;
  bool registered_ = false;
};

}  // namespace epx
