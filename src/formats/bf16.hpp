#pragma once

#include <cstdint>

#include "common/host_device.hpp"
#include "formats/bits.hpp"

namespace epx {

// BF16 travels as its uint16_t bit pattern on the host (no CUDA types in host code).
// Bit-exact with CUDA's __float2bfloat16_rn: round to nearest even (finite values just above the largest
// BF16 round to infinity), every NaN becomes the canonical quiet NaN 0x7FFF (sign dropped).
constexpr uint16_t kBf16CanonicalNan = 0x7FFF;

EPX_HD uint16_t float_to_bf16(float x) {
  const uint32_t bits = float_as_bits(x);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return kBf16CanonicalNan;
  // Adding 0x7FFF plus the lowest kept bit carries into the kept half exactly when the dropped half is
  // above the midpoint, or on the midpoint with an odd kept half (ties to even).
  const uint32_t rounding = 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

EPX_HD float bf16_to_float(uint16_t bits) {
  return bits_as_float(static_cast<uint32_t>(bits) << 16);
}

// A BF16 value as a sum of it alone rounds it (the sums start at -0.0, so the term stays as it is):
// float_to_bf16(-0.0f + bf16_to_float(bits)), without the float: the value itself, a NaN the canonical NaN.
EPX_HD uint16_t bf16_one_term_sum(uint16_t bits) {
  return (bits & 0x7FFFu) > 0x7F80u ? kBf16CanonicalNan : bits;
}

// Directed roundings of a non-negative finite float, used where a BF16 bound must still enclose the value
// (LogFMT's range metadata).
EPX_HD uint16_t float_to_bf16_round_up(float x) {
  const uint32_t bits = float_as_bits(x);
  return static_cast<uint16_t>((bits >> 16) + ((bits & 0xFFFFu) != 0u ? 1u : 0u));
}

EPX_HD uint16_t float_to_bf16_round_down(float x) {
  return static_cast<uint16_t>(float_as_bits(x) >> 16);
}

}  // namespace epx
