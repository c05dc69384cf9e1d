#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "formats/bf16.hpp"
#include "formats/logfmt.hpp"

namespace {

using epx::bf16_to_float;
using epx::bits_as_float;
using epx::float_as_bits;
using epx::float_to_bf16;
using epx::kLogfmtGroupSize;
using epx::kLogfmtMaxLevel;
using epx::LogfmtParams;

constexpr int kNumLevels = kLogfmtMaxLevel + 1;

// Independent reader of the payload bit stream: code i is bits [10i, 10i + 10), bit b in byte b / 8.
uint16_t read_code_bitwise(const uint8_t* payload, int code_idx) {
  uint16_t code = 0;
  for (int bit = 0; bit < epx::kLogfmtCodeBits; ++bit) {
    const int stream_bit = code_idx * epx::kLogfmtCodeBits + bit;
    code |= static_cast<uint16_t>(((payload[stream_bit / 8] >> (stream_bit % 8)) & 1u) << bit);
  }
  return code;
}

std::vector<float> all_levels(const LogfmtParams& params) {
  std::vector<float> levels(kNumLevels);
  for (int k = 0; k < kNumLevels; ++k) levels[k] = epx::logfmt_level(k, params);
  return levels;
}

// Reference encoder: scan the levels upward while |x| reaches the float midpoint to the next one (the
// rule of logfmt.hpp: nearest in the linear domain, ties to the larger level).
uint16_t reference_encode(float x, const std::vector<float>& levels) {
  const float abs_x = std::fabs(x);
  int level = 0;
  while (level < kLogfmtMaxLevel && abs_x >= (levels[level] + levels[level + 1]) * 0.5f) ++level;
  return static_cast<uint16_t>((std::signbit(x) ? 1u << 9 : 0u) | static_cast<uint32_t>(level));
}

// Qualifying groups (every |x| < 1, finite) of several shapes. Returns BF16 patterns.
std::vector<uint16_t> make_group(std::mt19937& rng, int kind) {
  std::vector<uint16_t> group(kLogfmtGroupSize);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto signed_pow2 = [&](float lo, float hi) {
    const float magnitude = std::exp2(std::uniform_real_distribution<float>(lo, hi)(rng));
    return (rng() & 1u) != 0u ? -magnitude : magnitude;
  };
  const float level_a = signed_pow2(-8.0f, -1.0f);
  for (int i = 0; i < kLogfmtGroupSize; ++i) {
    float x = 0.0f;
    switch (kind) {
      case 0:
        x = 0.1f * normal(rng);
        break;  // typical activations
      case 1:
        x = signed_pow2(-60.0f, -1.0f);
        break;  // > 2^32 range: clipped
      case 2:
        x = signed_pow2(-1.74f, -1.69f);
        break;  // narrow range
      case 3:
        x = (rng() % 3 == 0) ? 0.0f : 0.02f * normal(rng);
        break;  // zeros inside
      case 4:
        x = signed_pow2(-125.0f, -115.0f);
        break;  // low levels subnormal
      case 5:
        x = signed_pow2(-133.0f, -127.0f);
        break;  // BF16 subnormals
      case 6:
        x = (i % 2 == 0) ? level_a : -0.5f * level_a;
        break;  // two magnitudes
      default:
        x = signed_pow2(-31.0f, -0.0057f);
        break;  // max just below 1
    }
    uint16_t bits = float_to_bf16(x);
    if ((bits & 0x7FFFu) >= 0x3F80u) bits = static_cast<uint16_t>((bits & 0x8000u) | 0x3F7Fu);  // keep < 1
    group[i] = bits;
  }
  return group;
}

constexpr int kNumGroupKinds = 8;

// A group's max and min keys: the reductions of logfmt_abs_for_max and logfmt_abs_for_min, as an encoder
// computes them.
std::pair<float, float> group_keys(const std::vector<uint16_t>& group) {
  float max_key = 0.0f, min_key = std::numeric_limits<float>::infinity();
  for (uint16_t bits : group) {
    max_key = std::fmax(max_key, epx::logfmt_abs_for_max(bf16_to_float(bits)));
    min_key = std::fmin(min_key, epx::logfmt_abs_for_min(bf16_to_float(bits)));
  }
  return {max_key, min_key};
}

// ---------------------------------------------------------------------------------------------------
// Slots, packing and metadata keys
// ---------------------------------------------------------------------------------------------------

TEST(FormatsLogfmt, SlotSizes) {
  EXPECT_EQ(epx::kLogfmtMetaBytes, 4);
  EXPECT_EQ(epx::kLogfmtCodeBytes, 160);
  EXPECT_EQ(epx::kLogfmtEncodedBytes, 164);
  EXPECT_EQ(epx::kLogfmtFallbackBytes, 260);
  EXPECT_EQ(epx::kLogfmtGroupSlotBytes, 260);
  EXPECT_EQ(epx::kLogfmtDecodeUlpTolerance, 0);
}

// A packed row (what a put carries): each group's payload right after the previous one's, inside the BF16
// row's groups up to its own (so an in-place encode writes only what it read), and F counted from the
// fallback words.
TEST(FormatsLogfmt, PackedRowsTileTheirPayloadsInsideTheInputRead) {
  std::mt19937 rng(7);
  for (const int num_groups : {1, 2, 31, 32, 33, 56, 64, 65, 100}) {
    for (const double fallback_share : {0.0, 0.1, 0.5, 1.0}) {
      std::bernoulli_distribution is_fallback(fallback_share);
      std::vector<uint32_t> words(epx::logfmt_fallback_words(num_groups), 0u);
      std::vector<bool> fallback(num_groups);
      for (int g = 0; g < num_groups; ++g) {
        fallback[g] = is_fallback(rng);
        if (fallback[g]) words[g / 32] |= 1u << (g % 32);
      }
      size_t end = 0;
      int fallbacks = 0;
      for (int g = 0; g < num_groups; ++g) {
        const int counted = epx::logfmt_fallbacks_before(g, [&](int w) { return words[w]; });
        ASSERT_EQ(counted, fallbacks) << "group " << g << " of " << num_groups;
        const size_t begin = epx::logfmt_packed_offset(g, counted);
        EXPECT_EQ(begin, end) << "group " << g;
        EXPECT_EQ(begin % 16, 0u);
        end = begin + (fallback[g] ? 2 * epx::kLogfmtGroupSize : epx::kLogfmtCodeBytes);
        EXPECT_LE(end, size_t(g + 1) * 2 * epx::kLogfmtGroupSize) << "group " << g << " passes its input";
        fallbacks += fallback[g];
      }
      EXPECT_EQ(epx::logfmt_packed_bytes(num_groups, fallbacks), end);
    }
  }
  EXPECT_EQ(epx::logfmt_packed_bytes(56, 0), 8960u);  // 0.625x the BF16 row's 14336 bytes
  EXPECT_EQ(epx::logfmt_packed_bytes(56, 56), 14336u);
}

TEST(FormatsLogfmt, PackingIsLittleEndianBitStream) {
  std::mt19937 rng(11);
  std::vector<uint16_t> codes(kLogfmtGroupSize);
  for (auto& code : codes) code = static_cast<uint16_t>(rng() & 0x3FFu);
  std::vector<uint8_t> payload(epx::kLogfmtCodeBytes, 0);
  for (int i = 0; i < kLogfmtGroupSize; i += 4)
    epx::logfmt_store_codes4(&payload[i / 4 * 5],
                             epx::logfmt_pack_codes4(codes[i], codes[i + 1], codes[i + 2], codes[i + 3]));
  for (int i = 0; i < kLogfmtGroupSize; ++i) {
    ASSERT_EQ(read_code_bitwise(payload.data(), i), codes[i]) << i;
    ASSERT_EQ(epx::logfmt_unpack_code4(epx::logfmt_load_codes4(&payload[i / 4 * 5]), i % 4), codes[i]);
  }
  EXPECT_EQ(epx::logfmt_pack_codes4(0x3FF, 0, 0, 0), 0x3FFull);
  EXPECT_EQ(epx::logfmt_pack_codes4(0, 0, 0, 0x3FF), 0x3FFull << 30);
}

TEST(FormatsLogfmt, MetadataKeys) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(epx::logfmt_abs_for_max(-0.25f), 0.25f);
  EXPECT_EQ(epx::logfmt_abs_for_max(nan), inf);
  EXPECT_EQ(epx::logfmt_abs_for_max(-inf), inf);
  EXPECT_EQ(epx::logfmt_abs_for_min(-0.25f), 0.25f);
  EXPECT_EQ(epx::logfmt_abs_for_min(0.0f), inf);
  EXPECT_EQ(epx::logfmt_abs_for_min(-0.0f), inf);
  EXPECT_EQ(epx::logfmt_abs_for_min(nan), inf);
  EXPECT_TRUE(epx::logfmt_group_qualifies(0.99609375f));
  EXPECT_FALSE(epx::logfmt_group_qualifies(1.0f));
  EXPECT_FALSE(epx::logfmt_group_qualifies(inf));
}

