#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "common/host_device.hpp"
#include "formats/bf16.hpp"
#include "formats/bits.hpp"
#include "formats/repro_math.hpp"

// LogFMT-10: the optional wire format of low-latency combine, one slot per group of 128 BF16 channels.
//
// Slot (little-endian):             encoded group (164 bytes)          fallback group (260 bytes)
//   bytes 0-1   max_bits            BF16 of max |x|                    0xFFFF (kLogfmtFallbackMarker)
//   bytes 2-3   min_bits            BF16 of min |x| over x != 0        0x0000
//   bytes 4..   payload             160 bytes: 128 10-bit codes        256 bytes: the 128 BF16 values
// Code i occupies bits [10i, 10i + 10) of the payload read as a little-endian bit stream (bit b is bit
// b % 8 of byte b / 8), so codes 4j..4j+3 fill exactly bytes 5j..5j+4: one warp lane per 4 channels.
// A code is (sign << 9) | level: the sign bit of x (kept for zeros, so -0 survives) and a 9-bit level.
// max_bits of an encoded group is below 0x3F81 (max <= 1), so it never equals the marker.
//
// Which groups are encoded: every value finite and |x| < 1. Otherwise (some |x| >= 1, Inf or NaN) the
// group travels as plain BF16 and decodes exactly.
//
// Levels, a pure function of (max_bits, min_bits, level) evaluated the same way by encoder and decoder:
//   max = bf16_to_float(max_bits), min = bf16_to_float(min_bits) (exact: the inputs are BF16; the
//   per-value API rounds a float max up and min down so the range still encloses the values)
//   all-zero group: max = min = 0 and every level is 0
//   d    = log2(max) - log2(min), clipped to kLogfmtMaxLog2Range = 32 (min = 0 also means clipped)
//   step = d / 510                          (2^9 - 2 steps from level 1 to level 511)
//   level 0   = 0
//   level 511 = max                         (exact; also every level >= 1 when step == 0)
//   level 1   = min                         (exact) unless d was clipped
//   level k   = 2^(log2(max) - (511 - k) * step)   otherwise
// log2 and exp2 come from repro_math.hpp (IEEE-exact operations only), so a level decodes to the same
// bits on host and device: kLogfmtDecodeUlpTolerance = 0 (with no fast-math; see repro_math.hpp).
//
// Encoding: |x| goes to the nearest level in the LINEAR domain: it is compared with the float midpoints
// (L_k + L_{k+1}) / 2 of the decoded levels, ties to the larger level. log2 only guesses the level; the
// comparisons settle it, so the code is nearest whatever the guess's rounding. With step == 0 (all
// nonzero magnitudes equal) every value >= max / 2 takes level 511. Values below level 1 (only when
// clipped: more than 2^32 below max) become zero if |x| < level_1 / 2, else level 1.
//
// Error bound (tested): adjacent levels are a ratio r = 2^step apart, and nearest-level rounding of a
// value between them is off by at most (r - 1) / (r + 1) <= 2^(step/2) - 1 relative to the value. Level
// evaluation adds < 2^-19 relative (mostly the rounding of the exponent argument), so
//   |x| >= level_1:  |x - decoded| <= |x| * (2^(step/2) - 1 + kLogfmtRelErrorSlack)     (<= 2.2%)
//   |x| <  level_1:  |x - decoded| <= level_1 / 2                  (level_1 ~ max * 2^-32 there)
// Values of an encoded group never exceed max (level 511), so no clipping happens at the top.

