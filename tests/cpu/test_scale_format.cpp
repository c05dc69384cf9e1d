#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "buffer_map/low_latency_buffer_map.hpp"
#include "buffer_map/normal_buffer_map.hpp"
#include "formats/fp8.hpp"
#include "formats/scale_format.hpp"
#include "formats/ue8m0.hpp"
#include "reference/low_latency.hpp"
#include "reference/normal.hpp"
#include "reference/test_data.hpp"
#include "small_low_latency_params.hpp"

namespace {

using namespace epx;

// ---- The traits against the sizes the modes used before there were traits ----

struct ExpectedFormat {
  ScaleFormat format;
  const char* name;
  size_t row_bytes;  // at hidden 7168
  int scale_words;   // at hidden 7168 (56 groups)
  size_t msg_bytes;  // at hidden 7168: the row and a float per group
  bool pow2_scales;
};

constexpr int kHidden = 7168;
const ExpectedFormat kExpected[] = {
    {ScaleFormat::kBf16, "bf16", 14336, 0, 14336, false},
    {ScaleFormat::kFp8, "fp8", 7168, 56, 7392, false},
    {ScaleFormat::kFp8Pow2, "fp8_pow2", 7168, 56, 7392, true},
    {ScaleFormat::kFp8Ue8m0, "fp8_ue8m0", 7168, 14, 7392, true},
};

TEST(ScaleFormat, TraitsGiveTheSizesOfEveryFormat) {
  static_assert(sizeof(kExpected) / sizeof(kExpected[0]) == kNumScaleFormats, "a row per format");
  for (const ExpectedFormat& e : kExpected) {
    SCOPED_TRACE(e.name);
    const RowFormat format = row_format(e.format);
    EXPECT_EQ(format.format, e.format);
    EXPECT_STREQ(scale_format_name(e.format), e.name);
    EXPECT_EQ(format.row_bytes(kHidden), e.row_bytes);
    EXPECT_EQ(format.scale_words(kHidden), e.scale_words);
    EXPECT_EQ(format.scale_bytes(kHidden), 4u * e.scale_words);
    EXPECT_EQ(format.msg_bytes(kHidden), e.msg_bytes);
    EXPECT_EQ(format.msg_scales_offset(kHidden), e.row_bytes);
    EXPECT_EQ(format.pow2_scales, e.pow2_scales);
    EXPECT_EQ(format.casts(), e.format != ScaleFormat::kBf16);
    EXPECT_EQ(format.has_scales(), e.format != ScaleFormat::kBf16);
  }
}

TEST(ScaleFormat, Ue8m0WordsRoundUpToWholeWords) {
  const RowFormat format = row_format(ScaleFormat::kFp8Ue8m0);
  EXPECT_EQ(format.scale_words(128), 1);  // 1 group
  EXPECT_EQ(format.scale_words(384), 1);  // 3 groups
  EXPECT_EQ(format.scale_words(512), 1);  // 4 groups
  EXPECT_EQ(format.scale_words(640), 2);  // 5 groups
  EXPECT_EQ(format.scale_words(kHidden), ue8m0_num_words(kHidden / kFp8GroupSize));
  EXPECT_EQ(reference::ll_num_ue8m0_words(640), 2);
}

TEST(ScaleFormat, EveryFormatHasOneNameAndOneValue) {
  std::set<std::string> names;
  int count = 0;
  for_each_scale_format([&](ScaleFormat f) {
    EXPECT_EQ(static_cast<int>(f), count++);
    EXPECT_EQ(row_format(f).format, f);
    names.insert(scale_format_name(f));
  });
  EXPECT_EQ(count, kNumScaleFormats);
  EXPECT_EQ(names.size(), size_t(kNumScaleFormats));
}

TEST(ScaleFormat, TheGroupScaleIsFp8sOwn) {
  for (const float amax : {0.0f, 1e-6f, 0.37f, 448.0f, 1000.5f, 3e38f}) {
    for_each_scale_format([&](ScaleFormat f) {
      const RowFormat format = row_format(f);
      if (!format.casts()) return;
      const Fp8GroupScale got = format.group_scale(amax);
      const Fp8GroupScale want = fp8_group_scale(amax, format.pow2_scales);
      EXPECT_EQ(float_as_bits(got.scale), float_as_bits(want.scale)) << scale_format_name(f) << " " << amax;
      EXPECT_EQ(float_as_bits(got.inv_scale), float_as_bits(want.inv_scale));
    });
  }
}

// ---- The API's flags at the boundary ----

struct Flags {
  bool use_fp8;
  bool round_scale;
  bool use_ue8m0;
};

TEST(ScaleFormat, LowLatencyFlagsNameOneFormat) {
  EXPECT_EQ(low_latency_scale_format(Flags{false, false, false}), ScaleFormat::kBf16);
  EXPECT_EQ(low_latency_scale_format(Flags{false, true, false}), ScaleFormat::kBf16);
  EXPECT_EQ(low_latency_scale_format(Flags{true, false, false}), ScaleFormat::kFp8);
  EXPECT_EQ(low_latency_scale_format(Flags{true, true, false}), ScaleFormat::kFp8Pow2);
  EXPECT_EQ(low_latency_scale_format(Flags{true, true, true}), ScaleFormat::kFp8Ue8m0);
  // The reference's options carry the same flags (so does the public LowLatencyDispatchInput, whose header
  // needs CUDA's: the GPU tests read it).
  reference::LowLatencyDispatchOptions options;
  options.use_fp8 = false;
  EXPECT_EQ(low_latency_scale_format(options), ScaleFormat::kBf16);
}

TEST(ScaleFormat, LowLatencyFlagsThatNameNoFormatAreRefused) {
  EXPECT_THROW(low_latency_scale_format(Flags{false, true, true}), Error);
  EXPECT_THROW(low_latency_scale_format(Flags{true, false, true}), Error);
  try {
    low_latency_scale_format(Flags{true, false, true});
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("use_ue8m0"), std::string::npos) << error.what();
    EXPECT_NE(std::string(error.what()).find("requires round_scale"), std::string::npos) << error.what();
  }
}

