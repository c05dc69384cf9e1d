#pragma once

namespace epx {

// Number of usable CUDA devices; 0 when there is no driver or no GPU (CI), never throws. Does not initialise
// CUDA in the calling process, so it is safe to call before forking workers.
int visible_gpu_count();

}  // namespace epx
