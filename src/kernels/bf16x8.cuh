#pragma once

#include <cuda_bf16.h>

// Combine's arithmetic on 16-byte chunks (8 BF16 values) summed in float, as the references define it.
namespace epx::kernels {

// Sums start at -0.0f, the identity of float addition: a sum is exactly its terms added left to right (a lone
// -0.0 stays -0.0). A token with no term at all is written as +0.0 instead.
constexpr float kSumStart = -0.0f;

__device__ __forceinline__ void start_sum(float (&acc)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = kSumStart;
}

__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const int4& packed) {
  const auto* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    acc[2 * i] += f.x;
    acc[2 * i + 1] += f.y;
  }
}

// The sums rounded once to BF16 (round to nearest even).
__device__ __forceinline__ int4 round_bf16x8(const float (&acc)[8]) {
  int4 out;
  auto* pairs = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
  for (int h = 0; h < 4; ++h) pairs[h] = __floats2bfloat162_rn(acc[2 * h], acc[2 * h + 1]);
  return out;
}

}  // namespace epx::kernels
