#include <cstddef>

#include "epx/error.hpp"
#include "formats/scale_format.hpp"
#include "reference/low_latency.hpp"
#include "reference/low_latency_checks.hpp"

namespace epx::reference {

int ll_num_ue8m0_words(int hidden) {
  return row_format(ScaleFormat::kFp8Ue8m0).scale_words(hidden);
}

bool ll_is_masked(const LowLatencyParams& params, int rank) {
  for (const int masked : params.masked_ranks) {
    if (masked == rank) return true;
  }
  return false;
}

std::vector<std::vector<int>> low_latency_recv_rows(const LowLatencyParams& params,
                                                    const std::vector<const int64_t*>& topk_idx_per_rank,
                                                    const std::vector<int>& num_tokens_per_rank) {
  detail::check_low_latency_params(params);
  const int num_ranks = params.num_ranks;
  const int num_experts = params.num_experts;
  const int num_topk = params.num_topk;
  EPX_CHECK(topk_idx_per_rank.size() == static_cast<size_t>(num_ranks), "topk_idx_per_rank.size()",
            topk_idx_per_rank.size(), "must equal num_ranks");
  EPX_CHECK(num_tokens_per_rank.size() == static_cast<size_t>(num_ranks), "num_tokens_per_rank.size()",
            num_tokens_per_rank.size(), "must equal num_ranks");

  // Pass 1: each listing's position among its source's tokens for that expert (ascending token index);
  // num_rows_from[s][e] ends as the rows source s sends to expert e.
  std::vector<std::vector<int>> rows(num_ranks);
  std::vector<std::vector<int>> num_rows_from(num_ranks, std::vector<int>(num_experts, 0));
  for (int s = 0; s < num_ranks; ++s) {
    const int num_tokens = num_tokens_per_rank[s];
    EPX_CHECK(num_tokens >= 0, "num_tokens", num_tokens, "must be >= 0");
    EPX_CHECK(num_tokens <= params.num_max_dispatch_tokens_per_rank, "num_tokens", num_tokens,
              "must be <= num_max_dispatch_tokens_per_rank");
    const int64_t* ids = topk_idx_per_rank[s];
    check_topk_idx(ids, num_tokens, num_topk, num_experts);
    rows[s].assign(static_cast<size_t>(num_tokens) * num_topk, -1);
    if (ll_is_masked(params, s)) continue;  // a masked source sends nothing
    for (int t = 0; t < num_tokens; ++t) {
      const size_t base = static_cast<size_t>(t) * num_topk;
      for (int k = 0; k < num_topk; ++k) {
        const int64_t expert = ids[base + k];
        if (expert < 0) continue;
        if (ll_is_masked(params, static_cast<int>(expert / (num_experts / num_ranks)))) continue;
        int first = k;
        for (int j = 0; j < k && first == k; ++j) {
          if (ids[base + j] == expert) first = j;
        }
        rows[s][base + k] = first == k ? num_rows_from[s][expert]++ : rows[s][base + first];
      }
    }
  }
  // Pass 2: shift by the rows of lower source ranks in the same expert block. Duplicates copied an
  // unshifted position above, so shifting every entry keeps them equal to their first listing.
  for (int s = 0; s < num_ranks; ++s) {
    const int64_t* ids = topk_idx_per_rank[s];
    std::vector<int> begin(num_experts, 0);
    for (int lower = 0; lower < s; ++lower) {
      for (int e = 0; e < num_experts; ++e) begin[e] += num_rows_from[lower][e];
    }
    for (size_t i = 0; i < rows[s].size(); ++i) {
      if (rows[s][i] >= 0) rows[s][i] += begin[ids[i]];
    }
  }
  return rows;
}

}  // namespace epx::reference
