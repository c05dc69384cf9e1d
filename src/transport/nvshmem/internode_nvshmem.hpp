#pragma once

namespace epx::transport::nvshmem {

// Loads the kernels of normal mode across nodes now (see kernels/preload.hpp for why).
void preload_internode_kernels();

}  // namespace epx::transport::nvshmem
