// The low-latency combine kernel for groups whose ranks all share this NVLink node.
#include "kernels/low_latency_combine.cuh"
#include "kernels/preload.hpp"

namespace epx::kernels {

void launch_low_latency_combine(const LowLatencyCombineArgs& args, cudaStream_t stream) {
  launch_low_latency_combine_with<low_latency::NoRemote>(args, stream);
}

void preload_low_latency_combine_kernels() {
  preload_low_latency_combine_with<low_latency::NoRemote>();
}

}  // namespace epx::kernels
