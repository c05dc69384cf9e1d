#include "transport/shared_host/shared_host_memory.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

namespace epx {

SharedHostMemory::SharedHostMemory(Bootstrap& bootstrap, size_t bytes) : object_(bootstrap, bytes) {
  void* base = object_.base();
  if (base != nullptr) {
    registered_ =
        cudaHostRegister(base, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable) == cudaSuccess;
    if (registered_ && cudaHostGetDevicePointer(&device_, base, 0) != cudaSuccess) device_ = nullptr;
    cudaGetLastError();  // a failed registration is not the next call's error
  }
  const int mapped = device_ != nullptr ? 1 : 0;
  const std::vector<int> all_mapped = all_gather_value(bootstrap, mapped);  // every rank opened it by now
  object_.unlink();
  if (std::find(all_mapped.begin(), all_mapped.end(), 0) != all_mapped.end()) release();
}

SharedHostMemory::~SharedHostMemory() {
  release();
}

void SharedHostMemory::release() noexcept {
  if (registered_) cudaHostUnregister(object_.base());
  registered_ = false;
  device_ = nullptr;
  object_.release();
}

}  // namespace epx
