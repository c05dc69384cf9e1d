#pragma once

#include <cstdint>
#include <cstring>

#include "common/host_device.hpp"

namespace epx {

// Bit casts usable in host and device code (std::bit_cast is not available in device code).
EPX_HD uint32_t float_as_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
#endif
}

EPX_HD float bits_as_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
#endif
}

// Two 16-bit unsigned lanes per word (a GPU does each in one instruction): max, min, and subtraction
// that wraps within each lane. On the host, `op` applied to each lane.
template <typename Op>
inline uint32_t per_u16_lane(uint32_t a, uint32_t b, Op op) {
  return (op(a >> 16, b >> 16) & 0xFFFFu) << 16 | (op(a & 0xFFFFu, b & 0xFFFFu) & 0xFFFFu);
}

EPX_HD uint32_t max_u16x2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __vmaxu2(a, b);
#else
  return per_u16_lane(a, b, [](uint32_t x, uint32_t y) { return x > y ? x : y; });
#endif
}

EPX_HD uint32_t min_u16x2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __vminu2(a, b);
#else
  return per_u16_lane(a, b, [](uint32_t x, uint32_t y) { return x < y ? x : y; });
#endif
}

EPX_HD uint32_t sub_u16x2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __vsub2(a, b);
#else
  return per_u16_lane(a, b, [](uint32_t x, uint32_t y) { return x - y; });
#endif
}

// Set bits of a word.
EPX_HD int popcount32(uint32_t word) {
#if defined(__CUDA_ARCH__)
  return __popc(word);
#else
  return __builtin_popcount(word);
#endif
}

// Position of the lowest set bit of a word; `word` must not be 0.
EPX_HD int lowest_set_bit32(uint32_t word) {
#if defined(__CUDA_ARCH__)
  return __ffs(word) - 1;
#else
  return __builtin_ctz(word);
#endif
}

}  // namespace epx
