#include "gpu/cuda_check.hpp"
#include "start_gate.hpp"

namespace epx::bench {

namespace {

__device__ unsigned long long global_timer_ns() {
  unsigned long long ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return ns;
}

__global__ void start_delay_kernel(unsigned ns) {
  const unsigned long long until = global_timer_ns() + ns;
  while (global_timer_ns() < until) {
  }
}

}  // namespace

void launch_start_delay(cudaStream_t stream, unsigned ns) {
  start_delay_kernel<<<1, 1, 0, stream>>>(ns);
  EPX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epx::bench
