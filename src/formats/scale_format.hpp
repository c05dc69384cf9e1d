#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

#include "common/host_device.hpp"
#include "formats/fp8.hpp"
#include "formats/ue8m0.hpp"

// Scale formats: how a dispatched token row travels and lands in the outputs. A format is one enum value and
// one FormatTraits specialization; everything else (row and message bytes, scale columns, the cast's scale,
// the buffer maps' largest rows, the reference's outputs, the bindings' names) is derived from the traits
// through RowFormat, which a call resolves once on the host (docs/ARCHITECTURE.md, "Adding a scale format").
// Low-latency mode casts BF16 rows into the format in its kernel; normal mode moves rows already in it.

namespace epx {

// Values index every table derived from the traits; kCount is the number of formats.
enum class ScaleFormat : uint8_t {
  kBf16 = 0,      // BF16 rows, no scales
  kFp8 = 1,       // e4m3 codes, one float scale per 128 channels
  kFp8Pow2 = 2,   // e4m3 codes, float scales rounded up to powers of two
  kFp8Ue8m0 = 3,  // e4m3 codes, power-of-two scales as UE8M0 bytes, four groups to an int32 word
  kCount
};
constexpr int kNumScaleFormats = static_cast<int>(ScaleFormat::kCount);

// What one channel of a row is on the wire and in the outputs.
enum class ElementCoding : uint8_t { kBf16, kE4m3 };
// How a row's scales are stored in the outputs (on the low-latency wire they are always one float per
// group, see RowFormat::msg_bytes).
enum class ScaleStorage : uint8_t { kNone, kFloat, kUe8m0x4 };

template <ScaleFormat F>
struct FormatTraits;

// What a format is made of. Each specialization below names its format and takes one of these.
template <ElementCoding kCodingOf, int kGroupSizeOf, bool kPow2ScalesOf, ScaleStorage kStorageOf>
struct FormatMakeup {
  static constexpr ElementCoding kCoding = kCodingOf;
  static constexpr int kGroupSize = kGroupSizeOf;     // channels per scale, 0: no scales
  static constexpr bool kPow2Scales = kPow2ScalesOf;  // scales rounded up to powers of two
  static constexpr ScaleStorage kStorage = kStorageOf;
};

template <>
struct FormatTraits<ScaleFormat::kBf16> : FormatMakeup<ElementCoding::kBf16, 0, false, ScaleStorage::kNone> {
  static constexpr const char* kName = "bf16";
};
template <>
struct FormatTraits<ScaleFormat::kFp8>
    : FormatMakeup<ElementCoding::kE4m3, kFp8GroupSize, false, ScaleStorage::kFloat> {
  static constexpr const char* kName = "fp8";
};
template <>
struct FormatTraits<ScaleFormat::kFp8Pow2>
    : FormatMakeup<ElementCoding::kE4m3, kFp8GroupSize, true, ScaleStorage::kFloat> {
  static constexpr const char* kName = "fp8_pow2";
};
// UE8M0 holds powers of two only, so its scales are rounded.
template <>
struct FormatTraits<ScaleFormat::kFp8Ue8m0>
    : FormatMakeup<ElementCoding::kE4m3, kFp8GroupSize, true, ScaleStorage::kUe8m0x4> {
  static constexpr const char* kName = "fp8_ue8m0";
};

// Calls visit(FormatTraits<format>{}) for a format known only at run time (every specialization is
// instantiated, so a value without one fails to build). `visit` returns the same type for every format.
template <typename Visit, size_t... kIndex>
constexpr auto visit_format_traits(ScaleFormat format, Visit&& visit, std::index_sequence<kIndex...>) {
  decltype(visit(FormatTraits<ScaleFormat::kBf16>{})) result{};
  ((static_cast<size_t>(format) == kIndex
        ? static_cast<void>(result = visit(FormatTraits<static_cast<ScaleFormat>(kIndex)>{}))
        : static_cast<void>(0)),
   ...);
  return result;
}
template <typename Visit>
constexpr auto visit_format_traits(ScaleFormat format, Visit&& visit) {
  return visit_format_traits(format, visit, std::make_index_sequence<kNumScaleFormats>{});
}

// The traits of one format as plain values: what the host derives sizes from and what a kernel's Args carry
// (resolved once per launch, so a kernel branches on a launch constant, never per element).
struct RowFormat {
  ScaleFormat format;
  ElementCoding coding;
  ScaleStorage storage;
  bool pow2_scales;  // scales rounded up to powers of two (exactly representable as UE8M0)
  int group_size;    // channels per scale, 0: no scales