// ---------------------------------------------------------------------------------------------------
// Reproducible math and levels
// ---------------------------------------------------------------------------------------------------

TEST(FormatsLogfmt, ReproMathIsAccurate) {
  std::mt19937 rng(3);
  for (int i = 0; i < 20000; ++i) {
    float x = bits_as_float(static_cast<uint32_t>(rng()) & 0x7F7FFFFFu);  // positive finite
    if (x == 0.0f) continue;
    const epx::detail::Log2Split split = epx::detail::repro_log2_split(x);
    ASSERT_LE(std::fabs(split.fraction), 0.5f);
    ASSERT_NEAR(split.exponent + static_cast<double>(split.fraction), std::log2(static_cast<double>(x)),
                1.5e-7);
  }
  for (int i = 0; i < 20000; ++i) {
    const float t = std::uniform_real_distribution<float>(-33.0f, 1.0f)(rng);
    const int exponent = static_cast<int>(rng() % 200) - 100;
    const double exact = std::exp2(static_cast<double>(t) + exponent);
    const float value = epx::detail::repro_exp2_split(exponent, t);
    if (exact < std::ldexp(1.0, -126)) continue;  // subnormal results have absolute, not relative, error
    ASSERT_LE(std::fabs(value - exact), exact * std::ldexp(1.0, -22)) << t << " " << exponent;
  }
  EXPECT_EQ(epx::detail::repro_exp2_split(-3, 0.0f), 0.125f);
  EXPECT_EQ(epx::detail::scale_by_pow2(1.5f, -149),
            std::numeric_limits<float>::denorm_min() * 2);  // 1.5 -> even
  EXPECT_EQ(epx::detail::scale_by_pow2(1.0f, -150), 0.0f);  // tie to even: zero
  EXPECT_EQ(epx::detail::scale_by_pow2(1.25f, -150), std::numeric_limits<float>::denorm_min());
}