namespace epx {

constexpr int kLogfmtGroupSize = 128;
constexpr int kLogfmtCodeBits = 10;
constexpr int kLogfmtMaxLevel = 511;
constexpr float kLogfmtMaxLog2Range = 32.0f;
constexpr int kLogfmtMetaBytes = 4;
constexpr int kLogfmtCodeBytes = kLogfmtGroupSize * kLogfmtCodeBits / 8;       // 160
constexpr int kLogfmtEncodedBytes = kLogfmtMetaBytes + kLogfmtCodeBytes;       // 164
constexpr int kLogfmtFallbackBytes = kLogfmtMetaBytes + kLogfmtGroupSize * 2;  // 260
constexpr int kLogfmtGroupSlotBytes = kLogfmtFallbackBytes;                    // worst case on the wire
constexpr uint16_t kLogfmtFallbackMarker = 0xFFFF;
constexpr int kLogfmtDecodeUlpTolerance = 0;
constexpr float kLogfmtRelErrorSlack = 3.814697265625e-06f;  // 2^-18

// Everything a lane needs to encode or decode one value of a group.
struct LogfmtParams {
  uint16_t max_bits;  // metadata as sent
  uint16_t min_bits;
  float max_abs;          // level 511; 0 for an all-zero group
  float min_abs;          // level 1 unless clipped
  float step;             // log2 distance of adjacent levels
  float inv_step;         // 1 / step (0 when step == 0): the encoder's level guess multiplies by it
  int max_log2_exponent;  // log2(max) = exponent + fraction (repro_log2_split)
  float max_log2_fraction;
  bool clipped;
};

// ---- Group metadata (reductions a warp can do with fmaxf/fminf shuffles, order-independent) ----

// Key for the max reduction: |x|, with NaN mapped to +Inf so a NaN makes the group fall back.
EPX_HD float logfmt_abs_for_max(float x) {
  const uint32_t abs_bits = float_as_bits(x) & 0x7FFFFFFFu;
  return abs_bits > 0x7F800000u ? bits_as_float(0x7F800000u) : bits_as_float(abs_bits);
}

// Key for the min reduction: |x| of nonzero values, +Inf for zeros (and NaN).
EPX_HD float logfmt_abs_for_min(float x) {
  const float abs_x = fabsf(x);
  return abs_x > 0.0f ? abs_x : bits_as_float(0x7F800000u);
}

// max_key = fmaxf-reduction of logfmt_abs_for_max over the group (start from 0).
EPX_HD bool logfmt_group_qualifies(float max_key) {
  return max_key < 1.0f;
}

// The same two reductions over BF16 values in one word per lane, for a warp's shuffles: the high half is the
// max key and the low half 0xFFFF minus the min key, both as BF16 bits (BF16 magnitudes order like their
// bits), so both halves reduce by max_u16x2. `pair_a`, `pair_b`: four BF16 values, two per word.
EPX_HD uint32_t logfmt_key_word(uint32_t pair_a, uint32_t pair_b) {
  const uint32_t abs_a = pair_a & 0x7FFF7FFFu;
  const uint32_t abs_b = pair_b & 0x7FFF7FFFu;
  // Max: a NaN (above 0x7F80) counts as Inf.
  const uint32_t max2 = max_u16x2(min_u16x2(abs_a, 0x7F807F80u), min_u16x2(abs_b, 0x7F807F80u));
  // Min over nonzero values: |x| - 1 wraps a zero to 0xFFFF; clamped, a zero, Inf or NaN counts as Inf.
  const uint32_t min2 =
      min_u16x2(min_u16x2(sub_u16x2(abs_a, 0x00010001u), sub_u16x2(abs_b, 0x00010001u)), 0x7F7F7F7Fu);
  const uint32_t max1 = (max2 >> 16) > (max2 & 0xFFFFu) ? max2 >> 16 : max2 & 0xFFFFu;
  const uint32_t min1 = ((min2 >> 16) < (min2 & 0xFFFFu) ? min2 >> 16 : min2 & 0xFFFFu) + 1u;
  return max1 << 16 | (0xFFFFu - min1);
}

// The key word of no values (max key 0, min key Inf): what a reduction starts from.
constexpr uint32_t kLogfmtKeyWordIdentity = 0xFFFFu - 0x7F80u;

// The max key and the min key of a reduced key word, as floats.
EPX_HD float logfmt_max_key_of(uint32_t key_word) {
  return bits_as_float(key_word >> 16 << 16);
}
EPX_HD float logfmt_min_key_of(uint32_t key_word) {
  return bits_as_float((0xFFFFu - (key_word & 0xFFFFu)) << 16);
}

EPX_HD LogfmtParams logfmt_params_from_meta(uint16_t max_bits, uint16_t min_bits) {
  LogfmtParams params{max_bits, min_bits, 0.0f, 0.0f, 0.0f, 0.0f, 0, 0.0f, false};
  const float max_abs = bf16_to_float(max_bits);
  if (!(max_abs > 0.0f)) return LogfmtParams{0, 0, 0.0f, 0.0f, 0.0f, 0.0f, 0, 0.0f, false};
  const float min_bits_value = bf16_to_float(min_bits);
  const float min_abs = min_bits_value < max_abs ? min_bits_value : max_abs;  // NaN bits: treated as max
  const detail::Log2Split max_log2 = detail::repro_log2_split(max_abs);
  params.max_abs = max_abs;
  params.min_abs = min_abs;
  params.max_log2_exponent = max_log2.exponent;
  params.max_log2_fraction = max_log2.fraction;
  // min = 0 (no usable min) means the full clipped range.
  float range = kLogfmtMaxLog2Range;
  params.clipped = true;
  if (min_abs > 0.0f) {
    const detail::Log2Split min_log2 = detail::repro_log2_split(min_abs);
    range =
        static_cast<float>(max_log2.exponent - min_log2.exponent) + (max_log2.fraction - min_log2.fraction);
    range = min_abs == max_abs || !(range > 0.0f) ? 0.0f : range;
    params.clipped = !(range <= kLogfmtMaxLog2Range);
    if (params.clipped) range = kLogfmtMaxLog2Range;
  }
  params.step = range / static_cast<float>(kLogfmtMaxLevel - 1);
  params.inv_step = params.step > 0.0f ? 1.0f / params.step : 0.0f;
  return params;
}

// max_abs / min_abs_nonzero: the reductions of logfmt_abs_for_max / logfmt_abs_for_min (a zero max means
// an all-zero group). They are rounded to BF16 outward, which is exact for BF16 inputs.
EPX_HD LogfmtParams logfmt_params(float max_abs, float min_abs_nonzero) {
  if (!(max_abs > 0.0f)) return logfmt_params_from_meta(0, 0);
  const uint16_t max_bits = float_to_bf16_round_up(max_abs);
  uint16_t min_bits = 0;  // no usable min (0, +Inf, NaN): the full clipped range
  if (min_abs_nonzero > 0.0f && min_abs_nonzero < bits_as_float(0x7F800000u)) {
    min_bits = min_abs_nonzero >= max_abs ? max_bits : float_to_bf16_round_down(min_abs_nonzero);
  }
  return logfmt_params_from_meta(max_bits, min_bits);
}

// Magnitude of level 0..511 (see the table above). The ladder's value is computed for every level and the
// special cases select over it, so that a warp decoding different levels runs one path (the ladder's
// argument stays within [-33, 1] for any level in 0..511 and any params logfmt_params_from_meta makes).
EPX_HD float logfmt_level(int level, const LogfmtParams& params) {
  // The exponent argument is an explicit fmaf: written as a*b+c a compiler could fuse it or not.
  const float below_max =
      fmaf(detail::small_int_to_float(level - kLogfmtMaxLevel), params.step, params.max_log2_fraction);
  float magnitude = detail::repro_exp2_split(params.max_log2_exponent, below_max);
  if (level == 1 && !params.clipped) magnitude = params.min_abs;
  if (level >= kLogfmtMaxLevel || params.step == 0.0f) magnitude = params.max_abs;
  if (level <= 0 || !(params.max_abs > 0.0f)) magnitude = 0.0f;
  return magnitude;
}

EPX_HD uint16_t logfmt_encode_value(float x, const LogfmtParams& params) {
  const uint16_t sign = static_cast<uint16_t>((float_as_bits(x) >> 31) << 9);
  const float abs_x = fabsf(x);
  // Zero, an all-zero group, and NaN (which only a misused per-value call can pass) encode as zero.
  if (!(abs_x > 0.0f) || !(params.max_abs > 0.0f)) return sign;
  if (params.step == 0.0f)
    return abs_x < params.max_abs * 0.5f ? sign : static_cast<uint16_t>(sign | kLogfmtMaxLevel);

  int level = kLogfmtMaxLevel;
  if (abs_x < params.max_abs) {
    const detail::Log2Split log2_x = detail::repro_log2_split(abs_x);
    const float below_max = static_cast<float>(log2_x.exponent - params.max_log2_exponent) +
                            (log2_x.fraction - params.max_log2_fraction);
    const float guess = static_cast<float>(kLogfmtMaxLevel) + below_max * params.inv_step;
    level = guess < 1.0f ? 1 : static_cast<int>(guess + 0.5f);
    if (level > kLogfmtMaxLevel) level = kLogfmtMaxLevel;
  }
  // The guess is within one level; a few comparisons with linear midpoints make it the nearest level.
  // The bound on the steps keeps the loop short for a warp even for inputs outside the contract. Only one
  // direction can move: the midpoint above the guess is at least its level and the one below at most, so a
  // value at or above the guess's level never moves down (and after a move up it is past the midpoint it
  // crossed), and one below it never moves up. Each level evaluated costs an exp2, so the other direction's
  // first comparison, which could not move, is skipped.
  constexpr int kMaxFixupSteps = 4;
  float current = logfmt_level(level, params);
  if (abs_x >= current) {
    for (int i = 0; i < kMaxFixupSteps && level < kLogfmtMaxLevel; ++i) {
      const float above = logfmt_level(level + 1, params);
      if (!(abs_x >= (current + above) * 0.5f)) break;
      ++level;
      current = above;
    }
  } else {
    for (int i = 0; i < kMaxFixupSteps && level > 1; ++i) {
      const float below = logfmt_level(level - 1, params);
      if (abs_x >= (below + current) * 0.5f) break;
      --level;
      current = below;
    }
  }
  if (level == 1 && abs_x < current * 0.5f) return sign;
  return static_cast<uint16_t>(sign | level);
}

// ---- Fast encode: the reference's code, with one approximate log2 where that settles the level ----
//
// logfmt_encode_value evaluates a log2 and two or three levels (each an exp2) per value. Most values lie
// far from the linear midpoints between levels, and there an approximate log2 alone decides. In log2 units
// the levels 2..510 lie on the ideal ladder log2(max) - (511 - k) * step to within 2^-19 (the rounding of
// the exponent argument near 33, and the series' 1e-8), level 511 (= max) to within 1e-7, and level 1 (= min
// when unclipped) to within 4e-6 (the roundings of the range and of step = range / 510). The linear
// midpoint of levels k and k + 1 sits at k + 1/2 + a/8 - a^3/192 level units (a = step * ln 2; a^3/192 <
// 5e-7 for step <= 32/510). The estimate of |x|'s position errs by at most 2^-21 (the approximate log2 of
// the mantissa) + 2^-19 (the rounding of log2(|x|/max), below 33 in size) log2 units, times inv_step, plus
// under 6e-5 level units of float roundings. Where it lies farther than the margin from every midpoint, the
// level is the one between its two neighbouring midpoints, which is what the reference's comparisons find
// (the worst error sum, 6.4e-6 log2 units, is 2.3x inside the margin). Elsewhere, and below the midpoint
// of levels 1 and 2 (the zero rule), the reference decides.
constexpr float kLogfmtFastMarginLog2 = 1.52587890625e-05f;  // 2^-16 log2 units (needs 6.4e-6)
constexpr float kLogfmtFastMarginLevels = 2.44140625e-04f;   // 2^-12 level units (needs 6e-5)

// A group's constants for logfmt_encode_settled.
struct LogfmtFastEncode {
  bool usable;             // step > 0 and levels from 1 up are normal floats
  float midpoint_offset;   // 1/2 + a/8: where a midpoint lies past its lower level, in level units
  float margin;            // the distance from a midpoint (level units) that still settles the level
  int max_exponent_field;  // the biased exponent the ladder's log2(max) split is relative to
};

EPX_HD LogfmtFastEncode logfmt_fast_encode_setup(const LogfmtParams& params) {
  LogfmtFastEncode fast{false, 0.5f, 0.0f, 0};
  // Level 1 is at least 2^(log2(max) - 33): with the exponent above -92 it is a normal float.
  fast.usable = params.step > 0.0f && params.max_log2_exponent > -92;
  fast.midpoint_offset = fmaf(params.step, 0.0866433975f, 0.5f);  // ln 2 / 8
  fast.margin = fmaf(kLogfmtFastMarginLog2, params.inv_step, kLogfmtFastMarginLevels);
  fast.max_exponent_field = params.max_log2_exponent + 127;
  return fast;
}

// log2_mantissa(m): log2 of m in [1, 2) to within 2^-21 (on a GPU the hardware approximation, on a host
// the library's). Returns logfmt_encode_value(x, params) where the estimate settles it, else -1.
template <typename Log2Mantissa>
EPX_HD int logfmt_encode_settled(float x, const LogfmtParams& params, const LogfmtFastEncode& fast,
                                 Log2Mantissa log2_mantissa) {
  // Every case is computed and the answer selected (no branch, so a GPU overlaps a lane's values).
  const uint32_t abs_bits = float_as_bits(x) & 0x7FFFFFFFu;
  const float abs_x = bits_as_float(abs_bits);
  const int exponent_field = static_cast<int>(abs_bits >> 23);
  const int sign = static_cast<int>((float_as_bits(x) >> 31) << 9);
  const float mantissa = bits_as_float((abs_bits & 0x7FFFFFu) | 0x3F800000u);
  const float below_max = detail::small_int_to_float(exponent_field - fast.max_exponent_field) +
                          (log2_mantissa(mantissa) - params.max_log2_fraction);
  // Position past the lower of the two levels whose midpoint is just below |x| (clamped, which keeps
  // floor_to_int's precondition and leaves positions outside [1, 511) outside; a NaN becomes -1).
  const float past = fminf(
      fmaxf(fmaf(below_max, params.inv_step, static_cast<float>(kLogfmtMaxLevel)) - fast.midpoint_offset,
            -1.0f),
      512.0f);
  const detail::RoundedToInt lower = detail::floor_to_int(past);
  const float frac = past - lower.value;
  const bool settled =
      lower.integer >= 1 && lower.integer <= 510 && frac > fast.margin && frac < 1.0f - fast.margin;
  int code = settled ? sign | (lower.integer + 1) : -1;
  // Every group holds its max, and an unclipped one its min: the levels 511 and 1 exactly (the reference's
  // comparisons cannot move off them, as min and max are distinct BF16 values whenever step > 0).
  if (!params.clipped && abs_x == params.min_abs) code = sign | 1;
  if (abs_x >= params.max_abs) code = sign | kLogfmtMaxLevel;
  if (!fast.usable || exponent_field == 0 || abs_bits > 0x7F800000u) code = -1;  // NaN: the reference's
  return code;
}

template <typename Log2Mantissa>
EPX_HD uint16_t logfmt_encode_fast(float x, const LogfmtParams& params, const LogfmtFastEncode& fast,
                                   Log2Mantissa log2_mantissa) {
  const int settled = logfmt_encode_settled(x, params, fast, log2_mantissa);
  return settled >= 0 ? static_cast<uint16_t>(settled) : logfmt_encode_value(x, params);
}

EPX_HD float logfmt_decode_value(uint16_t code, const LogfmtParams& params) {
  const uint32_t sign = static_cast<uint32_t>((code >> 9) & 1u) << 31;
  const float magnitude = logfmt_level(code & kLogfmtMaxLevel, params);
  return bits_as_float(float_as_bits(magnitude) | sign);
}

// ---- Payload packing: four codes are 40 bits, 5 bytes, least significant code first ----

EPX_HD uint64_t logfmt_pack_codes4(uint16_t c0, uint16_t c1, uint16_t c2, uint16_t c3) {
  return static_cast<uint64_t>(c0 & 0x3FFu) | (static_cast<uint64_t>(c1 & 0x3FFu) << 10) |
         (static_cast<uint64_t>(c2 & 0x3FFu) << 20) | (static_cast<uint64_t>(c3 & 0x3FFu) << 30);
}

EPX_HD uint16_t logfmt_unpack_code4(uint64_t packed, int code_idx) {
  return static_cast<uint16_t>((packed >> (10 * code_idx)) & 0x3FFu);
}

EPX_HD void logfmt_store_codes4(uint8_t* dst, uint64_t packed) {
  for (int i = 0; i < 5; ++i) dst[i] = static_cast<uint8_t>(packed >> (8 * i));
}

EPX_HD uint64_t logfmt_load_codes4(const uint8_t* src) {
  uint64_t packed = 0;
  for (int i = 0; i < 5; ++i) packed |= static_cast<uint64_t>(src[i]) << (8 * i);
  return packed;
}

// ---- Packed rows: what a put between nodes sends ----
// A row written into an NVLink peer keeps group g's payload at 256 g (several warps write its groups at
// once, and none knows the others' fallbacks). A row that a put carries to another node is packed instead,
// so that only the bytes its groups need cross the network: group g's payload (160 code bytes, or the 256
// BF16 bytes of a fallback group) at 160 g + 96 F, F = the fallback groups before g. Its fallback bits (bit
// g % 32 of word g / 32 set: group g is a fallback group) travel with the metadata words, and the receiver
// counts F from them. A packed row's group g lies within [0, 256 (g + 1)), the BF16 row's groups 0..g: a
// warp that encodes a staged row in place, group after group, writes only input it has read.
constexpr int kLogfmtFallbackExtraBytes = kLogfmtGroupSize * 2 - kLogfmtCodeBytes;  // 96

EPX_HD size_t logfmt_packed_offset(int group, int fallbacks_before) {
  return size_t(group) * kLogfmtCodeBytes + size_t(fallbacks_before) * kLogfmtFallbackExtraBytes;
}

// The packed payload's size: what the put of a row of `num_groups` groups, `num_fallbacks` of them
// fallback groups, sends besides its metadata.
EPX_HD size_t logfmt_packed_bytes(int num_groups, int num_fallbacks) {
  return logfmt_packed_offset(num_groups, num_fallbacks);
}

EPX_HD int logfmt_fallback_words(int num_groups) {
  return (num_groups + 31) / 32;
}

// F of group `group`: the bits set below it in the fallback words, `word(w)` reading word w.
template <typename Word>
EPX_HD int logfmt_fallbacks_before(int group, Word word) {
  int count = 0;
  for (int w = 0; w < group / 32; ++w) count += popcount32(word(w));
  return count + popcount32(word(group / 32) & ((1u << (group % 32)) - 1u));
}

// ---- One group: the host reference (a kernel does the same with one warp, 4 channels per lane) ----

EPX_HD void logfmt_store_u16(uint8_t* dst, uint16_t value) {
  dst[0] = static_cast<uint8_t>(value);
  dst[1] = static_cast<uint8_t>(value >> 8);
}

EPX_HD uint16_t logfmt_load_u16(const uint8_t* src) {
  return static_cast<uint16_t>(src[0] | (static_cast<uint16_t>(src[1]) << 8));
}

// Writes one slot and returns its size: kLogfmtEncodedBytes or kLogfmtFallbackBytes.
inline int logfmt_encode_group(const uint16_t* bf16_in, uint8_t* slot_out) {
  float max_key = 0.0f;
  float min_key = bits_as_float(0x7F800000u);
  for (int i = 0; i < kLogfmtGroupSize; ++i) {
    const float x = bf16_to_float(bf16_in[i]);
    max_key = fmaxf(max_key, logfmt_abs_for_max(x));
    min_key = fminf(min_key, logfmt_abs_for_min(x));
  }
  if (!logfmt_group_qualifies(max_key)) {
    logfmt_store_u16(slot_out, kLogfmtFallbackMarker);
    logfmt_store_u16(slot_out + 2, 0);
    for (int i = 0; i < kLogfmtGroupSize; ++i)
      logfmt_store_u16(slot_out + kLogfmtMetaBytes + 2 * i, bf16_in[i]);
    return kLogfmtFallbackBytes;
  }
  const LogfmtParams params = logfmt_params(max_key, min_key);
  logfmt_store_u16(slot_out, params.max_bits);
  logfmt_store_u16(slot_out + 2, params.min_bits);
  for (int i = 0; i < kLogfmtGroupSize; i += 4) {
    uint16_t codes[4];
    for (int j = 0; j < 4; ++j) codes[j] = logfmt_encode_value(bf16_to_float(bf16_in[i + j]), params);
    logfmt_store_codes4(slot_out + kLogfmtMetaBytes + (i / 4) * 5,
                        logfmt_pack_codes4(codes[0], codes[1], codes[2], codes[3]));
  }
  return kLogfmtEncodedBytes;
}

// Decodes one slot into 128 floats (exactly the BF16 values for a fallback slot).
inline void logfmt_decode_group(const uint8_t* slot_in, float* out) {
  const uint16_t max_bits = logfmt_load_u16(slot_in);
  if (max_bits == kLogfmtFallbackMarker) {
    for (int i = 0; i < kLogfmtGroupSize; ++i)
      out[i] = bf16_to_float(logfmt_load_u16(slot_in + kLogfmtMetaBytes + 2 * i));
    return;
  }
  const LogfmtParams params = logfmt_params_from_meta(max_bits, logfmt_load_u16(slot_in + 2));
  for (int i = 0; i < kLogfmtGroupSize; i += 4) {
    const uint64_t packed = logfmt_load_codes4(slot_in + kLogfmtMetaBytes + (i / 4) * 5);
    for (int j = 0; j < 4; ++j) out[i + j] = logfmt_decode_value(logfmt_unpack_code4(packed, j), params);
  }
}

}  // namespace epx