// ---- The buffer maps: sized for the largest format, as before ----

TEST(ScaleFormat, BufferMapsHoldTheLargestFormat) {
  for (const int hidden : {128, 384, 2048, 4096, 7168, 16384}) {
    SCOPED_TRACE(hidden);
    const LowLatencyBufferMap map(8, hidden, 2, 4);
    const size_t groups = size_t(hidden) / 128;
    const size_t before = align_up(std::max(size_t(hidden) * 2, size_t(hidden) + 4 * groups), 16);
    EXPECT_EQ(map.dispatch_msg_bytes(), before);
    EXPECT_EQ(map.dispatch_msg_bytes(), align_up(largest_msg_bytes(hidden), 16));
    for_each_scale_format(
        [&](ScaleFormat f) { EXPECT_LE(row_format(f).msg_bytes(hidden), map.dispatch_msg_bytes()); });
    const size_t hidden_bytes = size_t(hidden) * 2;
    const NormalRecord record_before{static_cast<int>(hidden_bytes), 0, kMaxTopk, kMaxTopk, true};
    EXPECT_EQ(NormalRecord::largest(hidden_bytes).bytes(), record_before.bytes());
    for_each_scale_format([&](ScaleFormat f) {
      const RowFormat format = row_format(f);
      const NormalRecord record{static_cast<int>(format.row_bytes(hidden)), format.scale_words(hidden),
                                kMaxTopk, kMaxTopk, true};
      EXPECT_LE(record.bytes(), NormalRecord::largest(hidden_bytes).bytes()) << scale_format_name(f);
    });
  }
}

// ---- The reference: every format's outputs come out in the traits' sizes, each the same cast ----

reference::LowLatencyParams ll_params(int hidden) {
  return epx::test_support::small_low_latency_params(hidden);
}

reference::LowLatencyDispatchOptions options_of(ScaleFormat f) {
  reference::LowLatencyDispatchOptions options;
  options.use_fp8 = f != ScaleFormat::kBf16;
  options.round_scale = f == ScaleFormat::kFp8Pow2 || f == ScaleFormat::kFp8Ue8m0;
  options.use_ue8m0 = f == ScaleFormat::kFp8Ue8m0;
  return options;
}

std::vector<reference::LowLatencyDispatchRankInput> ll_inputs(const reference::LowLatencyParams& params) {
  std::vector<reference::LowLatencyDispatchRankInput> inputs(params.num_ranks);
  for (int s = 0; s < params.num_ranks; ++s) {
    inputs[s].num_tokens = 3;
    inputs[s].x = reference::random_bf16_tokens(11 + s, 3, params.hidden, s);
    inputs[s].topk_idx = {0, 3, 1, -1, 2, 0};
  }
  return inputs;
}

TEST(ScaleFormat, LowLatencyReferenceOutputsTakeTheTraitsSizes) {
  const reference::LowLatencyParams params = ll_params(640);  // 5 groups: the UE8M0 word is partly padding
  const std::vector<reference::LowLatencyDispatchRankInput> inputs = ll_inputs(params);
  const size_t rows =
      size_t(params.num_experts / params.num_ranks) * reference::ll_num_rows_per_expert(params);
  for_each_scale_format([&](ScaleFormat f) {
    SCOPED_TRACE(scale_format_name(f));
    const RowFormat format = row_format(f);
    const auto outputs = reference::low_latency_dispatch(params, options_of(f), inputs);
    for (const auto& out : outputs) {
      EXPECT_EQ(format.casts() ? out.recv_x_fp8.size() : out.recv_x.size() * 2, rows * format.row_bytes(640));
      const size_t scale_words = out.recv_x_scales.size() + out.recv_x_scales_ue8m0.size();
      EXPECT_EQ(scale_words, rows * format.scale_words(640));
    }
  });
}