TEST(FormatsLogfmt, KeyWordsReduceToTheGroupsMaxAndMinKeys) {
  std::mt19937 rng(9);
  const uint16_t specials[] = {0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFFF,
                               0x7F81, 0x0001, 0x8001, 0x7F7F, 0x3F80};
  for (int trial = 0; trial < 20000; ++trial) {
    // Groups of every kind: plain values, zeros, subnormals, Inf and NaN, and all-zero groups.
    uint16_t group[epx::kLogfmtGroupSize];
    const int kind = trial % 4;
    for (uint16_t& value : group) {
      value = static_cast<uint16_t>(rng());
      if (kind == 1 && rng() % 4 == 0) value = specials[rng() % std::size(specials)];
      if (kind == 2) value = rng() % 8 == 0 ? static_cast<uint16_t>(rng() & 0x807F) : 0;  // zeros, subnormals
      if (kind == 3)
        value = static_cast<uint16_t>(rng() % 2 ? 0x3000 + rng() % 0xF00 : 0xB000 + rng() % 0xF00);
    }
    float max_key = 0.0f;
    float min_key = bits_as_float(0x7F800000u);
    ASSERT_EQ(epx::logfmt_key_word(0, 0), epx::kLogfmtKeyWordIdentity);  // zeros: max key 0, min key Inf
    uint32_t word = epx::kLogfmtKeyWordIdentity;
    for (int lane = 0; lane < 32; ++lane) {
      const uint16_t* v = group + 4 * lane;
      for (int i = 0; i < 4; ++i) {
        max_key = std::fmax(max_key, epx::logfmt_abs_for_max(bf16_to_float(v[i])));
        min_key = std::fmin(min_key, epx::logfmt_abs_for_min(bf16_to_float(v[i])));
      }
      word = epx::max_u16x2(word,
                            epx::logfmt_key_word(v[0] | uint32_t(v[1]) << 16, v[2] | uint32_t(v[3]) << 16));
    }
    ASSERT_EQ(float_as_bits(epx::logfmt_max_key_of(word)), float_as_bits(max_key)) << trial;
    ASSERT_EQ(float_as_bits(epx::logfmt_min_key_of(word)), float_as_bits(min_key)) << trial;
  }
}

