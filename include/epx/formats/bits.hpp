#pragma once

#include <cstdint>
#include <cstring>

#include "epx/common/host_device.hpp"

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
// that wraps within each lane.
EPX_HD uint32_t max_u16x2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __vmaxu2(a, b);
#else
  const uint32_t high = (a >> 16) > (b >> 16) ? a >> 16 : b >> 16;
  const uint32_t low = (a & 0xFFFFu) > (b & 0xFFFFu) ? a & 0xFFFFu : b & 0xFFFFu;
  return high << 16 | low;
#endif
}

EPX_HD uint32_t min_u16x2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __vminu2(a, b);
#else
  const uint32_t high = (a >> 16) < (b >> 16) ? a >> 16 : b >> 16;
  const uint32_t low = (a & 0xFFFFu) < (b & 0xFFFFu) ? a & 0xFFFFu : b & 0xFFFFu;
  return high << 16 | low;
#endif
}

EPX_HD uint32_t sub_u16x2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __vsub2(a, b);
#else
  return ((a >> 16) - (b >> 16)) << 16 | (((a & 0xFFFFu) - (b & 0xFFFFu)) & 0xFFFFu);
#endif
}

}  // namespace epx
