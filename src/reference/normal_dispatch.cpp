#include <cstddef>
#include <cstring>

#include "epx/error.hpp"
#include "reference/layout.hpp"
#include "reference/normal.hpp"

namespace epx::reference {

namespace {

// Routing facts of one source rank, whichever way they were given.
struct SourceRouting {
  std::vector<uint8_t> is_token_in_rank;   // [T, R]
  std::vector<int> num_tokens_per_expert;  // [E] or empty
};

void check_params(const NormalDispatchParams& params) {
  EPX_CHECK(params.num_ranks >= 1, "num_ranks", params.num_ranks, "must be >= 1");
  EPX_CHECK(params.num_experts >= 1, "num_experts", params.num_experts, "must be >= 1");
  EPX_CHECK(params.num_experts % params.num_ranks == 0, "num_experts", params.num_experts,
            "must be a multiple of num_ranks");
  EPX_CHECK(params.hidden >= 1, "hidden", params.hidden, "must be >= 1");
  const RowFormat format = row_format(params.format);
  if (format.has_scales()) {
    EPX_CHECK(params.hidden % format.group_size == 0, "hidden", params.hidden,
              "must be a multiple of 128 for FP8");
  }
  if (params.with_topk)
    EPX_CHECK(params.num_topk >= 1, "num_topk", params.num_topk, "must be >= 1 with top-k");
  EPX_CHECK(params.expert_alignment >= 1, "expert_alignment", params.expert_alignment, "must be >= 1");
  EPX_CHECK(params.num_worst_tokens >= 0, "num_worst_tokens", params.num_worst_tokens, "must be >= 0");
}

void check_payload(const NormalDispatchParams& params, const NormalDispatchRankInput& input) {
  const RowFormat format = row_format(params.format);
  const size_t num_tokens = static_cast<size_t>(input.num_tokens);
  if (!format.casts()) {
    EPX_CHECK(input.x.size() == num_tokens * params.hidden, "x.size()", input.x.size(),
              "must be num_tokens * hidden");
  } else {
    EPX_CHECK(input.x_fp8.size() == num_tokens * format.row_bytes(params.hidden), "x_fp8.size()",
              input.x_fp8.size(), "must be num_tokens * hidden");
  }
  EPX_CHECK(input.x_scales.size() == num_tokens * format.scale_words(params.hidden), "x_scales.size()",
            input.x_scales.size(), "must be num_tokens * hidden / 128");
}

SourceRouting routing_of(const NormalDispatchParams& params, const NormalDispatchRankInput& input) {
  const size_t num_flags = static_cast<size_t>(input.num_tokens) * params.num_ranks;
  SourceRouting routing;
  if (params.with_topk) {
    const size_t num_ids = static_cast<size_t>(input.num_tokens) * params.num_topk;
    EPX_CHECK(input.topk_idx.size() == num_ids, "topk_idx.size()", input.topk_idx.size(),
              "must be num_tokens * num_topk");
    EPX_CHECK(input.topk_weights.size() == num_ids, "topk_weights.size()", input.topk_weights.size(),
              "must be num_tokens * num_topk");
    DispatchLayout layout = get_dispatch_layout(input.topk_idx.data(), input.num_tokens, params.num_topk,
                                                params.num_experts, params.num_ranks);
    EPX_CHECK(input.is_token_in_rank.empty() || input.is_token_in_rank == layout.is_token_in_rank,
              "is_token_in_rank", "given", "must be empty or match topk_idx");
    routing.is_token_in_rank = std::move(layout.is_token_in_rank);
    routing.num_tokens_per_expert = std::move(layout.num_tokens_per_expert);
    return routing;
  }
  EPX_CHECK(input.is_token_in_rank.size() == num_flags, "is_token_in_rank.size()",
            input.is_token_in_rank.size(), "must be num_tokens * num_ranks when dispatching without top-k");
  for (uint8_t flag : input.is_token_in_rank) {
    EPX_CHECK(flag <= 1, "is_token_in_rank", static_cast<int>(flag), "values must be 0 or 1");
  }
  EPX_CHECK(input.num_tokens_per_expert.empty() ||
                input.num_tokens_per_expert.size() == static_cast<size_t>(params.num_experts),
            "num_tokens_per_expert.size()", input.num_tokens_per_expert.size(), "must be 0 or num_experts");
  routing.is_token_in_rank = input.is_token_in_rank;
  routing.num_tokens_per_expert = input.num_tokens_per_expert;
  return routing;
}

// Allocates one destination's outputs, padding rows already in their final state.
NormalDispatchRankOutput make_output(const NormalDispatchParams& params, int num_recv_tokens, int num_rows) {
  const size_t rows = static_cast<size_t>(num_rows);
  const RowFormat format = row_format(params.format);
  NormalDispatchRankOutput out;
  out.num_recv_tokens = num_recv_tokens;
  out.num_rows = num_rows;
  if (!format.casts()) {
    out.recv_x.assign(rows * params.hidden, 0);
  } else {
    out.recv_x_fp8.assign(rows * format.row_bytes(params.hidden), 0);
  }
  out.recv_x_scales.assign(rows * format.scale_words(params.hidden), 0.0f);
  if (params.with_topk) {
    out.recv_topk_idx.assign(rows * params.num_topk, -1);
    out.recv_topk_weights.assign(rows * params.num_topk, 0.0f);
  }
  out.recv_src_rank.assign(rows, -1);
  out.recv_src_token_idx.assign(rows, -1);
  return out;
}

int align_count(int count, int alignment) {
  return (count + alignment - 1) / alignment * alignment;
}

}  // namespace

NormalDispatchResult normal_dispatch(const NormalDispatchParams& params,
                                     const std::vector<NormalDispatchRankInput>& inputs) {
  check_params(params);
  const int num_ranks = params.num_ranks;
  EPX_CHECK(inputs.size() == static_cast<size_t>(num_ranks), "inputs.size()", inputs.size(),
            "must equal num_ranks");
  const int experts_per_rank = params.num_experts / num_ranks;
  const int hidden = params.hidden;
  const int num_topk = params.with_topk ? params.num_topk : 0;
  const RowFormat format = row_format(params.format);
  const size_t row_bytes = format.row_bytes(hidden);
  const int num_scales = format.scale_words(hidden);

  std::vector<SourceRouting> routing(num_ranks);
  for (int s = 0; s < num_ranks; ++s) {
    EPX_CHECK(inputs[s].num_tokens >= 0, "num_tokens", inputs[s].num_tokens, "must be >= 0");
    check_payload(params, inputs[s]);
    routing[s] = routing_of(params, inputs[s]);
  }
  const bool have_expert_counts = !routing[0].num_tokens_per_expert.empty();
  for (int s = 1; s < num_ranks; ++s) {
    EPX_CHECK(routing[s].num_tokens_per_expert.empty() != have_expert_counts, "num_tokens_per_expert", s,
              "must be given by every rank or by none");
  }

  NormalDispatchResult result;
  NormalHandle& handle = result.handle;
  handle.num_ranks = num_ranks;
  handle.hidden = hidden;
  handle.num_tokens.resize(num_ranks);
  handle.num_rows.resize(num_ranks);
  handle.recv_row.resize(num_ranks);
  for (int s = 0; s < num_ranks; ++s) {
    handle.num_tokens[s] = inputs[s].num_tokens;
    handle.recv_row[s].assign(static_cast<size_t>(inputs[s].num_tokens) * num_ranks, -1);
  }

  result.ranks.reserve(num_ranks);
  for (int d = 0; d < num_ranks; ++d) {
    std::vector<int> num_from(num_ranks, 0);
    int num_recv_tokens = 0;
    for (int s = 0; s < num_ranks; ++s) {
      for (int t = 0; t < inputs[s].num_tokens; ++t) {
        num_from[s] += routing[s].is_token_in_rank[static_cast<size_t>(t) * num_ranks + d];
      }
      num_recv_tokens += num_from[s];
    }
    if (params.num_worst_tokens > 0) {
      EPX_CHECK(num_recv_tokens <= params.num_worst_tokens, "num_worst_tokens", params.num_worst_tokens,
                "must be >= the tokens any rank receives");
    }
    const int num_rows = params.num_worst_tokens > 0 ? params.num_worst_tokens : num_recv_tokens;
    NormalDispatchRankOutput out = make_output(params, num_recv_tokens, num_rows);
    handle.num_rows[d] = num_rows;
    out.num_recv_tokens_per_rank = num_from;
    out.recv_rank_prefix.assign(num_ranks + 1, 0);
    for (int s = 0; s < num_ranks; ++s) out.recv_rank_prefix[s + 1] = out.recv_rank_prefix[s] + num_from[s];

    const int64_t first_expert = static_cast<int64_t>(d) * experts_per_rank;
    size_t row = 0;
    for (int s = 0; s < num_ranks; ++s) {
      const NormalDispatchRankInput& in = inputs[s];
      for (int t = 0; t < in.num_tokens; ++t) {
        if (!routing[s].is_token_in_rank[static_cast<size_t>(t) * num_ranks + d]) continue;
        handle.recv_row[s][static_cast<size_t>(t) * num_ranks + d] = static_cast<int>(row);
        out.recv_src_rank[row] = s;
        out.recv_src_token_idx[row] = t;
        if (!format.casts()) {
          std::memcpy(&out.recv_x[row * hidden], &in.x[static_cast<size_t>(t) * hidden],
                      sizeof(uint16_t) * hidden);
        } else {
          std::memcpy(&out.recv_x_fp8[row * row_bytes], &in.x_fp8[static_cast<size_t>(t) * row_bytes],
                      row_bytes);
          std::memcpy(&out.recv_x_scales[row * num_scales], &in.x_scales[static_cast<size_t>(t) * num_scales],
                      sizeof(float) * num_scales);
        }
        for (int k = 0; k < num_topk; ++k) {
          const size_t i = static_cast<size_t>(t) * num_topk + k;
          const int64_t expert = in.topk_idx[i];
          if (expert < first_expert || expert >= first_expert + experts_per_rank) continue;
          out.recv_topk_idx[row * num_topk + k] = expert - first_expert;
          out.recv_topk_weights[row * num_topk + k] = in.topk_weights[i];
        }
        ++row;
      }
    }

    if (params.num_worst_tokens == 0 && have_expert_counts) {
      out.num_recv_tokens_per_expert_list.assign(experts_per_rank, 0);
      for (int e = 0; e < experts_per_rank; ++e) {
        int count = 0;
        for (int s = 0; s < num_ranks; ++s) count += routing[s].num_tokens_per_expert[first_expert + e];
        out.num_recv_tokens_per_expert_list[e] = align_count(count, params.expert_alignment);
      }
    }
    result.ranks.push_back(std::move(out));
  }
  return result;
}

}  // namespace epx::reference
