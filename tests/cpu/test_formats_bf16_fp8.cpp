#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <vector>

#include "epx/error.hpp"
#include "formats/bf16.hpp"
#include "formats/fp8.hpp"

namespace {

using epx::bf16_to_float;
using epx::bits_as_float;
using epx::e4m3_to_float;
using epx::float_as_bits;
using epx::float_to_bf16;
using epx::float_to_e4m3;

bool is_nan(float x) {
  return std::isnan(x);
}

// A float drawn from a mix of distributions that reach every interesting range: uniform bit patterns,
// log-uniform magnitudes around the e4m3 range, and plain uniform values.
float random_float(std::mt19937& rng) {
  switch (rng() % 3) {
    case 0:
      return bits_as_float(static_cast<uint32_t>(rng()));
    case 1: {
      std::uniform_real_distribution<float> log2_dist(-14.0f, 10.0f);
      const float magnitude = std::exp2(log2_dist(rng));
      return (rng() & 1u) != 0u ? -magnitude : magnitude;
    }
    default:
      return std::uniform_real_distribution<float>(-500.0f, 500.0f)(rng);
  }
}

// ---------------------------------------------------------------------------------------------------
// BF16
// ---------------------------------------------------------------------------------------------------

// Slow reference: the nearer of the two BF16 neighbours in double precision, ties to the even pattern.
// The pattern above the largest finite BF16 counts as 2^128 (IEEE overflow rule for round to nearest).
uint16_t bf16_reference(float x) {
  if (std::isnan(x)) return epx::kBf16CanonicalNan;
  const uint32_t bits = float_as_bits(x);
  const uint16_t lower = static_cast<uint16_t>(bits >> 16);
  const uint16_t upper = static_cast<uint16_t>(lower + 1);
  auto magnitude = [](uint16_t pattern) {
    if ((pattern & 0x7FFFu) == 0x7F80u) return std::ldexp(1.0, 128);
    return std::fabs(static_cast<double>(bf16_to_float(pattern)));
  };
  if ((bits & 0xFFFFu) == 0u) return lower;
  const double abs_x = std::fabs(static_cast<double>(x));
  const double lower_error = abs_x - magnitude(lower);
  const double upper_error = magnitude(upper) - abs_x;
  if (lower_error < upper_error) return lower;
  if (upper_error < lower_error) return upper;
  return (lower & 1u) == 0u ? lower : upper;
}

TEST(FormatsBf16, EveryPatternRoundTrips) {
  for (uint32_t pattern = 0; pattern <= 0xFFFFu; ++pattern) {
    const float x = bf16_to_float(static_cast<uint16_t>(pattern));
    EXPECT_EQ(float_as_bits(x), pattern << 16);
    const uint16_t expected = is_nan(x) ? epx::kBf16CanonicalNan : static_cast<uint16_t>(pattern);
    ASSERT_EQ(float_to_bf16(x), expected) << "pattern " << pattern;
  }
}

// The combine's one-term sum (a node partial of one row) is the reference's rounding of that row alone.
TEST(FormatsBf16, OneTermSumIsTheRoundedSumOfOneTerm) {
  for (uint32_t pattern = 0; pattern <= 0xFFFFu; ++pattern) {
    const auto bits = static_cast<uint16_t>(pattern);
    ASSERT_EQ(epx::bf16_one_term_sum(bits), float_to_bf16(-0.0f + bf16_to_float(bits)))
        << "pattern " << pattern;
  }
}

TEST(FormatsBf16, MatchesNearestEvenReference) {
  std::mt19937 rng(1234);
  for (int i = 0; i < 200000; ++i) {
    const float x = random_float(rng);
    ASSERT_EQ(float_to_bf16(x), bf16_reference(x)) << "x bits " << std::hex << float_as_bits(x);
  }
}

TEST(FormatsBf16, MidpointsRoundToEven) {
  for (uint32_t pattern = 0; pattern < 0x7F7Fu; pattern += 7) {
    const float midpoint = bits_as_float((pattern << 16) | 0x8000u);
    const uint16_t even = static_cast<uint16_t>((pattern & 1u) == 0u ? pattern : pattern + 1);
    ASSERT_EQ(float_to_bf16(midpoint), even);
    ASSERT_EQ(float_to_bf16(-midpoint), even | 0x8000u);
    ASSERT_EQ(float_to_bf16(bits_as_float((pattern << 16) | 0x7FFFu)), pattern);
    ASSERT_EQ(float_to_bf16(bits_as_float((pattern << 16) | 0x8001u)), pattern + 1);
  }
}

TEST(FormatsBf16, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(float_to_bf16(inf), 0x7F80u);
  EXPECT_EQ(float_to_bf16(-inf), 0xFF80u);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7F80u);  // rounds past the largest BF16
  EXPECT_EQ(float_to_bf16(-0.0f), 0x8000u);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::quiet_NaN()), 0x7FFFu);
  EXPECT_EQ(float_to_bf16(bits_as_float(0x7F800001u)), 0x7FFFu);  // signalling NaN becomes quiet
  EXPECT_EQ(float_to_bf16(bits_as_float(0xFFC00000u)), 0x7FFFu);  // NaN sign dropped, as CUDA does
  EXPECT_EQ(float_to_bf16(bits_as_float(0x00018000u)), 0x0002u);  // subnormal tie to even
  EXPECT_EQ(float_to_bf16(1.0f), 0x3F80u);
}