  // ---- Rows ----
  EPX_HD constexpr bool casts() const { return coding != ElementCoding::kBf16; }
  EPX_HD constexpr bool has_scales() const { return storage != ScaleStorage::kNone; }
  EPX_HD constexpr size_t element_bytes() const { return coding == ElementCoding::kBf16 ? 2 : 1; }
  EPX_HD constexpr size_t row_bytes(int hidden) const { return size_t(hidden) * element_bytes(); }
  // Scale groups of a row (0 without scales).
  EPX_HD constexpr int num_groups(int hidden) const { return group_size == 0 ? 0 : hidden / group_size; }
  // 4-byte scale words per row in the outputs: a float per group, or UE8M0 bytes packed four to a word.
  EPX_HD constexpr int scale_words(int hidden) const {
    return storage == ScaleStorage::kUe8m0x4 ? ue8m0_num_words(num_groups(hidden)) : num_groups(hidden);
  }
  EPX_HD constexpr size_t scale_bytes(int hidden) const {
    return sizeof(uint32_t) * size_t(scale_words(hidden));
  }
  // A low-latency message: the cast row, then one float scale per group (stored as the outputs want it only
  // on receipt, so the sender writes each group's scale as soon as it has it).
  EPX_HD constexpr size_t msg_bytes(int hidden) const {
    return row_bytes(hidden) + sizeof(float) * size_t(num_groups(hidden));
  }
  EPX_HD constexpr size_t msg_scales_offset(int hidden) const { return row_bytes(hidden); }

  // ---- The cast (group_size channels at a time) ----
  // The scale of a group whose largest magnitude is `amax` (fp8_amax_update).
  EPX_HD Fp8GroupScale group_scale(float amax) const { return fp8_group_scale(amax, pow2_scales); }
};

// The RowFormat of a format known at run time.
constexpr RowFormat row_format(ScaleFormat format) {
  return visit_format_traits(format, [format](auto traits) {
    using Traits = decltype(traits);
    return RowFormat{format, Traits::kCoding, Traits::kStorage, Traits::kPow2Scales, Traits::kGroupSize};
  });
}

// The host reference of a format's cast of one BF16 row, as a low-latency message carries it:
// row_bytes(hidden) bytes of codes and num_groups(hidden) float scales (the kernels cast the same way with
// the same functions, a group per 8 lanes). Host only.
inline void cast_row(const RowFormat& format, const uint16_t* bf16_row, int hidden, uint8_t* codes_out,
                     float* scales_out) {
  switch (format.coding) {
    case ElementCoding::kBf16:
      std::memcpy(codes_out, bf16_row, format.row_bytes(hidden));
      return;
    case ElementCoding::kE4m3:
      quantize_fp8_row(bf16_row, hidden, format.pow2_scales, codes_out, scales_out);
      return;
  }
}

// Low-latency mode's API names a format with DeepEP's flags. LowLatencyDispatchInput carries the same fields
// (low_latency_scale_format reads them off it); the reference's options are this struct.
struct LowLatencyFormatFlags {
  bool use_fp8 = true;       // cast per 128 channels
  bool round_scale = false;  // FP8 scales rounded up to powers of two
  bool use_ue8m0 = false;    // scales as packed UE8M0 bytes (requires use_fp8 and round_scale)
};
// The flags by name (the reference's binding binds each).
constexpr std::pair<const char*, bool LowLatencyFormatFlags::*> kLowLatencyFormatFlagNames[] = {
    {"use_fp8", &LowLatencyFormatFlags::use_fp8},
    {"round_scale", &LowLatencyFormatFlags::round_scale},
    {"use_ue8m0", &LowLatencyFormatFlags::use_ue8m0}};
static_assert(sizeof(LowLatencyFormatFlags) ==
                  sizeof(kLowLatencyFormatFlagNames) / sizeof(kLowLatencyFormatFlagNames[0]) * sizeof(bool),
              "kLowLatencyFormatFlagNames must name every flag");

// The format `flags` name (LowLatencyFormatFlags, or an input with the same fields). Host only: throws
// epx::Error naming the flag of a combination that is no format.
template <typename Flags>
ScaleFormat low_latency_scale_format(const Flags& flags) {
  EPX_CHECK(!flags.use_ue8m0 || flags.use_fp8, "use_ue8m0", flags.use_ue8m0, "requires use_fp8");
  EPX_CHECK(!flags.use_ue8m0 || flags.round_scale, "use_ue8m0", flags.use_ue8m0, "requires round_scale");
  if (!flags.use_fp8) return ScaleFormat::kBf16;
  if (flags.use_ue8m0) return ScaleFormat::kFp8Ue8m0;
  return flags.round_scale ? ScaleFormat::kFp8Pow2 : ScaleFormat::kFp8;
}

constexpr const char* scale_format_name(ScaleFormat format) {
  return visit_format_traits(format, [](auto traits) { return decltype(traits)::kName; });
}

// Calls visit(format) for every format, in enum order (size tables, bindings, tests).
template <typename Visit>
constexpr void for_each_scale_format(Visit&& visit) {
  for (int f = 0; f < kNumScaleFormats; ++f) visit(static_cast<ScaleFormat>(f));
}

// The most bytes a row of `hidden` channels takes with its scales in any format (what buffers that serve
// every format are sized for).
constexpr size_t largest_row_bytes(int hidden) {
  size_t largest = 0;
  for_each_scale_format([&](ScaleFormat f) {
    const RowFormat format = row_format(f);
    const size_t bytes = format.row_bytes(hidden) + format.scale_bytes(hidden);
    largest = bytes > largest ? bytes : largest;
  });
  return largest;
}

// The largest low-latency message of a row of `hidden` channels in any format.
constexpr size_t largest_msg_bytes(int hidden) {
  size_t largest = 0;
  for_each_scale_format([&](ScaleFormat f) {
    const size_t bytes = row_format(f).msg_bytes(hidden);
    largest = bytes > largest ? bytes : largest;
  });
  return largest;
}

}  // namespace epx
