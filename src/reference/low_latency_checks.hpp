#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "epx/error.hpp"
#include "reference/layout.hpp"
#include "reference/low_latency.hpp"

namespace epx::reference::detail {

inline void check_low_latency_params(const LowLatencyParams& params) {
  EPX_CHECK(params.num_ranks >= 1, "num_ranks", params.num_ranks, "must be >= 1");
  EPX_CHECK(params.num_experts >= 1, "num_experts", params.num_experts, "must be >= 1");
  EPX_CHECK(params.num_experts % params.num_ranks == 0, "num_experts", params.num_experts,
            "must be a multiple of num_ranks");
  EPX_CHECK(params.hidden >= 1, "hidden", params.hidden, "must be >= 1");
  EPX_CHECK(params.num_topk >= 1, "num_topk", params.num_topk, "must be >= 1");
  EPX_CHECK(params.num_max_dispatch_tokens_per_rank >= 1, "num_max_dispatch_tokens_per_rank",
            params.num_max_dispatch_tokens_per_rank, "must be >= 1");
  for (const int rank : params.masked_ranks) {
    EPX_CHECK(rank >= 0 && rank < params.num_ranks, "masked_ranks[i]", rank, "must be in [0, num_ranks)");
  }
}

// Shape and id checks of one rank's tokens and routing.
inline void check_low_latency_tokens(const LowLatencyParams& params, int num_tokens, size_t x_size,
                                     const std::vector<int64_t>& topk_idx) {
  EPX_CHECK(num_tokens >= 0, "num_tokens", num_tokens, "must be >= 0");
  EPX_CHECK(num_tokens <= params.num_max_dispatch_tokens_per_rank, "num_tokens", num_tokens,
            "must be <= num_max_dispatch_tokens_per_rank");
  EPX_CHECK(x_size == static_cast<size_t>(num_tokens) * params.hidden, "x.size()", x_size,
            "must be num_tokens * hidden (or L * R * M * hidden for combine)");
  EPX_CHECK(topk_idx.size() == static_cast<size_t>(num_tokens) * params.num_topk, "topk_idx.size()",
            topk_idx.size(), "must be num_tokens * num_topk");
  check_topk_idx(topk_idx.data(), num_tokens, params.num_topk, params.num_experts);
}

}  // namespace epx::reference::detail
