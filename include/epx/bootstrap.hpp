#pragma once

#include <cstddef>
#include <cstring>
#include <type_traits>
#include <vector>

namespace epx {

// What the runtime needs from a process group: its rank, its size and an all-gather of bytes (CUDA IPC
// handles, NVSHMEM unique ids, per-rank sizes). Implementations: the local launcher's shared-memory group
// (epx/local_launcher.hpp), torch.distributed in Python, TCP or MPI later.
//
// Collectives are blocking and must be called by every rank in the same order; an implementation bounds
// every wait and reports a dead or late peer as an epx::Error instead of hanging. One thread per rank
// calls into a Bootstrap at a time.
class Bootstrap {
 public:
  virtual ~Bootstrap() = default;
  virtual int rank() const = 0;
  virtual int num_ranks() const = 0;
  // Every rank passes `bytes` bytes (the same count on every rank, checked); returns num_ranks * bytes
  // bytes, rank r's at offset r * bytes. bytes == 0 is a valid call (it synchronises like a barrier).
  virtual std::vector<std::byte> all_gather(const void* data, size_t bytes) = 0;
  virtual void barrier() = 0;
};

// all_gather of one value per rank: result[r] is rank r's value.
template <typename T>
std::vector<T> all_gather_value(Bootstrap& bootstrap, const T& value) {
  static_assert(std::is_trivially_copyable_v<T>, "all_gather_value needs a trivially copyable type");
  const std::vector<std::byte> gathered = bootstrap.all_gather(&value, sizeof(T));
  std::vector<T> values(gathered.size() / sizeof(T));
  if (!values.empty()) std::memcpy(values.data(), gathered.data(), values.size() * sizeof(T));
  return values;
}

}  // namespace epx