TEST(FormatsBf16, DirectedRoundingEnclosesValue) {
  std::mt19937 rng(99);
  std::uniform_real_distribution<float> dist(0.0f, 1.0f);
  for (int i = 0; i < 10000; ++i) {
    const float x = dist(rng);
    const float up = bf16_to_float(epx::float_to_bf16_round_up(x));
    const float down = bf16_to_float(epx::float_to_bf16_round_down(x));
    ASSERT_LE(down, x);
    ASSERT_GE(up, x);
    ASSERT_LE(up - down, std::ldexp(std::fabs(x), -7));
    if (float_as_bits(x) % 0x10000u == 0u) {
      ASSERT_EQ(up, down);
    }
  }
  EXPECT_EQ(epx::float_to_bf16_round_up(0.5f), 0x3F00u);
  EXPECT_EQ(epx::float_to_bf16_round_down(0.5f), 0x3F00u);
}

// ---------------------------------------------------------------------------------------------------
// FP8 e4m3
// ---------------------------------------------------------------------------------------------------

// Slow reference: saturate, else scan all 127 non-negative finite codes for the nearest one (ties to
// the even code, i.e. the even mantissa).
uint8_t e4m3_reference(float x) {
  if (std::isnan(x)) return 0x7F;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const double abs_x = std::fabs(static_cast<double>(x));
  if (abs_x > 448.0) return sign | 0x7E;
  int best = 0;
  double best_error = std::numeric_limits<double>::infinity();
  for (int code = 0; code <= 0x7E; ++code) {
    const double error = std::fabs(abs_x - e4m3_to_float(static_cast<uint8_t>(code)));
    if (error < best_error || (error == best_error && (code & 1) == 0)) {
      best = code;
      best_error = error;
    }
  }
  return static_cast<uint8_t>(sign | best);
}

TEST(FormatsE4m3, DecodesKnownValues) {
  EXPECT_EQ(e4m3_to_float(0x00), 0.0f);
  EXPECT_TRUE(std::signbit(e4m3_to_float(0x80)));
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_float(0x07), 7.0f * std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_float(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_float(0x3C), 1.5f);
  EXPECT_EQ(e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_float(0xFE), -448.0f);
  EXPECT_TRUE(is_nan(e4m3_to_float(0x7F)));
  EXPECT_TRUE(is_nan(e4m3_to_float(0xFF)));
}

TEST(FormatsE4m3, EveryCodeRoundTrips) {
  for (int code = 0; code < 256; ++code) {
    const float x = e4m3_to_float(static_cast<uint8_t>(code));
    // Policy: both NaN codes encode back to the positive NaN 0x7F; -0 (0x80) stays -0.
    const uint8_t expected = (code & 0x7F) == 0x7F ? 0x7F : static_cast<uint8_t>(code);
    ASSERT_EQ(float_to_e4m3(x), expected) << "code " << code;
  }
}