TEST(FormatsLogfmt, ConversionFreeStepsAreExact) {
  std::mt19937 rng(5);
  const float halves[] = {0.5f, -0.5f, 1.5f, -1.5f, 2.5f, -2.5f, 4194302.5f, -4194302.5f, 0.0f, -0.0f};
  for (const float t : halves) {
    EXPECT_EQ(epx::detail::round_to_int(t).value, std::nearbyint(t)) << t;
    EXPECT_EQ(epx::detail::round_to_int(t).integer, static_cast<int>(std::nearbyint(t))) << t;
  }
  for (int i = 0; i < 200000; ++i) {
    const float t = std::uniform_real_distribution<float>(-4194303.0f, 4194303.0f)(rng) /
                    static_cast<float>(1 << (rng() % 23));
    const epx::detail::RoundedToInt nearest = epx::detail::round_to_int(t);
    ASSERT_EQ(nearest.value, std::nearbyint(t)) << t;
    ASSERT_EQ(nearest.integer, static_cast<int>(std::nearbyint(t))) << t;
    const epx::detail::RoundedToInt floor = epx::detail::floor_to_int(t);
    ASSERT_EQ(floor.value, std::floor(t)) << t;
    ASSERT_EQ(floor.integer, static_cast<int>(std::floor(t))) << t;
  }
  for (int k = -(1 << 22) + 1; k < (1 << 22); ++k)
    ASSERT_EQ(epx::detail::small_int_to_float(k), static_cast<float>(k)) << k;
  // Every exponent, with significands that round up, down and to even once the result is subnormal.
  for (int i = 0; i < 2000; ++i) {
    const float x = bits_as_float(0x3F000000u + (static_cast<uint32_t>(rng()) % 0x1000000u));  // [1/2, 2)
    for (int e = -250; e <= 250; ++e)
      ASSERT_EQ(float_as_bits(epx::detail::scale_by_pow2(x, e)), float_as_bits(std::ldexp(x, e)))
          << x << " " << e;
  }
}

// Metadata pairs (max_bits, min_bits) covering typical, clipped, equal, adjacent and tiny ranges.
std::vector<std::pair<uint16_t, uint16_t>> meta_pairs(std::mt19937& rng) {
  std::vector<std::pair<uint16_t, uint16_t>> pairs = {{0x3F00, 0x3E00}, {0x3F7F, 0x0001}, {0x3E80, 0x3E80},
                                                      {0x3E80, 0x3E7F}, {0x3F7F, 0x3F7E}, {0x0080, 0x0001},
                                                      {0x0005, 0x0001}, {0x3D4C, 0x0000}, {0x3F00, 0x2F80},
                                                      {0x3F00, 0x2F00}, {0x3F00, 0x2EFF}};
  for (int i = 0; i < 200; ++i) {
    const uint16_t max_bits = static_cast<uint16_t>(rng() % 0x3F80u + 1);
    pairs.emplace_back(max_bits, static_cast<uint16_t>(rng() % (max_bits + 1u)));
  }
  return pairs;
}

TEST(FormatsLogfmt, LevelsAreMonotonicExactAtEndsAndAccurate) {
  std::mt19937 rng(17);
  for (const auto& [max_bits, min_bits] : meta_pairs(rng)) {
    const LogfmtParams params = epx::logfmt_params_from_meta(max_bits, min_bits);
    const std::vector<float> levels = all_levels(params);
    const float max_abs = bf16_to_float(max_bits);
    ASSERT_EQ(levels[0], 0.0f);
    ASSERT_EQ(levels[kLogfmtMaxLevel], max_abs);
    if (!params.clipped) {
      ASSERT_EQ(levels[1], bf16_to_float(min_bits));
    }
    const double range =
        min_bits == 0 ? 1e9 : std::log2(max_abs / static_cast<double>(bf16_to_float(min_bits)));
    if (std::fabs(range - 32.0) > 1e-5) {
      ASSERT_EQ(params.clipped, range > 32.0);
    }
    ASSERT_LE(params.step, 32.0f / 510.0f);
    for (int k = 1; k < kLogfmtMaxLevel; ++k) {
      // Strictly increasing wherever levels are normal floats (and step > 0); never decreasing.
      ASSERT_LE(levels[k], levels[k + 1]) << max_bits << " " << min_bits << " k " << k;
      if (params.step > 0.0f && levels[k] >= std::ldexp(1.0f, -126)) {
        ASSERT_LT(levels[k], levels[k + 1]);
      }
      if (k == 1 && !params.clipped) continue;
      const double exact = max_abs * std::exp2(-static_cast<double>(kLogfmtMaxLevel - k) * params.step);
      if (exact < std::ldexp(1.0, -126)) continue;
      ASSERT_LE(std::fabs(levels[k] - exact), exact * std::ldexp(1.0, -19))
          << max_bits << " " << min_bits << " k " << k;
    }
  }
}

// FNV-1a over the bits of all 512 levels: pins the level function so any platform (another host
// architecture, or a GPU test decoding the same metadata) can check it gets exactly these bits.
uint64_t level_hash(uint16_t max_bits, uint16_t min_bits) {
  const LogfmtParams params = epx::logfmt_params_from_meta(max_bits, min_bits);
  uint64_t hash = 1469598103934665603ull;
  for (int k = 0; k < kNumLevels; ++k) {
    hash ^= float_as_bits(epx::logfmt_level(k, params));
    hash *= 1099511628211ull;
  }
  return hash;
}

