#include <gtest/gtest.h>

#include <cstddef>
#include <string>
#include <vector>

#include "epx/error.hpp"
#include "epx/layout/normal_layout.hpp"

namespace {

using epx::NormalLayout;
using epx::NormalShape;

// The TARGETS.md shape: 4 ranks, 256 experts, hidden 7168, BF16 rows, top-8.
NormalShape bf16_shape(int num_ranks = 4, int hidden = 7168, int num_topk = 8) {
  return NormalShape{num_ranks, 256, hidden, hidden * 2, 0, num_topk};
}

struct Region {
  std::string name;
  size_t begin, end;
};

std::vector<Region> half_regions(const NormalLayout& l) {
  return {{"send_counts", l.send_counts_offset(), l.send_counts_offset() + l.send_counts_bytes()},
          {"expert_counts", l.expert_counts_offset(), l.expert_counts_offset() + l.expert_counts_bytes()},
          {"send_lists", l.send_lists_offset(), l.send_lists_offset() + l.send_lists_bytes()},
          {"stage_x", l.stage_x_offset(), l.stage_x_offset() + l.stage_x_bytes()},
          {"stage_scales", l.stage_scales_offset(), l.stage_scales_offset() + l.stage_scales_bytes()},
          {"stage_topk_idx", l.stage_topk_idx_offset(), l.stage_topk_idx_offset() + l.stage_topk_bytes()},
          {"stage_topk_weights", l.stage_topk_weights_offset(),
           l.stage_topk_weights_offset() + l.stage_topk_bytes()},
          {"combine_x", l.combine_x_offset(), l.combine_x_offset() + l.combine_x_bytes()},
          {"combine_weights", l.combine_weights_offset(),
           l.combine_weights_offset() + l.combine_weights_bytes()}};
}

TEST(NormalLayout, RegionsAreAlignedContiguousAndInsideTheHalf) {
  for (const NormalShape& shape : {bf16_shape(), bf16_shape(2, 2048, 0), bf16_shape(8, 2688, 16),
                                   NormalShape{4, 256, 7168, 7168, 56, 8}}) {
    const NormalLayout layout = NormalLayout::with_capacity(shape, 4096);
    size_t expected_begin = 0;
    for (const Region& region : half_regions(layout)) {
      EXPECT_EQ(region.begin % epx::kNormalAlign, 0u) << region.name;
      EXPECT_EQ(region.begin, expected_begin) << region.name;
      expected_begin = region.end;
    }
    EXPECT_EQ(expected_begin, layout.half_bytes());
    EXPECT_EQ(layout.half_stride, layout.half_bytes());
    EXPECT_EQ(layout.half_offset(0), NormalLayout::kControlBytes);
    EXPECT_EQ(layout.total_bytes(), NormalLayout::kControlBytes + 2 * layout.half_bytes());
  }
}

TEST(NormalLayout, PinnedSizesOfTheTargetShape) {
  const NormalLayout layout = NormalLayout::with_capacity(bf16_shape(), 4096);
  // 4096 staged rows of 14336 bytes, returned rows of 4 ranks x 4096 x 14336 bytes, plus counts and lists.
  EXPECT_EQ(layout.stage_x_bytes(), 4096u * 14336u);
  EXPECT_EQ(layout.combine_x_bytes(), 4u * 4096u * 14336u);
  EXPECT_EQ(layout.send_lists_bytes(), 4u * 4096u * 4u);
  EXPECT_EQ(layout.stage_topk_bytes(), 4096u * 8u * 4u);
  // 128 + 16384 + 65536 + 58720256 + 0 + 2 x 131072 + 234881024 + 524288
  EXPECT_EQ(layout.half_bytes(), 294469760u);
  EXPECT_EQ(sizeof(NormalLayout::Control), 128u);
  EXPECT_EQ(NormalLayout::kControlBytes, 128u);
}

TEST(NormalLayout, FitFindsTheLargestCapacityAndKeepsHalvesAtFixedAddresses) {
  const NormalShape shape = bf16_shape();
  const size_t bytes = epx::normal_nvl_buffer_size_hint(7168 * 2, 4);
  const NormalLayout fitted = NormalLayout::fit(shape, bytes);
  EXPECT_GE(fitted.capacity, 4096);
  EXPECT_LE(fitted.half_bytes(), fitted.half_stride);
  EXPECT_LE(fitted.total_bytes(), bytes);
  EXPECT_GT(NormalLayout::with_capacity(shape, fitted.capacity + 1).half_bytes(), fitted.half_stride);
  // Another shape in the same buffer: same halves, whatever its capacity.
  const NormalLayout fp8 = NormalLayout::fit(NormalShape{4, 256, 7168, 7168, 56, 8}, bytes);
  EXPECT_EQ(fp8.half_stride, fitted.half_stride);
  EXPECT_GT(fp8.capacity, fitted.capacity);
  EXPECT_EQ(NormalLayout::fit(shape, 64).capacity, 0);
}

TEST(NormalLayout, SizeHintIsRoundedAndCoversTheDefaultTokens) {
  for (int ranks : {1, 2, 4, 8}) {
    const size_t hint = epx::normal_nvl_buffer_size_hint(7168 * 2, ranks);
    EXPECT_EQ(hint % (size_t(2) << 20), 0u);
    EXPECT_GE(NormalLayout::fit(bf16_shape(ranks, 7168, epx::kMaxTopk), hint).capacity,
              epx::kDefaultMaxTokensPerRank);
  }
  EXPECT_THROW(epx::normal_nvl_buffer_size_hint(7168 * 2 + 2, 4), epx::Error);
  EXPECT_THROW(epx::normal_nvl_buffer_size_hint(7168 * 2, 9), epx::Error);
}

TEST(NormalLayout, ShapeChecksNameTheArgument) {
  const auto message_of = [](const NormalShape& shape) {
    try {
      epx::validate_normal_shape(shape);
    } catch (const epx::Error& error) {
      return std::string(error.what());
    }
    return std::string();
  };
  EXPECT_NE(message_of(NormalShape{9, 256, 7168, 14336, 0, 8}).find("num_ranks = 9"), std::string::npos);
  EXPECT_NE(message_of(NormalShape{4, 250, 7168, 14336, 0, 8}).find("num_experts = 250"), std::string::npos);
  EXPECT_NE(message_of(NormalShape{4, 256, 7164, 14328, 0, 8}).find("hidden = 7164"), std::string::npos);
  EXPECT_NE(message_of(NormalShape{4, 256, 7168, 14336, 0, 17}).find("num_topk = 17"), std::string::npos);
  EXPECT_EQ(message_of(bf16_shape()), "");
}

}  // namespace
