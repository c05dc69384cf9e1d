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

}  // namespace epx
