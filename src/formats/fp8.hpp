#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "common/host_device.hpp"
#include "epx/error.hpp"
#include "formats/bf16.hpp"
#include "formats/bits.hpp"
#include "formats/ue8m0.hpp"

// FP8 e4m3 (OCP e4m3fn) and the per-128-channel group scales of the low-latency dispatch cast.
//
// e4m3fn: bias 7, 3 mantissa bits, no infinities, 0x7F/0xFF are NaN, largest finite 448 (0x7E),
// subnormals m * 2^-9. The encoder is bit-exact with __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)
// (checked against CUDA's host emulation for all 2^32 floats): round to nearest even; every finite value
// that rounds above 448 and +-Inf saturate to +-448; every NaN becomes 0x7F (sign dropped); -0 and
// negative values that round to zero give 0x80. Decoding then encoding returns every code except 0xFF
// (-> 0x7F).
//
// NaN / Inf policy of the group cast:
// - amax is the max of |x| ignoring NaN (fp8_amax_update), and the result does not depend on the
//   reduction order, so a warp-shuffle reduction gives the same bits as a CPU loop. On the device fmaxf
//   does the same; on the host glibc's fmaxf returns NaN for a signalling NaN, hence the comparison.
// - A NaN input value still becomes the NaN code 0x7F, so it dequantizes to NaN: NaN propagates per value
//   and does not poison the rest of its group.
// - amax is clamped to [kFp8AmaxFloor, FLT_MAX] (a NaN amax becomes the floor), so the scale is always
//   finite and positive. A group holding +-Inf gets scale FLT_MAX/448: the Inf saturates to +-448 and
//   dequantizes to about +-FLT_MAX (exactly +-Inf with round_scale), its finite neighbours mostly to 0.
//
// Error bound (checked by the tests): with v = x * inv_scale and
// q = e4m3(v), e4m3 rounding moves v by at most 2^-4 |v| (half an ulp of a 3-bit mantissa) in the normal
// range and at most 2^-10 in the subnormal range, and saturation moves it less (|v| <= 448 up to float
// rounding). Hence |x - e4m3_to_float(q) * scale| <= 2^-4 |x| + 2^-10 scale, exactly with round_scale
// (every multiply by a power of two is exact) and up to 4 float roundings (< 2^-21 |x|) without it.
// One exception: with round_scale and amax > 1.75 * 2^127 the scale is 2^120 and a value that rounds up
// to q >= 256 dequantizes to Inf (2^128 is past FLT_MAX).
// So the absolute error is at most amax/16 = 28 scale units, not scale/8: the top binade has ulp 32.

