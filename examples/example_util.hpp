#pragma once

// Small helpers the C++ examples share: checked CUDA calls, device memory freed at scope exit, and the
// local launch with ranks spread over the visible GPUs.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "epx/local_launcher.hpp"

namespace example {

inline void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

// Device allocations of one rank, freed together.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory() {
    for (void* p : allocations_) cudaFree(p);
  }
  // Never null, even for 0 elements: a null pointer means "not given" to several EPX arguments.
  template <typename T>
  T* alloc(size_t count) {
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, count > 0 ? count * sizeof(T) : 16), "cudaMalloc");
    allocations_.push_back(p);
    return static_cast<T*>(p);
  }
  template <typename T>
  T* upload(const std::vector<T>& host) {
    T* p = alloc<T>(host.size());
    check_cuda(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
    return p;
  }

 private:
  std::vector<void*> allocations_;
};

template <typename T>
std::vector<T> download(const T* device, size_t count) {
  std::vector<T> host(count);
  check_cuda(cudaMemcpy(host.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost), "download");
  return host;
}

// Exit status of an example that found no GPU (the "skipped" status of automake and CTest).
constexpr int kNoGpuExitCode = 77;

// Runs rank_main(bootstrap) in one process per rank, rank r on GPU r % GPUs (argv[1] ranks, default 2), and
// prints the launcher's summary. rank_main returns 0 when its checks passed. Without a GPU it prints
// "no GPU found" once and returns kNoGpuExitCode.
inline int launch(int argc, char** argv, const std::function<int(epx::Bootstrap&)>& rank_main) {
  epx::LocalLaunchOptions options;
  options.num_ranks = argc > 1 ? std::atoi(argv[1]) : 2;
  // No CUDA call before launch_local: the ranks are forked, and a CUDA context does not survive a fork.
  const epx::LocalLaunchResult result = epx::launch_local(options, [&](epx::Bootstrap& bootstrap) {
    int num_gpus = 0;
    const cudaError_t status = cudaGetDeviceCount(&num_gpus);
    if (status != cudaSuccess || num_gpus == 0) {
      if (bootstrap.rank() == 0) {
        std::fprintf(stderr, "no GPU found (cudaGetDeviceCount: %s): this example needs a GPU\n",
                     status != cudaSuccess ? cudaGetErrorString(status) : "0 devices");
      }
      return kNoGpuExitCode;
    }
    check_cuda(cudaSetDevice(bootstrap.rank() % num_gpus), "cudaSetDevice");
    return rank_main(bootstrap);
  });
  bool no_gpu = !result.exit_codes.empty();
  for (int code : result.exit_codes) no_gpu = no_gpu && code == kNoGpuExitCode;
  if (no_gpu) return kNoGpuExitCode;
  std::printf("%s\n", result.summary().c_str());
  return result.ok() ? 0 : 1;
}

}  // namespace example