TEST(FormatsE4m3, DecodedValuesAreSortedAndDistinct) {
  for (int code = 0; code < 0x7E; ++code)
    ASSERT_LT(e4m3_to_float(static_cast<uint8_t>(code)), e4m3_to_float(static_cast<uint8_t>(code + 1)));
}

TEST(FormatsE4m3, MidpointsRoundToEven) {
  for (int code = 0; code < 0x7E; ++code) {
    const float lower = e4m3_to_float(static_cast<uint8_t>(code));
    const float upper = e4m3_to_float(static_cast<uint8_t>(code + 1));
    const float midpoint = (lower + upper) * 0.5f;  // exact: 4 significant bits
    ASSERT_EQ(static_cast<double>(midpoint), (static_cast<double>(lower) + upper) / 2.0);
    const uint8_t even = static_cast<uint8_t>((code & 1) == 0 ? code : code + 1);
    ASSERT_EQ(float_to_e4m3(midpoint), even) << "code " << code;
    ASSERT_EQ(float_to_e4m3(-midpoint), even | 0x80) << "code " << code;
    ASSERT_EQ(float_to_e4m3(std::nextafter(midpoint, 0.0f)), code);
    ASSERT_EQ(float_to_e4m3(std::nextafter(midpoint, 1000.0f)), code + 1);
  }
}

TEST(FormatsE4m3, SaturatesLikeSatfinite) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(float_to_e4m3(448.0f), 0x7E);
  EXPECT_EQ(float_to_e4m3(463.99997f), 0x7E);
  EXPECT_EQ(float_to_e4m3(464.0f), 0x7E);  // midpoint to the (NaN) pattern above: even, and saturated
  EXPECT_EQ(float_to_e4m3(480.0f), 0x7E);
  EXPECT_EQ(float_to_e4m3(1e30f), 0x7E);
  EXPECT_EQ(float_to_e4m3(std::numeric_limits<float>::max()), 0x7E);
  EXPECT_EQ(float_to_e4m3(inf), 0x7E);
  EXPECT_EQ(float_to_e4m3(-inf), 0xFE);
  EXPECT_EQ(float_to_e4m3(-1e30f), 0xFE);
  EXPECT_EQ(float_to_e4m3(std::numeric_limits<float>::quiet_NaN()), 0x7F);
  EXPECT_EQ(float_to_e4m3(bits_as_float(0xFFC00001u)), 0x7F);  // negative NaN -> positive NaN code
  EXPECT_EQ(float_to_e4m3(bits_as_float(0x7F800001u)), 0x7F);
}

TEST(FormatsE4m3, TinyValues) {
  const float half_min_subnormal = std::ldexp(1.0f, -10);
  EXPECT_EQ(float_to_e4m3(half_min_subnormal), 0x00);  // tie between 0 and 2^-9: even
  EXPECT_EQ(float_to_e4m3(std::nextafter(half_min_subnormal, 1.0f)), 0x01);
  EXPECT_EQ(float_to_e4m3(-std::nextafter(half_min_subnormal, 1.0f)), 0x81);
  EXPECT_EQ(float_to_e4m3(-1e-30f), 0x80);  // sign kept on underflow, as CUDA does
  EXPECT_EQ(float_to_e4m3(std::numeric_limits<float>::denorm_min()), 0x00);
  EXPECT_EQ(float_to_e4m3(-std::numeric_limits<float>::denorm_min()), 0x80);
  EXPECT_EQ(float_to_e4m3(-0.0f), 0x80);
  EXPECT_EQ(float_to_e4m3(15.5f * std::ldexp(1.0f, -10)), 0x08);  // rounds up into the normal range
}

TEST(FormatsE4m3, MatchesScanningReferenceOnRandomFloats) {
  std::mt19937 rng(42);
  for (int i = 0; i < 100000; ++i) {
    const float x = random_float(rng);
    ASSERT_EQ(float_to_e4m3(x), e4m3_reference(x)) << "x = " << x << " bits " << std::hex << float_as_bits(x);
  }
}

// ---------------------------------------------------------------------------------------------------
// Group scales and UE8M0
// ---------------------------------------------------------------------------------------------------

bool is_pow2(float x) {
  return x > 0.0f && (float_as_bits(x) & 0x7FFFFFu) == 0u;
}

