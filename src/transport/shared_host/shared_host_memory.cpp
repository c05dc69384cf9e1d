#include "transport/shared_host/shared_host_memory.hpp"

#include <cuda_runtime.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>

namespace epx {

namespace {

// Rank 0's object name, as every rank receives it.
struct SharedName {
  char text[64];
};

// Maps `name` (creating it, zeroed, when `create`) and registers it with CUDA; nullptr on any failure.
void* map_shared(const char* name, size_t bytes, bool create) {
  const int fd = shm_open(name, create ? O_CREAT | O_EXCL | O_RDWR : O_RDWR, 0600);
  if (fd < 0) return nullptr;
  if (create && ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    close(fd);
    return nullptr;
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return nullptr;
  if (create) std::memset(base, 0, bytes);
  return base;
}

}  // namespace

SharedHostMemory::SharedHostMemory(Bootstrap& bootstrap, size_t bytes) : bytes_(bytes) {
  SharedName name{};
  void* base = nullptr;
  if (bootstrap.rank() == 0) {
    const auto now = std::chrono::steady_clock::now().time_since_epoch().count();
    std::snprintf(name.text, sizeof(name.text), "/epx-%d-%llx", static_cast<int>(getpid()),
                  static_cast<unsigned long long>(now));
    base = map_shared(name.text, bytes, true);
    if (base == nullptr) name.text[0] = '\0';
  }
  const SharedName shared = all_gather_value(bootstrap, name)[0];
  if (bootstrap.rank() != 0 && shared.text[0] != '\0') base = map_shared(shared.text, bytes, false);
  if (base != nullptr) {
    registered_ =
        cudaHostRegister(base, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable) == cudaSuccess;
    if (registered_ && cudaHostGetDevicePointer(&device_, base, 0) != cudaSuccess) device_ = nullptr;
    cudaGetLastError();  // a failed registration is not the next call's error
  }
  host_ = base;
  const int mapped = base != nullptr && device_ != nullptr ? 1 : 0;
  const std::vector<int> all_mapped = all_gather_value(bootstrap, mapped);  // every rank opened it by now
  if (bootstrap.rank() == 0 && shared.text[0] != '\0') shm_unlink(shared.text);
  if (std::find(all_mapped.begin(), all_mapped.end(), 0) != all_mapped.end()) release();
}

SharedHostMemory::~SharedHostMemory() {
  release();
}

void SharedHostMemory::release() noexcept {
  if (host_ == nullptr) return;
  if (registered_) cudaHostUnregister(host_);
  munmap(host_, bytes_);
  host_ = device_ = nullptr;
  registered_ = false;
}

}  // namespace epx
