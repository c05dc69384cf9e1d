#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "epx/bootstrap.hpp"

namespace epx::bench {

// NCCL all-to-all of pre-permuted rows (ncclSend/ncclRecv in one group): the baseline moving the same bytes.
class NcclAllToAll {
 public:
  // enabled = false: no communicator, available() is false (ranks that share a GPU, which NCCL refuses).
  NcclAllToAll(Bootstrap& bootstrap, bool enabled);
  ~NcclAllToAll();
  bool available() const;
  // send_bytes[r] bytes to rank r, recv_bytes[r] from rank r, packed in rank order in both buffers.
  void run(const void* send, const std::vector<size_t>& send_bytes, void* recv,
           const std::vector<size_t>& recv_bytes, cudaStream_t stream);

 private:
  void* comm_ = nullptr;
  int num_ranks_ = 0;
};

}  // namespace epx::bench