TEST(FormatsFp8Scale, AmaxIsFloored) {
  const float floor_scale = epx::kFp8AmaxFloor / epx::kE4m3Max;
  EXPECT_EQ(epx::fp8_group_scale(0.0f, false).scale, floor_scale);
  EXPECT_EQ(epx::fp8_group_scale(1e-9f, false).scale, floor_scale);
  EXPECT_EQ(epx::fp8_group_scale(-5.0f, false).scale, floor_scale);
  EXPECT_EQ(epx::fp8_group_scale(std::numeric_limits<float>::quiet_NaN(), false).scale, floor_scale);
  EXPECT_EQ(epx::fp8_group_scale(0.0f, false).inv_scale, epx::kE4m3Max / epx::kFp8AmaxFloor);
  EXPECT_EQ(epx::fp8_group_scale(2.0f, false).scale, 2.0f / 448.0f);
  EXPECT_EQ(epx::fp8_group_scale(2.0f, false).inv_scale, 448.0f / 2.0f);
}

TEST(FormatsFp8Scale, AmaxUpdateIgnoresEveryNan) {
  EXPECT_EQ(epx::fp8_amax_update(0.5f, -2.0f), 2.0f);
  EXPECT_EQ(epx::fp8_amax_update(0.5f, 0.25f), 0.5f);
  EXPECT_EQ(epx::fp8_amax_update(0.5f, std::numeric_limits<float>::quiet_NaN()), 0.5f);
  EXPECT_EQ(epx::fp8_amax_update(0.5f, std::numeric_limits<float>::signaling_NaN()), 0.5f);
  EXPECT_EQ(epx::fp8_amax_update(0.5f, -std::numeric_limits<float>::infinity()),
            std::numeric_limits<float>::infinity());
  const float floor_scale = epx::kFp8AmaxFloor / epx::kE4m3Max;
  EXPECT_EQ(epx::fp8_group_scale(std::numeric_limits<float>::signaling_NaN(), false).scale, floor_scale);
  EXPECT_EQ(epx::fp8_group_scale(std::numeric_limits<float>::infinity(), false).scale,
            std::numeric_limits<float>::max() / 448.0f);
  EXPECT_EQ(epx::fp8_group_scale(std::numeric_limits<float>::infinity(), true).scale, std::ldexp(1.0f, 120));
}

TEST(FormatsFp8Scale, RoundScaleIsNextPowerOfTwoWithExactInverse) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> log2_dist(-20.0f, 60.0f);
  for (int i = 0; i < 20000; ++i) {
    const float amax = std::exp2(log2_dist(rng));
    const epx::Fp8GroupScale rounded = epx::fp8_group_scale(amax, true);
    const float plain_scale = epx::fp8_group_scale(amax, false).scale;
    ASSERT_TRUE(is_pow2(rounded.scale)) << amax;
    ASSERT_GE(rounded.scale, plain_scale);
    ASSERT_LT(rounded.scale * 0.5f, plain_scale);
    ASSERT_EQ(rounded.scale * rounded.inv_scale, 1.0f);
    ASSERT_TRUE(is_pow2(rounded.inv_scale));
  }
  for (int e = -22; e <= 100; ++e) {  // an exact power of two stays itself
    const epx::Fp8GroupScale rounded = epx::fp8_group_scale(448.0f * std::ldexp(1.0f, e), true);
    ASSERT_EQ(rounded.scale, std::ldexp(1.0f, e));
    ASSERT_EQ(rounded.inv_scale, std::ldexp(1.0f, -e));
  }
  EXPECT_EQ(epx::fp8_group_scale(0.0f, true).scale, std::ldexp(1.0f, -22));  // 1e-4/448 ~ 2^-22.07
}

