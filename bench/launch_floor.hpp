#pragma once

#include <cuda_runtime.h>

#include "kernels/launch.hpp"

namespace epx::bench {

// An empty kernel of 512-thread blocks. Launched like the low-latency kernels (one block per SM,
// cooperative) it is what any one-kernel call of theirs costs before it does anything: timed as a call and
// in a graph replay beside the low-latency rows, the floor of their call-minus-graph overhead on the machine
// at hand. One block launched plainly is the cheapest launch there is, so the launch form's own share shows.
void launch_empty_kernel(int num_blocks, kernels::Residency residency, cudaStream_t stream);

}  // namespace epx::bench
