#pragma once

#include <cstdint>

#include "common/host_device.hpp"
#include "formats/bits.hpp"

namespace epx {

// UE8M0 (OCP MX scale format): one byte holding a biased power-of-two exponent, 2^(b - 127).
// 0xFF is NaN; 0x00 is 2^-127, a float subnormal. FP8 round_scale scales are powers of two far inside
// that range (about 2^-22 to 2^120), so the byte is simply the float's exponent field.

// Precondition: scale is a positive power of two (a normal float, or 2^-127). Other inputs return the
// exponent field of the float, i.e. the power of two at or below it.
EPX_HD uint8_t ue8m0_from_pow2_scale(float scale) {
  // 2^-127 (float bits 0x00400000) has exponent field 0, which is also its UE8M0 byte.
  return static_cast<uint8_t>((float_as_bits(scale) >> 23) & 0xFFu);
}

EPX_HD float pow2_scale_from_ue8m0(uint8_t byte) {
  if (byte == 0xFFu) return bits_as_float(0x7FC00000u);
  if (byte == 0u) return bits_as_float(0x00400000u);
  return bits_as_float(static_cast<uint32_t>(byte) << 23);
}

// 32-bit words holding the UE8M0 bytes of `num_groups` scale groups: ceil(G / 4), four per word.
EPX_HD int ue8m0_num_words(int num_groups) {
  return (num_groups + 3) / 4;
}

// Four groups' scale bytes per 32-bit word, group 4i+j in byte j of word i (the layout DeepGEMM reads).
EPX_HD uint32_t pack_ue8m0x4(uint8_t b0, uint8_t b1, uint8_t b2, uint8_t b3) {
  return static_cast<uint32_t>(b0) | (static_cast<uint32_t>(b1) << 8) | (static_cast<uint32_t>(b2) << 16) |
         (static_cast<uint32_t>(b3) << 24);
}

EPX_HD uint8_t unpack_ue8m0x4(uint32_t word, int byte_idx) {
  return static_cast<uint8_t>((word >> (8 * byte_idx)) & 0xFFu);
}

}  // namespace epx