TEST(FormatsUe8m0, BytesArePowerOfTwoExponents) {
  for (int e = -126; e <= 127; ++e) {
    const float scale = std::ldexp(1.0f, e);
    const uint8_t byte = epx::ue8m0_from_pow2_scale(scale);
    ASSERT_EQ(byte, e + 127);
    ASSERT_EQ(epx::pow2_scale_from_ue8m0(byte), scale);
  }
  EXPECT_EQ(epx::ue8m0_from_pow2_scale(std::ldexp(1.0f, -127)), 0);
  EXPECT_EQ(epx::pow2_scale_from_ue8m0(0), std::ldexp(1.0f, -127));
  EXPECT_TRUE(is_nan(epx::pow2_scale_from_ue8m0(0xFF)));
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> log2_dist(-20.0f, 40.0f);
  for (int i = 0; i < 1000; ++i) {
    const float scale = epx::fp8_group_scale(std::exp2(log2_dist(rng)), true).scale;
    ASSERT_EQ(epx::pow2_scale_from_ue8m0(epx::ue8m0_from_pow2_scale(scale)), scale);
  }
}

TEST(FormatsUe8m0, PacksFourGroupsLowByteFirst) {
  EXPECT_EQ(epx::pack_ue8m0x4(0x01, 0x02, 0x03, 0x04), 0x04030201u);
  EXPECT_EQ(epx::pack_ue8m0x4(0xFE, 0x00, 0x7F, 0x80), 0x807F00FEu);
  const uint32_t word = epx::pack_ue8m0x4(10, 20, 30, 40);
  EXPECT_EQ(epx::unpack_ue8m0x4(word, 0), 10);
  EXPECT_EQ(epx::unpack_ue8m0x4(word, 1), 20);
  EXPECT_EQ(epx::unpack_ue8m0x4(word, 2), 30);
  EXPECT_EQ(epx::unpack_ue8m0x4(word, 3), 40);
  // In memory on a little-endian machine, byte j of word i is group 4i + j.
  uint8_t bytes[4];
  std::memcpy(bytes, &word, 4);
  EXPECT_EQ(bytes[0], 10);
  EXPECT_EQ(bytes[3], 40);
}

// ---------------------------------------------------------------------------------------------------
// Row quantization
// ---------------------------------------------------------------------------------------------------

// Fills one group of 128 BF16 values in a style chosen by `kind`.
void fill_group(std::mt19937& rng, int kind, uint16_t* group) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> log2_dist(-30.0f, 30.0f);
  const float constant = normal(rng);
  for (int i = 0; i < epx::kFp8GroupSize; ++i) {
    float x = 0.0f;
    switch (kind) {
      case 0:
        x = normal(rng);
        break;  // typical
      case 1:
        x = (rng() & 1u ? -1.0f : 1.0f) * std::exp2(log2_dist(rng));
        break;  // wide range
      case 2:
        x = constant;
        break;  // all equal
      case 3:
        x = 0.0f;
        break;  // zeros
      case 4:
        x = normal(rng) * 1e-39f;
        break;  // BF16 subnormals
      case 5:
        x = normal(rng) * 1e37f;
        break;  // near the top
      case 6:
        x = i == 17 ? 3e4f : normal(rng) * 1e-3f;
        break;  // one outlier
      // Huge, below the amax where round_scale dequantization can overflow (see RoundScaleNearFloatMax).
      default:
        x = bf16_to_float(static_cast<uint16_t>(0x7F3Fu | (rng() & 1u ? 0x8000u : 0u)));
    }
    group[i] = float_to_bf16(x);
  }
}

// The bound stated in fp8.hpp: exact with round_scale, plus a few float roundings without it.
double fp8_error_bound(float x, float scale, bool round_scale) {
  const double abs_x = std::fabs(static_cast<double>(x));
  double bound = std::ldexp(abs_x, -4) + std::ldexp(static_cast<double>(scale), -10);
  if (!round_scale) bound += std::ldexp(abs_x, -21) + std::ldexp(static_cast<double>(scale), -30);
  return bound;
}