TEST(ScaleFormat, LowLatencyReferenceCastsAsTheTraitsSay) {
  const reference::LowLatencyParams params = ll_params(640);
  const std::vector<reference::LowLatencyDispatchRankInput> inputs = ll_inputs(params);
  const auto pow2 = reference::low_latency_dispatch(params, options_of(ScaleFormat::kFp8Pow2), inputs);
  const auto ue8m0 = reference::low_latency_dispatch(params, options_of(ScaleFormat::kFp8Ue8m0), inputs);
  const int num_rows = reference::ll_num_rows_per_expert(params);
  const int num_groups = 5;
  const int num_words = row_format(ScaleFormat::kFp8Ue8m0).scale_words(640);
  for (int d = 0; d < params.num_ranks; ++d) {
    EXPECT_EQ(pow2[d].recv_x_fp8, ue8m0[d].recv_x_fp8);  // one cast, two ways of storing its scales
    for (int le = 0; le < 2; ++le) {
      for (int row = 0; row < pow2[d].recv_count[le]; ++row) {
        uint8_t bytes[8] = {};
        for (int g = 0; g < num_groups; ++g)
          bytes[g] =
              ue8m0_from_pow2_scale(pow2[d].recv_x_scales[ll_scale_index(le, row, g, num_rows, num_groups)]);
        for (int w = 0; w < num_words; ++w) {
          EXPECT_EQ(ue8m0[d].recv_x_scales_ue8m0[ll_scale_index(le, row, w, num_rows, num_words)],
                    pack_ue8m0x4(bytes[4 * w], bytes[4 * w + 1], bytes[4 * w + 2], bytes[4 * w + 3]));
        }
      }
    }
  }
  // cast_row is the reference's cast: the row's codes and scales as quantize_fp8_row gives them.
  const RowFormat format = row_format(ScaleFormat::kFp8);
  std::vector<uint8_t> codes(format.row_bytes(640)), want_codes(640);
  std::vector<float> scales(num_groups), want_scales(num_groups);
  cast_row(format, inputs[0].x.data(), 640, codes.data(), scales.data());
  quantize_fp8_row(inputs[0].x.data(), 640, false, want_codes.data(), want_scales.data());
  EXPECT_EQ(codes, want_codes);
  EXPECT_EQ(scales, want_scales);
}

TEST(ScaleFormat, NormalReferenceCarriesEveryFormatInTheTraitsSizes) {
  constexpr int kNormalHidden = 640;
  for_each_scale_format([&](ScaleFormat f) {
    SCOPED_TRACE(scale_format_name(f));
    const RowFormat format = row_format(f);
    reference::NormalDispatchParams params;
    params.num_ranks = 2;
    params.num_experts = 4;
    params.hidden = kNormalHidden;
    params.format = f;
    params.num_topk = 1;
    std::vector<reference::NormalDispatchRankInput> inputs(2);
    for (int s = 0; s < 2; ++s) {
      reference::NormalDispatchRankInput& in = inputs[s];
      in.num_tokens = 2;
      in.topk_idx = {0, 3};
      in.topk_weights = {1.0f, 0.5f};
      if (!format.casts()) in.x.assign(2 * kNormalHidden, uint16_t(s + 1));
      in.x_fp8.assign(format.casts() ? 2 * format.row_bytes(kNormalHidden) : 0, uint8_t(s + 1));
      in.x_scales.assign(2 * size_t(format.scale_words(kNormalHidden)), float(s + 1));
    }
    const reference::NormalDispatchResult result = reference::normal_dispatch(params, inputs);
    for (const reference::NormalDispatchRankOutput& out : result.ranks) {
      const size_t rows = size_t(out.num_rows);
      EXPECT_EQ(format.casts() ? out.recv_x_fp8.size() : out.recv_x.size() * 2,
                rows * format.row_bytes(kNormalHidden));
      EXPECT_EQ(out.recv_x_scales.size(), rows * format.scale_words(kNormalHidden));
      for (size_t r = 0; r < rows; ++r) {
        const float source = float(out.recv_src_rank[r] + 1);
        for (int w = 0; w < format.scale_words(kNormalHidden); ++w)
          EXPECT_EQ(out.recv_x_scales[r * format.scale_words(kNormalHidden) + w], source);
      }
    }
  });
}

}  // namespace
