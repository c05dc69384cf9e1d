#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "gpu/cuda_check.hpp"

// The one way EPX launches a kernel: cudaLaunchKernelEx, checked at the call, so a bad launch raises its own
// error (never a later launch's), with the attributes the kernel's blocks need.
namespace epx::kernels {

// How a kernel's blocks depend on each other.
enum class Residency {
  kIndependent,  // blocks never wait for other blocks of the launch
  // Blocks spin on flags that other blocks of the launch set (channel senders and receivers, grid-wide
  // arrivals): every block must be resident at once. The launch is cooperative, so a grid that cannot be
  // resident fails with an error instead of hanging.
  kCoResident,
};

struct LaunchShape {
  dim3 grid;
  dim3 block;
  size_t smem_bytes;
  Residency residency;
};

template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), const LaunchShape& shape, cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attributes[1] = {};
  cudaLaunchConfig_t config = {};
  config.gridDim = shape.grid;
  config.blockDim = shape.block;
  config.dynamicSmemBytes = shape.smem_bytes;
  config.stream = stream;
  if (shape.residency == Residency::kCoResident) {
    attributes[0].id = cudaLaunchAttributeCooperative;
    attributes[0].val.cooperative = 1;
    config.attrs = attributes;
    config.numAttrs = 1;
  }
  EPX_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace epx::kernels