TEST(FormatsFp8Row, DequantizationErrorWithinBound) {
  constexpr int kNumKinds = 8;
  const int hidden = kNumKinds * 4 * epx::kFp8GroupSize;
  std::mt19937 rng(2024);
  std::vector<uint16_t> row(hidden);
  for (int g = 0; g < hidden / epx::kFp8GroupSize; ++g)
    fill_group(rng, g % kNumKinds, &row[g * epx::kFp8GroupSize]);
  for (const bool round_scale : {false, true}) {
    std::vector<uint8_t> codes(hidden);
    std::vector<float> scales(hidden / epx::kFp8GroupSize);
    epx::quantize_fp8_row(row.data(), hidden, round_scale, codes.data(), scales.data());
    double worst_ratio = 0.0;
    for (int g = 0; g < hidden / epx::kFp8GroupSize; ++g) {
      float amax = 0.0f;
      for (int i = 0; i < epx::kFp8GroupSize; ++i)
        amax = std::fmax(amax, std::fabs(bf16_to_float(row[g * epx::kFp8GroupSize + i])));
      ASSERT_EQ(amax, [&] {
        float reduced = 0.0f;  // the reduction a kernel does, in another order
        for (int i = epx::kFp8GroupSize - 1; i >= 0; --i)
          reduced = epx::fp8_amax_update(reduced, bf16_to_float(row[g * epx::kFp8GroupSize + i]));
        return reduced;
      }());
      const epx::Fp8GroupScale group_scale = epx::fp8_group_scale(amax, round_scale);
      ASSERT_EQ(scales[g], group_scale.scale);
      for (int i = 0; i < epx::kFp8GroupSize; ++i) {
        const int idx = g * epx::kFp8GroupSize + i;
        const float x = bf16_to_float(row[idx]);
        ASSERT_EQ(codes[idx], float_to_e4m3(x * group_scale.inv_scale));
        const float dequantized = e4m3_to_float(codes[idx]) * scales[g];
        const double error = std::fabs(static_cast<double>(x) - dequantized);
        const double bound = fp8_error_bound(x, scales[g], round_scale);
        ASSERT_LE(error, bound) << "group " << g << " kind " << g % kNumKinds << " x " << x;
        // The group-level form: nothing worse than amax/16 (plus the subnormal term).
        ASSERT_LE(error,
                  std::ldexp(static_cast<double>(std::fmax(amax, epx::kFp8AmaxFloor)), -4) * (1 + 1e-6) +
                      std::ldexp(static_cast<double>(scales[g]), -10));
        if (bound > 0) worst_ratio = std::fmax(worst_ratio, error / bound);
      }
    }
    EXPECT_GT(worst_ratio, 0.5) << "bound is far from tight; the test data misses the worst case";
  }
}

TEST(FormatsFp8Row, SpecialGroups) {
  const int hidden = 4 * epx::kFp8GroupSize;
  std::vector<uint16_t> row(hidden, 0);
  for (int i = 0; i < epx::kFp8GroupSize; ++i) row[i] = float_to_bf16(i % 2 == 0 ? 0.75f : -0.75f);  // equal
  // group 1 stays zero
  for (int i = 0; i < epx::kFp8GroupSize; ++i) row[2 * epx::kFp8GroupSize + i] = float_to_bf16(0.5f);
  row[2 * epx::kFp8GroupSize + 3] = epx::kBf16CanonicalNan;
  row[2 * epx::kFp8GroupSize + 9] = 0xFF81u;  // signalling NaN: ignored too (glibc fmaxf would not)
  for (int i = 0; i < epx::kFp8GroupSize; ++i) row[3 * epx::kFp8GroupSize + i] = float_to_bf16(2.0f);
  row[3 * epx::kFp8GroupSize + 5] = 0xFF80u;  // -Inf
  for (const bool round_scale : {false, true}) {
    std::vector<uint8_t> codes(hidden);
    std::vector<float> scales(4);
    epx::quantize_fp8_row(row.data(), hidden, round_scale, codes.data(), scales.data());
    // All-equal group: the amax value itself maps to the top of the range (exactly 448 without rounding).
    const uint8_t top = round_scale ? float_to_e4m3(0.75f / scales[0]) : 0x7E;
    EXPECT_EQ(codes[0], top);
    EXPECT_EQ(codes[1], top | 0x80);
    EXPECT_NEAR(e4m3_to_float(codes[0]) * scales[0], 0.75f, 0.75 / 16);
    // Zero group: floored amax, zero codes.
    EXPECT_EQ(scales[1], epx::fp8_group_scale(epx::kFp8AmaxFloor, round_scale).scale);
    for (int i = 0; i < epx::kFp8GroupSize; ++i) EXPECT_EQ(codes[epx::kFp8GroupSize + i], 0x00);
    // NaN is ignored by the amax and becomes the NaN code; its neighbours are unaffected.
    EXPECT_EQ(scales[2], epx::fp8_group_scale(0.5f, round_scale).scale);
    EXPECT_EQ(codes[2 * epx::kFp8GroupSize + 3], 0x7F);
    EXPECT_EQ(codes[2 * epx::kFp8GroupSize + 9], 0x7F);
    EXPECT_FLOAT_EQ(e4m3_to_float(codes[2 * epx::kFp8GroupSize + 4]) * scales[2], 0.5f);
    // Inf clamps amax to FLT_MAX: the scale stays finite, Inf saturates, finite neighbours become 0.
    EXPECT_TRUE(std::isfinite(scales[3]));
    EXPECT_EQ(codes[3 * epx::kFp8GroupSize + 5], 0xFE);
    EXPECT_EQ(codes[3 * epx::kFp8GroupSize + 6], 0x00);
    EXPECT_LE(e4m3_to_float(0xFE) * scales[3], -0.99f * std::numeric_limits<float>::max());
  }
}

