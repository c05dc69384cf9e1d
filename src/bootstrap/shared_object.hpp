#pragma once

#include <cstddef>
#include <string>

#include "epx/bootstrap.hpp"

namespace epx {

// A POSIX shared-memory object that every rank of a group on one host maps: rank 0 creates it, zeroed, under
// a fresh name, and every rank opens it by that name (one all_gather over the bootstrap). unlink() removes
// the name once every rank has opened it, which the caller's next collective guarantees (so does the
// destructor: destroy it only after a collective); the mappings stay.
// A rank that cannot map it (no /dev/shm, rank 0 could not create it) has a null base(): the caller decides,
// collectively, what to do then. Plain host code: tested in CI without a GPU.
class SharedObject {
 public:
  SharedObject(Bootstrap& bootstrap, size_t bytes);
  ~SharedObject();
  SharedObject(const SharedObject&) = delete;
  SharedObject& operator=(const SharedObject&) = delete;

  void* base() const { return base_; }
  size_t bytes() const { return bytes_; }
  const std::string& name() const { return name_; }  // "" where rank 0 could not create it
  void unlink() noexcept;                            // rank 0 removes the name; a no-op elsewhere
  void release() noexcept;                           // unmaps this rank's view

 private:
  void* base_ = nullptr;
  size_t bytes_ = 0;
  std::string name_;
  bool owner_ = false;
};

}  // namespace epx