TEST(FormatsLogfmt, LevelBitsArePinned) {
  EXPECT_EQ(level_hash(0x3F00, 0x3E00), 1586496588256308893ull);
  EXPECT_EQ(level_hash(0x3F7F, 0x0001), 469624514057801614ull);
  EXPECT_EQ(level_hash(0x3D4C, 0x3A83), 11821709476784231322ull);
  EXPECT_EQ(level_hash(0x0080, 0x0001), 2684228255194325444ull);
}

// ---------------------------------------------------------------------------------------------------
// Encoding
// ---------------------------------------------------------------------------------------------------

TEST(FormatsLogfmt, EncodeMatchesNearestLevelReference) {
  std::mt19937 rng(23);
  for (int group_idx = 0; group_idx < 160; ++group_idx) {
    const std::vector<uint16_t> group = make_group(rng, group_idx % kNumGroupKinds);
    const auto [max_key, min_key] = group_keys(group);
    const LogfmtParams params = epx::logfmt_params(max_key, min_key);
    const std::vector<float> levels = all_levels(params);
    for (uint16_t bits : group) {
      const float x = bf16_to_float(bits);
      const uint16_t code = epx::logfmt_encode_value(x, params);
      ASSERT_EQ(code, reference_encode(x, levels)) << "kind " << group_idx % kNumGroupKinds << " x " << x;
      // Nearest in exact arithmetic too, up to the rounding of the float midpoint.
      const int level = code & kLogfmtMaxLevel;
      const double error = std::fabs(std::fabs(static_cast<double>(x)) - levels[level]);
      for (int k : {level - 1, level + 1}) {
        if (k < 0 || k > kLogfmtMaxLevel) continue;
        ASSERT_LE(error,
                  std::fabs(std::fabs(static_cast<double>(x)) - levels[k]) + std::ldexp(levels[level], -23));
      }
    }
  }
}

// The fast encode (one approximate log2, the reference where that does not settle the level) must give the
// reference's code for every BF16 input, with a log2 of the mantissa off by up to 2^-21 either way (the
// bound its margin assumes for the GPU's hardware log2 on [1, 2)).
TEST(FormatsLogfmt, FastEncodeIsTheReferenceForEveryBf16Input) {
  std::mt19937 rng(31);
  std::uniform_int_distribution<int> below_one(1, 0x3F7F);  // positive BF16 below 1
  struct Case {
    uint16_t max_bits, min_bits;
  };
  std::vector<Case> cases = {
      {0x3F00, 0x3E80},                    // range 1: the finest common ladder
      {0x3F7F, 0x3F7E},                    // adjacent BF16 values: the smallest nonzero step
      {0x3F7F, 0x3F70}, {0x3C00, 0x0001},  // range clipped at 32 (min subnormal)
      {0x3F00, 0x0000},                    // no usable min: clipped
      {0x0500, 0x0400}, {0x0280, 0x0100},  // tiny max: near and past the normal-level bound
      {0x3E00, 0x3E00},                    // step 0
  };
  for (int i = 0; i < 48; ++i) {
    const uint16_t a = static_cast<uint16_t>(below_one(rng)), b = static_cast<uint16_t>(below_one(rng));
    cases.push_back({std::max(a, b), std::min(a, b)});
  }
  const auto exact = [](float m) { return static_cast<float>(std::log2(static_cast<double>(m))); };
  const auto high = [](float m) { return static_cast<float>(std::log2(static_cast<double>(m)) + 0x1p-21); };
  const auto low = [](float m) { return static_cast<float>(std::log2(static_cast<double>(m)) - 0x1p-21); };
  long settled = 0, checked = 0;
  for (const Case& c : cases) {
    const LogfmtParams params = epx::logfmt_params_from_meta(c.max_bits, c.min_bits);
    const epx::LogfmtFastEncode fast = epx::logfmt_fast_encode_setup(params);
    for (uint32_t bits = 0; bits <= c.max_bits; ++bits) {
      for (uint32_t sign : {0u, 0x8000u}) {
        const float x = bf16_to_float(static_cast<uint16_t>(bits | sign));
        const uint16_t want = epx::logfmt_encode_value(x, params);
        ASSERT_EQ(epx::logfmt_encode_fast(x, params, fast, exact), want)
            << std::hex << c.max_bits << " " << bits;
        ASSERT_EQ(epx::logfmt_encode_fast(x, params, fast, high), want)
            << std::hex << c.max_bits << " " << bits;
        ASSERT_EQ(epx::logfmt_encode_fast(x, params, fast, low), want)
            << std::hex << c.max_bits << " " << bits;
        const int level = want & kLogfmtMaxLevel;
        if (level < 2) continue;  // level 1 and zero: the reference's zero rule decides
        settled += epx::logfmt_encode_settled(x, params, fast, exact) >= 0;
        ++checked;
      }
    }
  }
  // Not speed, coverage: the fast path must settle most values on the ladder, or the test above checks
  // little.
  EXPECT_GT(static_cast<double>(settled) / static_cast<double>(checked), 0.9) << settled << " of " << checked;
}