TEST(FormatsFp8Row, RoundScaleNearFloatMax) {
  // The largest BF16 (~3.39e38) with round_scale: scale 2^120, x * inv_scale = 255 rounds to 256, and
  // 256 * 2^120 = 2^128 overflows: the documented exception to the error bound (amax > 1.75 * 2^127).
  std::vector<uint16_t> row(epx::kFp8GroupSize, 0x7F7Fu);
  std::vector<uint8_t> codes(epx::kFp8GroupSize);
  float scale = 0.0f;
  epx::quantize_fp8_row(row.data(), epx::kFp8GroupSize, true, codes.data(), &scale);
  EXPECT_EQ(scale, std::ldexp(1.0f, 120));
  EXPECT_TRUE(std::isinf(e4m3_to_float(codes[0]) * scale));
  epx::quantize_fp8_row(row.data(), epx::kFp8GroupSize, false, codes.data(), &scale);
  EXPECT_EQ(codes[0], 0x7E);
  EXPECT_FLOAT_EQ(e4m3_to_float(codes[0]) * scale, bf16_to_float(0x7F7Fu));
}

TEST(FormatsFp8Row, RejectsHiddenNotMultipleOfGroup) {
  std::vector<uint16_t> row(200, 0);
  std::vector<uint8_t> codes(200);
  std::vector<float> scales(2);
  EXPECT_THROW(epx::quantize_fp8_row(row.data(), 200, false, codes.data(), scales.data()), epx::Error);
  EXPECT_THROW(epx::quantize_fp8_row(row.data(), -128, false, codes.data(), scales.data()), epx::Error);
  EXPECT_NO_THROW(epx::quantize_fp8_row(row.data(), 0, false, codes.data(), scales.data()));
}

TEST(FormatsFp8Layout, LowLatencyScaleIndexIsColumnMajorPerExpert) {
  const int num_experts = 3, num_rows = 5, num_groups = 4;
  std::set<size_t> seen;
  for (int e = 0; e < num_experts; ++e) {
    for (int r = 0; r < num_rows; ++r) {
      for (int g = 0; g < num_groups; ++g) {
        const size_t idx = epx::ll_scale_index(e, r, g, num_rows, num_groups);
        EXPECT_EQ(idx, static_cast<size_t>(e * num_groups * num_rows + g * num_rows + r));
        seen.insert(idx);
      }
    }
  }
  EXPECT_EQ(seen.size(), static_cast<size_t>(num_experts * num_rows * num_groups));
  EXPECT_EQ(*seen.rbegin(), static_cast<size_t>(num_experts * num_rows * num_groups - 1));
  // Rows of one group are contiguous; groups are num_rows apart.
  EXPECT_EQ(epx::ll_scale_index(1, 3, 2, num_rows, num_groups) + 1,
            epx::ll_scale_index(1, 4, 2, num_rows, num_groups));
  EXPECT_EQ(epx::ll_scale_index(1, 3, 2, num_rows, num_groups) + num_rows,
            epx::ll_scale_index(1, 3, 3, num_rows, num_groups));
  // Large shapes do not overflow int arithmetic.
  EXPECT_EQ(epx::ll_scale_index(255, 0, 0, 1 << 20, 1 << 10), static_cast<size_t>(255) << 30);
}

}  // namespace
