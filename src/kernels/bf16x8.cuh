#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "formats/bf16.hpp"

// Arithmetic on 16-byte chunks (8 BF16 values): widening to float, and combine's sums in float as the
// references define them.
namespace epx::kernels {

// Sums start at -0.0f, the identity of float addition: a sum is exactly its terms added left to right (a lone
// -0.0 stays -0.0). A token with no term at all is written as +0.0 instead.
constexpr float kSumStart = -0.0f;

__device__ __forceinline__ void start_sum(float (&acc)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = kSumStart;
}

// 8 BF16 values (16 bytes) widened to float. A BF16 value is the upper half of the float it widens to: value
// 2i (the low half of word i) is that word shifted up, value 2i + 1 the word with its low half cleared. One
// instruction a value, where the intrinsic's widening took three for two (a byte permute, then two shifts).
__device__ __forceinline__ void unpack_bf16x8(const int4& packed, float* out) {
  const uint32_t words[4] = {static_cast<uint32_t>(packed.x), static_cast<uint32_t>(packed.y),
                             static_cast<uint32_t>(packed.z), static_cast<uint32_t>(packed.w)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(words[i] << 16);
    out[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
  }
}

__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const int4& packed) {
  float values[8];
  unpack_bf16x8(packed, values);
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] += values[i];
}

// The sums rounded once to BF16 (round to nearest even).
__device__ __forceinline__ int4 round_bf16x8(const float (&acc)[8]) {
  int4 out;
  auto* pairs = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
  for (int h = 0; h < 4; ++h) pairs[h] = __floats2bfloat162_rn(acc[2 * h], acc[2 * h + 1]);
  return out;
}

// 8 BF16 values each as a sum of one term (bf16_one_term_sum).
__device__ __forceinline__ int4 one_term_sum_bf16x8(int4 packed) {
  uint32_t words[4] = {static_cast<uint32_t>(packed.x), static_cast<uint32_t>(packed.y),
                       static_cast<uint32_t>(packed.z), static_cast<uint32_t>(packed.w)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    words[i] = static_cast<uint32_t>(bf16_one_term_sum(static_cast<uint16_t>(words[i] >> 16))) << 16 |
               bf16_one_term_sum(static_cast<uint16_t>(words[i] & 0xFFFFu));
  }
  return int4{static_cast<int>(words[0]), static_cast<int>(words[1]), static_cast<int>(words[2]),
              static_cast<int>(words[3])};
}

}  // namespace epx::kernels
