// The low-latency clean kernel for groups whose ranks all share this NVLink node.
#include "kernels/low_latency_clean.cuh"
#include "kernels/preload.hpp"

namespace epx::kernels {

void launch_low_latency_clean(const LowLatencyCleanArgs& args, cudaStream_t stream) {
  launch_low_latency_clean_with<low_latency::NoRemote>(args, stream);
}

void preload_low_latency_clean_kernels() {
  preload_low_latency_clean_with<low_latency::NoRemote>();
}

}  // namespace epx::kernels
