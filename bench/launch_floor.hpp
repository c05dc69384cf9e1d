#pragma once

#include <cuda_runtime.h>

namespace epx::bench {

// An empty kernel launched like the low-latency kernels (one 512-thread block per SM, cooperative): what any
// one-kernel call costs before it does anything. Timed as a call and in a graph replay beside the
// low-latency rows, it is the floor of their call-minus-graph overhead on the machine at hand.
void launch_empty_kernel(int num_blocks, cudaStream_t stream);

}  // namespace epx::bench
