#include "device/ptx.cuh"
#include "gpu/cuda_check.hpp"
#include "start_gate.hpp"

namespace epx::bench {

namespace {

__global__ void start_delay_kernel(unsigned ns) {
  const uint64_t until = device::global_timer_ns() + ns;
  while (device::global_timer_ns() < until) {
  }
}

}  // namespace

void launch_start_delay(cudaStream_t stream, unsigned ns) {
  start_delay_kernel<<<1, 1, 0, stream>>>(ns);
  EPX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epx::bench