// Random floats (the per-value API) and groups of every kind (make_group) agree too.
TEST(FormatsLogfmt, FastEncodeIsTheReferenceForRandomGroupsAndFloats) {
  std::mt19937 rng(37);
  const auto hardware_like = [](float m) { return static_cast<float>(std::log2(static_cast<double>(m))); };
  for (int group_idx = 0; group_idx < 160; ++group_idx) {
    const std::vector<uint16_t> group = make_group(rng, group_idx % kNumGroupKinds);
    const auto [max_key, min_key] = group_keys(group);
    if (!epx::logfmt_group_qualifies(max_key)) continue;
    const LogfmtParams params = epx::logfmt_params(max_key, min_key);
    const epx::LogfmtFastEncode fast = epx::logfmt_fast_encode_setup(params);
    std::uniform_real_distribution<float> magnitude(0.0f, params.max_abs);
    for (uint16_t bits : group) {
      const float x = bf16_to_float(bits);
      ASSERT_EQ(epx::logfmt_encode_fast(x, params, fast, hardware_like), epx::logfmt_encode_value(x, params));
    }
    for (int i = 0; i < 2000; ++i) {
      const float x = magnitude(rng) * (i % 2 != 0 ? -1.0f : 1.0f);
      ASSERT_EQ(epx::logfmt_encode_fast(x, params, fast, hardware_like), epx::logfmt_encode_value(x, params))
          << x;
    }
  }
}

TEST(FormatsLogfmt, EncodeHandlesOutOfContractInputs) {
  const LogfmtParams params = epx::logfmt_params(0.5f, 0.25f);
  EXPECT_EQ(epx::logfmt_encode_value(2.0f, params), kLogfmtMaxLevel);  // above max: top level
  EXPECT_EQ(epx::logfmt_encode_value(-std::numeric_limits<float>::infinity(), params),
            0x200 | kLogfmtMaxLevel);
  EXPECT_EQ(epx::logfmt_encode_value(std::numeric_limits<float>::quiet_NaN(), params), 0);
  EXPECT_EQ(epx::logfmt_encode_value(1e-30f, params), 0);
  EXPECT_EQ(epx::logfmt_encode_value(0.2f, params), 1);  // below min, nearer min than zero
  const LogfmtParams zero_params = epx::logfmt_params(0.0f, std::numeric_limits<float>::infinity());
  EXPECT_EQ(epx::logfmt_encode_value(0.3f, zero_params), 0);
  EXPECT_EQ(epx::logfmt_decode_value(kLogfmtMaxLevel, zero_params), 0.0f);
}

// ---------------------------------------------------------------------------------------------------
// Group round trips
// ---------------------------------------------------------------------------------------------------

struct SlotResult {
  int num_bytes;
  std::vector<uint8_t> slot;
  std::vector<float> decoded;
};

SlotResult round_trip(const std::vector<uint16_t>& group) {
  SlotResult result{0, std::vector<uint8_t>(epx::kLogfmtGroupSlotBytes + 16, 0xAB),
                    std::vector<float>(kLogfmtGroupSize)};
  result.num_bytes = epx::logfmt_encode_group(group.data(), result.slot.data());
  for (size_t i = result.num_bytes; i < result.slot.size(); ++i)
    EXPECT_EQ(result.slot[i], 0xAB) << "wrote past " << i;
  epx::logfmt_decode_group(result.slot.data(), result.decoded.data());
  return result;
}

