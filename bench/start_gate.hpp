#pragma once

#include <cuda_runtime.h>

namespace epx::bench {

// Keeps `stream` busy for `ns` nanoseconds (one thread reading the GPU's global timer). Queued right after
// the ranks' host barrier and before a timed run's start event, it hides the host's launch cost of the run
// (the host enqueues the run while the GPU waits here) and the ranks' barrier-exit skew up to `ns`: the
// run then starts on every GPU about when the delay ends, not when each host got round to it.
void launch_start_delay(cudaStream_t stream, unsigned ns);

}  // namespace epx::bench
