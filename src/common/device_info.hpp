#pragma once

namespace epx {

// Number of usable CUDA devices; 0 when there is no driver or no GPU (CI), never throws.
int visible_gpu_count();

}  // namespace epx