TEST(FormatsLogfmt, RoundTripErrorWithinBound) {
  std::mt19937 rng(31);
  double worst_ratio = 0.0;
  for (int group_idx = 0; group_idx < 400; ++group_idx) {
    const int kind = group_idx % kNumGroupKinds;
    const std::vector<uint16_t> group = make_group(rng, kind);
    const SlotResult result = round_trip(group);
    ASSERT_EQ(result.num_bytes, epx::kLogfmtEncodedBytes);
    const LogfmtParams params = epx::logfmt_params_from_meta(epx::logfmt_load_u16(&result.slot[0]),
                                                             epx::logfmt_load_u16(&result.slot[2]));
    const float level_1 = epx::logfmt_level(1, params);
    const double relative = std::exp2(params.step / 2.0) - 1.0 + epx::kLogfmtRelErrorSlack;
    for (int i = 0; i < kLogfmtGroupSize; ++i) {
      const double x = bf16_to_float(group[i]);
      const double error = std::fabs(x - result.decoded[i]);
      ASSERT_EQ(std::signbit(result.decoded[i]), std::signbit(x));
      // Levels below 2^-126 are float subnormals, exact only to 2^-149.
      const double bound = std::fabs(x) >= level_1 ? std::fabs(x) * relative + std::ldexp(1.0, -149)
                                                   : level_1 / 2.0 + std::ldexp(1.0, -149);
      ASSERT_LE(error, bound) << "kind " << kind << " x " << x << " step " << params.step;
      if (std::fabs(x) >= level_1 && x != 0.0 && kind < 4)
        worst_ratio = std::fmax(worst_ratio, error / bound);
      // The payload really holds the per-value code (decoded by an independent bit reader).
      ASSERT_EQ(read_code_bitwise(&result.slot[epx::kLogfmtMetaBytes], i),
                epx::logfmt_encode_value(static_cast<float>(x), params));
    }
  }
  EXPECT_GT(worst_ratio, 0.8) << "the bound is loose or the data misses the worst case";
}

TEST(FormatsLogfmt, NonQualifyingGroupsFallBackExactly) {
  const uint16_t specials[] = {0x3F80 /* 1.0 */,
                               0xBFC0 /* -1.5 */,
                               0x4700 /* 32768 */,
                               0x7FC0 /* NaN */,
                               0xFFC1 /* -NaN with payload */,
                               0x7F80 /* Inf */,
                               0xFF80 /* -Inf */};
  std::mt19937 rng(41);
  for (uint16_t special : specials) {
    std::vector<uint16_t> group = make_group(rng, 0);
    group[rng() % kLogfmtGroupSize] = special;
    const SlotResult result = round_trip(group);
    ASSERT_EQ(result.num_bytes, epx::kLogfmtFallbackBytes);
    EXPECT_EQ(epx::logfmt_load_u16(&result.slot[0]), epx::kLogfmtFallbackMarker);
    for (int i = 0; i < kLogfmtGroupSize; ++i)
      ASSERT_EQ(float_as_bits(result.decoded[i]), static_cast<uint32_t>(group[i]) << 16);
  }
}

TEST(FormatsLogfmt, AllZeroGroup) {
  std::vector<uint16_t> group(kLogfmtGroupSize, 0x0000);
  for (int i = 0; i < kLogfmtGroupSize; i += 3) group[i] = 0x8000;  // -0 keeps its sign
  const SlotResult result = round_trip(group);
  ASSERT_EQ(result.num_bytes, epx::kLogfmtEncodedBytes);
  EXPECT_EQ(epx::logfmt_load_u16(&result.slot[0]), 0);
  EXPECT_EQ(epx::logfmt_load_u16(&result.slot[2]), 0);
  for (int i = 0; i < kLogfmtGroupSize; ++i)
    ASSERT_EQ(float_as_bits(result.decoded[i]), static_cast<uint32_t>(group[i]) << 16);
}

TEST(FormatsLogfmt, OneNonzeroAndEqualMagnitudesAreExact) {
  std::vector<uint16_t> group(kLogfmtGroupSize, 0x0000);
  group[77] = float_to_bf16(-0.3f);
  SlotResult result = round_trip(group);
  ASSERT_EQ(result.num_bytes, epx::kLogfmtEncodedBytes);
  for (int i = 0; i < kLogfmtGroupSize; ++i)
    ASSERT_EQ(float_as_bits(result.decoded[i]), static_cast<uint32_t>(group[i]) << 16);

  for (int i = 0; i < kLogfmtGroupSize; ++i) group[i] = float_to_bf16(i % 5 == 0 ? -0.0123f : 0.0123f);
  result = round_trip(group);
  for (int i = 0; i < kLogfmtGroupSize; ++i)
    ASSERT_EQ(float_as_bits(result.decoded[i]), static_cast<uint32_t>(group[i]) << 16);

  // The group's max and (unclipped) min are always exact.
  std::mt19937 rng(5);
  group = make_group(rng, 0);
  result = round_trip(group);
  for (int i = 0; i < kLogfmtGroupSize; ++i) {
    const float x = bf16_to_float(group[i]);
    if (std::fabs(x) == bf16_to_float(epx::logfmt_load_u16(&result.slot[0])) ||
        std::fabs(x) == bf16_to_float(epx::logfmt_load_u16(&result.slot[2]))) {
      ASSERT_EQ(result.decoded[i], x);
    }
  }
}

