#pragma once

namespace epx::transport::nvshmem {

// Loads the NVSHMEM builds of the low-latency kernels now (see kernels/preload.hpp for why).
void preload_low_latency_remote_kernels();

}  // namespace epx::transport::nvshmem