namespace epx {

constexpr int kFp8GroupSize = 128;
constexpr float kE4m3Max = 448.0f;
constexpr float kFp8AmaxFloor = 1e-4f;
constexpr uint8_t kE4m3MaxCode = 0x7E;
constexpr uint8_t kE4m3NanCode = 0x7F;

EPX_HD uint8_t float_to_e4m3(float x) {
  const uint32_t bits = float_as_bits(x);
  const uint32_t abs_bits = bits & 0x7FFFFFFFu;
  if (abs_bits > 0x7F800000u) return kE4m3NanCode;
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t exp_field = abs_bits >> 23;
  uint32_t code;
  if (exp_field >= 121u) {
    // Normal e4m3 (|x| >= 2^-6): keep 3 of float's 23 mantissa bits, ties to even. A carry out of the
    // mantissa bumps the exponent, which is the right result; anything past 448 (Inf included) clamps.
    const uint32_t rounded = abs_bits + 0x7FFFFu + ((abs_bits >> 20) & 1u);
    code = (rounded >> 20) - (120u << 3);
    if (code > kE4m3MaxCode) code = kE4m3MaxCode;
  } else if (exp_field >= 117u) {
    // Subnormal e4m3: code = |x| * 2^9 rounded to an integer (0..8; 8 is the smallest normal, 2^-6).
    // |x| = significand * 2^(exp_field - 150), so the code is the significand shifted right by 141 - e.
    const uint32_t significand = (abs_bits & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 141u - exp_field;  // 21..24
    code = significand >> shift;
    const uint32_t remainder = significand & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (remainder > half || (remainder == half && (code & 1u) != 0u)) ++code;
  } else {
    code = 0;  // |x| < 2^-10: below half the smallest subnormal
  }
  return static_cast<uint8_t>(code | sign);
}

EPX_HD float e4m3_to_float(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t magnitude = code & 0x7Fu;
  if (magnitude == 0x7Fu) return bits_as_float(sign | 0x7FC00000u);
  if (magnitude < 8u) {
    const float subnormal = static_cast<float>(magnitude) * 0.001953125f;  // m * 2^-9, exact
    return bits_as_float(sign | float_as_bits(subnormal));
  }
  // Exponent field e (bias 7) and mantissa m sit side by side, so re-biasing to 127 is one add.
  return bits_as_float(sign | ((magnitude + (120u << 3)) << 20));
}

// One step of the amax reduction: max(amax, |x|), NaN ignored (a comparison with NaN is false).
EPX_HD float fp8_amax_update(float amax, float x) {
  const float abs_x = fabsf(x);
  return abs_x > amax ? abs_x : amax;
}

struct Fp8GroupScale {
  float scale;      // dequantize: e4m3_to_float(q) * scale
  float inv_scale;  // quantize: float_to_e4m3(x * inv_scale)
};

// amax: max |x| of the group (fp8_amax_update). With round_scale the scale is the smallest power of two
// >= amax/448 (computed on the bits, so a power of two stays itself) and inv_scale its exact inverse, so
// scale * inv_scale == 1 and the UE8M0 byte of the scale represents it exactly.
EPX_HD Fp8GroupScale fp8_group_scale(float amax, bool round_scale) {
  // Comparisons, not fmaxf/fminf: they send every NaN (signalling ones too) to the floor on all targets.
  float clamped_amax = amax > kFp8AmaxFloor ? amax : kFp8AmaxFloor;
  clamped_amax = clamped_amax < 3.40282347e+38f ? clamped_amax : 3.40282347e+38f;
  const float scale = clamped_amax / kE4m3Max;
  if (!round_scale) return Fp8GroupScale{scale, kE4m3Max / clamped_amax};
  // scale is a positive normal float (>= 1e-4/448), so rounding up to a power of two is: bump the
  // exponent unless the mantissa is already zero. The result stays within 2^-22 .. 2^120.
  const uint32_t bits = float_as_bits(scale);
  const uint32_t exp_field = (bits >> 23) + ((bits & 0x7FFFFFu) != 0u ? 1u : 0u);
  return Fp8GroupScale{bits_as_float(exp_field << 23), bits_as_float((254u - exp_field) << 23)};
}

EPX_HD uint8_t fp8_quantize_value(float x, const Fp8GroupScale& group_scale) {
  return float_to_e4m3(x * group_scale.inv_scale);
}

EPX_HD float fp8_dequantize_value(uint8_t code, const Fp8GroupScale& group_scale) {
  return e4m3_to_float(code) * group_scale.scale;
}

// Low-latency scales are [L, R*M, G] viewed column-major in the last two dims, i.e. stored as
// [L, G, R*M]: one group's scales for all rows of an expert are contiguous (what TMA-fed GEMMs load).
// The packed UE8M0 words use the same function with num_groups = H / 512.
EPX_HD size_t ll_scale_index(int local_expert, int row, int group, int num_rows, int num_groups) {
  return (static_cast<size_t>(local_expert) * static_cast<size_t>(num_groups) + static_cast<size_t>(group)) *
             static_cast<size_t>(num_rows) +
         static_cast<size_t>(row);
}

// Host reference of the per-row cast: one scale per 128 channels, in the order a kernel must match.
inline void quantize_fp8_row(const uint16_t* bf16_row, int hidden, bool round_scale, uint8_t* fp8_out,
                             float* scales_out) {
  EPX_CHECK(hidden >= 0, "hidden", hidden, "must be >= 0");
  EPX_CHECK(hidden % kFp8GroupSize == 0, "hidden", hidden, "must be a multiple of 128 (the FP8 group size)");
  for (int group_idx = 0; group_idx < hidden / kFp8GroupSize; ++group_idx) {
    const uint16_t* group_in = bf16_row + static_cast<size_t>(group_idx) * kFp8GroupSize;
    float amax = 0.0f;
    for (int i = 0; i < kFp8GroupSize; ++i) amax = fp8_amax_update(amax, bf16_to_float(group_in[i]));
    const Fp8GroupScale group_scale = fp8_group_scale(amax, round_scale);
    uint8_t* group_out = fp8_out + static_cast<size_t>(group_idx) * kFp8GroupSize;
    for (int i = 0; i < kFp8GroupSize; ++i)
      group_out[i] = fp8_quantize_value(bf16_to_float(group_in[i]), group_scale);
    scales_out[group_idx] = group_scale.scale;
  }
}

}  // namespace epx
