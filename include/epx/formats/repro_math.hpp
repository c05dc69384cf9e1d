#pragma once

#include <cmath>
#include <cstdint>

#include "epx/common/host_device.hpp"
#include "epx/formats/bits.hpp"

// log2 / exp2 that give the same bits on every host and GPU, for LogFMT's levels.
//
// Library log2f/exp2f differ between glibc and CUDA in the last ulp, and a LogFMT level that decodes
// differently on the two sides would break bit-exact tests. These use only IEEE-exact operations
// (+, -, *, /, fmaf, rintf, integer ops), so the result is fully determined. Two rules keep it so:
// - every multiply whose result feeds an add is written as fmaf: compilers may contract a*b+c into an
//   FMA (nvcc does by default, GCC with -ffp-contract=fast on FMA hardware), which changes the rounding;
// - no fast-math: --use_fast_math / -ffast-math (flush-to-zero, approximate division) would break it.
// Accuracy (a few float ulps) matters less than determinism: encoder and decoder evaluate the same code.

namespace epx::detail {

// log2(x) = exponent + fraction with fraction = log2(m), m in [sqrt(1/2), sqrt(2)), so fraction is in
// [-1/2, 1/2] and keeps full precision however large the exponent is.
struct Log2Split {
  int exponent;
  float fraction;
};

// Precondition: x > 0 and finite (float subnormals allowed).
EPX_HD Log2Split repro_log2_split(float x) {
  uint32_t bits = float_as_bits(x);
  int exponent = -127;
  if ((bits >> 23) == 0u) {  // subnormal: scale by 2^24 (exact) first
    bits = float_as_bits(x * 16777216.0f);
    exponent -= 24;
  }
  exponent += static_cast<int>(bits >> 23);
  float m = bits_as_float((bits & 0x7FFFFFu) | 0x3F800000u);  // [1, 2)
  if (m > 1.41421354f) {
    m = m * 0.5f;
    exponent += 1;
  }
  // log2(m) = (2/ln2) * atanh(s), s = (m-1)/(m+1), |s| <= 0.1716: the odd series to s^9 leaves < 1e-9.
  // m - 1 is exact (Sterbenz).
  const float s = (m - 1.0f) / (m + 1.0f);
  const float s2 = s * s;
  const float s3 = s * s2;
  float series = fmaf(0.320598900f, s2, 0.412198573f);       // 2/(9 ln2), 2/(7 ln2)
  series = fmaf(series, s2, 0.577078044f);                   // 2/(5 ln2)
  series = fmaf(series, s2, 0.961796701f);                   // 2/(3 ln2)
  const float fraction = fmaf(s3, series, s * 2.88539004f);  // 2/ln2
  return Log2Split{exponent, fraction};
}

// 2^f for |f| <= 0.5 (a little beyond is fine): Taylor series of e^(f ln2) to degree 7, error < 1e-8.
EPX_HD float repro_exp2_reduced(float f) {
  float p = fmaf(1.52527336e-05f, f, 1.54035297e-04f);  // ln2^7/7!, ln2^6/6!
  p = fmaf(p, f, 1.33335579e-03f);
  p = fmaf(p, f, 9.61812865e-03f);
  p = fmaf(p, f, 5.55041097e-02f);
  p = fmaf(p, f, 2.40226507e-01f);
  p = fmaf(p, f, 6.93147182e-01f);
  return fmaf(p, f, 1.0f);
}

// x * 2^e for a positive normal x, rounded to nearest even when the result is subnormal. Integer-only,
// so no compiler can fuse it into a neighbouring add.
EPX_HD float scale_by_pow2(float x, int e) {
  const uint32_t bits = float_as_bits(x);
  const int exp_field = static_cast<int>(bits >> 23) + e;
  if (exp_field >= 255) return bits_as_float(0x7F800000u);
  if (exp_field >= 1) return bits_as_float((bits & 0x7FFFFFu) | (static_cast<uint32_t>(exp_field) << 23));
  const int shift = 1 - exp_field;  // >= 1
  if (shift > 24) return 0.0f;      // below half the smallest subnormal
  const uint32_t significand = (bits & 0x7FFFFFu) | 0x800000u;
  uint32_t result = significand >> shift;
  const uint32_t remainder = significand & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (remainder > half || (remainder == half && (result & 1u) != 0u)) ++result;
  return bits_as_float(result);  // a carry into bit 23 is the smallest normal, which is right
}

// 2^(exponent + t) for t in [-33, 1]: t splits exactly into an integer and a fraction in [-1/2, 1/2].
EPX_HD float repro_exp2_split(int exponent, float t) {
  const float n = rintf(t);
  const float f = t - n;  // exact: n is t's nearest integer and |t| < 2^6
  return scale_by_pow2(repro_exp2_reduced(f), exponent + static_cast<int>(n));
}

}  // namespace epx::detail
