#include "epx/layout/normal_layout.hpp"

#include "epx/error.hpp"

namespace epx {

void validate_normal_shape(const NormalShape& shape) {
  EPX_CHECK(shape.num_ranks >= 1, "num_ranks", shape.num_ranks, "must be >= 1");
  EPX_CHECK(shape.num_ranks <= kMaxNvlRanks, "num_ranks", shape.num_ranks,
            "must be <= 8 (ranks of one NVLink domain)");
  EPX_CHECK(shape.num_experts >= 0, "num_experts", shape.num_experts, "must be >= 0");
  EPX_CHECK(shape.num_experts <= kMaxExperts, "num_experts", shape.num_experts, "must be <= 4096");
  EPX_CHECK(shape.num_experts % shape.num_ranks == 0, "num_experts", shape.num_experts,
            "must be a multiple of num_ranks");
  EPX_CHECK(shape.hidden > 0, "hidden", shape.hidden, "must be > 0");
  EPX_CHECK(shape.hidden % 8 == 0, "hidden", shape.hidden, "must be a multiple of 8 (16-byte BF16 rows)");
  EPX_CHECK(shape.x_row_bytes > 0, "x_row_bytes", shape.x_row_bytes, "must be > 0");
  EPX_CHECK(shape.x_row_bytes % 16 == 0, "x_row_bytes", shape.x_row_bytes, "must be a multiple of 16");
  EPX_CHECK(shape.num_scales >= 0, "num_scales", shape.num_scales, "must be >= 0");
  EPX_CHECK(shape.num_topk >= 0, "num_topk", shape.num_topk, "must be >= 0");
  EPX_CHECK(shape.num_topk <= kMaxTopk, "num_topk", shape.num_topk, "must be <= 16");
}

NormalLayout NormalLayout::fit(const NormalShape& shape, size_t buffer_bytes) {
  validate_normal_shape(shape);
  NormalLayout layout{shape, 0, 0};
  if (buffer_bytes <= NormalLayout::kControlBytes) return layout;
  layout.half_stride = (buffer_bytes - NormalLayout::kControlBytes) / 2 / kNormalAlign * kNormalAlign;
  // Half size is affine in capacity up to alignment padding: estimate from the slope, then step down.
  const size_t base = layout.half_bytes();
  if (layout.half_stride <= base) return layout;
  layout.capacity = 1024;
  const size_t per_token = (layout.half_bytes() - base) / 1024 + 1;
  long capacity = static_cast<long>((layout.half_stride - base) / per_token) + 1;
  capacity = capacity > (1L << 30) ? (1L << 30) : capacity;
  for (layout.capacity = static_cast<int>(capacity);
       layout.capacity > 0 && layout.half_bytes() > layout.half_stride;)
    --layout.capacity;
  return layout;
}

size_t normal_nvl_buffer_size_hint(size_t hidden_bytes, int num_ranks, int max_tokens_per_rank) {
  EPX_CHECK(hidden_bytes % 16 == 0, "hidden_bytes", hidden_bytes, "must be a multiple of 16");
  EPX_CHECK(max_tokens_per_rank >= 1, "max_tokens_per_rank", max_tokens_per_rank, "must be >= 1");
  const int hidden = static_cast<int>(hidden_bytes / 2);
  const NormalShape shape{num_ranks, 0, hidden, static_cast<int>(hidden_bytes), (hidden + 127) / 128,
                          kMaxTopk};
  validate_normal_shape(shape);
  const size_t bytes = NormalLayout::with_capacity(shape, max_tokens_per_rank).total_bytes();
  return align_up(bytes, size_t(2) << 20);
}

}  // namespace epx