TEST(FormatsLogfmt, RangeBeyond2To32ClipsToLevelOneOrZero) {
  std::vector<uint16_t> group(kLogfmtGroupSize, float_to_bf16(0.25f));
  group[0] = float_to_bf16(0.5f);
  group[1] = float_to_bf16(-0.5f * std::exp2(-40.0f));  // far below: zero, sign kept
  group[2] = float_to_bf16(0.5f * std::exp2(-32.3f));   // between level_1/2 and level_1: level 1
  group[3] = float_to_bf16(0.5f * std::exp2(-33.5f));   // below level_1/2: zero
  group[4] = float_to_bf16(0.5f * std::exp2(-31.0f));   // inside the range
  const SlotResult result = round_trip(group);
  ASSERT_EQ(result.num_bytes, epx::kLogfmtEncodedBytes);
  const LogfmtParams params = epx::logfmt_params_from_meta(epx::logfmt_load_u16(&result.slot[0]),
                                                           epx::logfmt_load_u16(&result.slot[2]));
  EXPECT_TRUE(params.clipped);
  EXPECT_FLOAT_EQ(params.step, 32.0f / 510.0f);
  const float level_1 = epx::logfmt_level(1, params);
  EXPECT_NEAR(level_1, 0.5 * std::exp2(-32.0), 0.5 * std::exp2(-32.0) * 1e-5);
  EXPECT_EQ(float_as_bits(result.decoded[1]), 0x80000000u);
  EXPECT_EQ(result.decoded[2], level_1);
  EXPECT_EQ(result.decoded[3], 0.0f);
  EXPECT_NEAR(result.decoded[4], bf16_to_float(group[4]), bf16_to_float(group[4]) * 0.022);
  EXPECT_EQ(result.decoded[0], 0.5f);
}

TEST(FormatsLogfmt, SignOnlyFlipsTopBit) {
  std::mt19937 rng(43);
  for (int kind = 0; kind < kNumGroupKinds; ++kind) {
    std::vector<uint16_t> group = make_group(rng, kind);
    std::vector<uint16_t> negated(group);
    for (auto& bits : negated) bits ^= 0x8000u;
    const SlotResult a = round_trip(group);
    const SlotResult b = round_trip(negated);
    ASSERT_EQ(epx::logfmt_load_u16(&a.slot[0]), epx::logfmt_load_u16(&b.slot[0]));
    for (int i = 0; i < kLogfmtGroupSize; ++i) {
      ASSERT_EQ(read_code_bitwise(&a.slot[4], i) ^ 0x200u, read_code_bitwise(&b.slot[4], i));
      ASSERT_EQ(float_as_bits(a.decoded[i]) ^ 0x80000000u, float_as_bits(b.decoded[i]));
    }
  }
}

TEST(FormatsLogfmt, FloatParamsRoundOutwardToEncloseValues) {
  // A kernel holding non-BF16 floats: max rounds up, min rounds down, so both ends stay inside.
  const float max_abs = 0.30000001f, min_abs = 0.1f;
  const LogfmtParams params = epx::logfmt_params(max_abs, min_abs);
  EXPECT_GE(bf16_to_float(params.max_bits), max_abs);
  EXPECT_LE(bf16_to_float(params.min_bits), min_abs);
  const LogfmtParams decoded = epx::logfmt_params_from_meta(params.max_bits, params.min_bits);
  const double relative = std::exp2(params.step / 2.0) - 1.0 + epx::kLogfmtRelErrorSlack;
  std::mt19937 rng(47);
  for (int i = 0; i < 2000; ++i) {
    const float x = std::uniform_real_distribution<float>(min_abs, max_abs)(rng);
    const float y = epx::logfmt_decode_value(epx::logfmt_encode_value(x, params), decoded);
    ASSERT_LE(std::fabs(static_cast<double>(x) - y), x * relative);
  }
  EXPECT_EQ(epx::logfmt_params(0.5f, 0.0f).min_bits, 0);  // no usable min: clipped range
  EXPECT_TRUE(epx::logfmt_params(0.5f, 0.0f).clipped);
  EXPECT_EQ(epx::logfmt_params(0.5f, 0.75f).min_bits, epx::logfmt_params(0.5f, 0.75f).max_bits);
}

}  // namespace
