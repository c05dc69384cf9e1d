// The low-latency dispatch kernel for groups whose ranks all share this NVLink node.
#include "kernels/low_latency_dispatch.cuh"
#include "kernels/preload.hpp"

namespace epx::kernels {

void launch_low_latency_dispatch(const LowLatencyDispatchArgs& args, cudaStream_t stream) {
  launch_low_latency_dispatch_with<low_latency::NoRemote>(args, stream);
}

size_t low_latency_dispatch_smem_bytes(const LowLatencyBufferMap& map) {
  return dispatch_smem_bytes(map);
}

void preload_low_latency_dispatch_kernels() {
  preload_low_latency_dispatch_with<low_latency::NoRemote>();
}

}  // namespace epx::kernels
