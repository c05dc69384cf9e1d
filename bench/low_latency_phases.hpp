#pragma once

#include <cuda_runtime.h>

#include <functional>
#include <string>

#include "epx/bootstrap.hpp"
#include "epx/buffer.hpp"

namespace epx::bench {

// Where the microseconds of one low-latency call go (EPX_LL_PHASE_STAMPS=1 when the Buffer was built; without
// it this does nothing). `call` runs `iters` times after `warmup`, one at a time (synchronized, ranks meeting
// before each); after each, the kernels' stamps (kernels::LowLatencyStamp) are read back. Prints to stderr,
// per phase, the median over calls of: the last block's stamp minus the first block's entry, in microseconds.
void print_low_latency_phases(Buffer& buffer, Bootstrap& bootstrap, cudaStream_t stream, int warmup,
                              int iters, const std::string& name, const std::function<void()>& call);

}  // namespace epx::bench
