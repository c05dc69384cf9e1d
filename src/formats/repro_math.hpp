#pragma once

#include <cmath>
#include <cstdint>

#include "common/host_device.hpp"
#include "formats/bits.hpp"

// log2 / exp2 that give the same bits on every host and GPU, for LogFMT's levels.
//
// Library log2f/exp2f differ between glibc and CUDA in the last ulp, and a LogFMT level that decodes
// differently on the two sides would break bit-exact tests. These use only IEEE-exact operations
// (+, -, *, /, fmaf, integer ops), so the result is fully determined. Two rules keep it so:
// - every multiply whose result feeds an add is written as fmaf: compilers may contract a*b+c into an
//   FMA (nvcc does by default, GCC with -ffp-contract=fast on FMA hardware), which changes the rounding;
// - no fast-math: --use_fast_math / -ffast-math (flush-to-zero, approximate division, reassociation that
//   folds (t + c) - c to t) would break it.
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

// Integer <-> float steps with float adds and integer ops only: a GPU converts between int and float, or
// rounds a float to an integer, at 16 per clock and SM, against 128 adds. 1.5 * 2^23 (bits 0x4B400000) has
// an ulp of 1 and keeps that ulp within +-2^22 of it.
constexpr float kRoundShift = 12582912.0f;
constexpr int kRoundShiftBits = 0x4B400000;

// t rounded to the nearest integer, ties to even (the float add rounds so in the default mode), as a float
// and as an int. Precondition: |t| < 2^22.
struct RoundedToInt {
  float value;
  int integer;
};
EPX_HD RoundedToInt round_to_int(float t) {
  const float shifted = t + kRoundShift;
  return {shifted - kRoundShift, static_cast<int>(float_as_bits(shifted)) - kRoundShiftBits};
}

// The largest integer <= t. Precondition: |t| < 2^22.
EPX_HD RoundedToInt floor_to_int(float t) {
  const RoundedToInt nearest = round_to_int(t);
  return nearest.value > t ? RoundedToInt{nearest.value - 1.0f, nearest.integer - 1} : nearest;
}

// float(k), exactly. Precondition: |k| < 2^22.
EPX_HD float small_int_to_float(int k) {
  return bits_as_float(static_cast<uint32_t>(kRoundShiftBits + k)) - kRoundShift;
}

// x * 2^e for x in [1/2, 2) and e in [-250, 250], rounded to nearest even when the result is subnormal (and
// Inf past the float range): two multiplies by powers of two, the first exact (x * 2^(e/2) stays normal),
// so only the second rounds. No branch, so a GPU can overlap several values' evaluations.
EPX_HD float scale_by_pow2(float x, int e) {
  const int first = e >> 1;      // floor(e / 2) (an arithmetic shift in C++20)
  const int second = e - first;  // both in [-125, 125]: 2^first and 2^second are normal floats
  const float scaled = x * bits_as_float(static_cast<uint32_t>(first + 127) << 23);
  // An fmaf with a zero addend rounds the product once, as a multiply would, but no compiler contracts it
  // into an add that follows (a caller's midpoint of two levels, say).
  return fmaf(scaled, bits_as_float(static_cast<uint32_t>(second + 127) << 23), 0.0f);
}

// 2^(exponent + t) for t in [-33, 1] and exponent + t in [-240, 240]: t splits exactly into an integer and a
// fraction in [-1/2, 1/2].
EPX_HD float repro_exp2_split(int exponent, float t) {
  const RoundedToInt n = round_to_int(t);
  const float f = t - n.value;  // exact: n is t's nearest integer and |t| < 2^6
  return scale_by_pow2(repro_exp2_reduced(f), exponent + n.integer);
}

}  // namespace epx::detail
