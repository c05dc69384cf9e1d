#pragma once

// Loads every EPX kernel into the current context now. With CUDA's lazy module loading (the default), the
// first launch of a kernel loads it, and loading can wait for work already running on the device; our
// kernels spin on peers, and callers may hold their streams (host callbacks, graphs), so a first launch in
// the middle of an operation could stall or deadlock. The Buffer preloads at construction instead.
#include <cuda_runtime.h>

#include <cstddef>

#include "gpu/cuda_check.hpp"

namespace epx::kernels {

// Loads `kernel` into the current context (its attributes query forces the load).
template <typename Kernel>
void preload_kernel(Kernel* kernel) {
  cudaFuncAttributes attributes{};
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
}

// Lets `kernel` launch with `bytes` of dynamic shared memory (above 48 KiB needs the opt-in).
template <typename Kernel>
void allow_dynamic_smem(Kernel* kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return;
  EPX_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

void preload_normal_layout_kernels();
void preload_normal_notify_kernels();
void preload_normal_dispatch_kernels();
void preload_normal_combine_kernels();
void preload_combine_staging_kernels();
void preload_low_latency_dispatch_kernels();
void preload_low_latency_combine_kernels();
void preload_low_latency_clean_kernels();
void preload_low_latency_mask_kernels();

inline void preload_all_kernels() {
  preload_normal_layout_kernels();
  preload_normal_notify_kernels();
  preload_normal_dispatch_kernels();
  preload_normal_combine_kernels();
  preload_combine_staging_kernels();
  preload_low_latency_dispatch_kernels();
  preload_low_latency_combine_kernels();
  preload_low_latency_clean_kernels();
  preload_low_latency_mask_kernels();
}

}  // namespace epx::kernels
