#pragma once

// A warp's prefix sum, shared by the kernels that scan small per-rank or per-pair counts in registers.
namespace epx::kernels {

// The sum of `value` over lanes 0 .. lane of the calling warp; every lane of the warp calls it.
__device__ __forceinline__ int warp_inclusive_sum(int value, int lane) {
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int below = __shfl_up_sync(0xffffffffu, value, offset);
    if (lane >= offset) value += below;
  }
  return value;
}

}  // namespace epx::kernels
