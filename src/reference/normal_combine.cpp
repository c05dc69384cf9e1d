#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "epx/error.hpp"
#include "formats/bf16.hpp"
#include "reference/combine_by_groups.hpp"
#include "reference/normal.hpp"

namespace epx::reference {

namespace detail {

namespace {

void check_combine_inputs(const NormalHandle& handle, const NormalCombineParams& params,
                          const std::vector<NormalCombineRankInput>& inputs) {
  EPX_CHECK(params.num_topk >= 0, "num_topk", params.num_topk, "must be >= 0");
  EPX_CHECK(params.num_biases >= 0, "num_biases", params.num_biases, "must be 0, 1 or 2");
  EPX_CHECK(params.num_biases <= 2, "num_biases", params.num_biases, "must be 0, 1 or 2");
  EPX_CHECK(handle.num_ranks >= 1, "handle.num_ranks", handle.num_ranks, "must come from normal_dispatch");
  EPX_CHECK(inputs.size() == static_cast<size_t>(handle.num_ranks), "inputs.size()", inputs.size(),
            "must equal num_ranks");
  const size_t hidden = static_cast<size_t>(handle.hidden);
  for (int r = 0; r < handle.num_ranks; ++r) {
    const NormalCombineRankInput& in = inputs[r];
    const size_t rows = static_cast<size_t>(handle.num_rows[r]);
    const size_t tokens = static_cast<size_t>(handle.num_tokens[r]);
    EPX_CHECK(in.x.size() == rows * hidden, "x.size()", in.x.size(), "must be dispatch rows * hidden");
    if (params.num_topk > 0) {
      EPX_CHECK(in.topk_weights.size() == rows * params.num_topk, "topk_weights.size()",
                in.topk_weights.size(), "must be dispatch rows * num_topk");
    }
    if (params.num_biases >= 1) {
      EPX_CHECK(in.bias0.size() == tokens * hidden, "bias0.size()", in.bias0.size(),
                "must be num_tokens * hidden");
    }
    if (params.num_biases == 2) {
      EPX_CHECK(in.bias1.size() == tokens * hidden, "bias1.size()", in.bias1.size(),
                "must be num_tokens * hidden");
    }
  }
}

void add_bf16_row(const uint16_t* row, int hidden, float* acc) {
  for (int c = 0; c < hidden; ++c) acc[c] += bf16_to_float(row[c]);
}

}  // namespace

std::vector<NormalCombineRankOutput> combine_by_groups(const NormalHandle& handle,
                                                       const NormalCombineParams& params,
                                                       const std::vector<NormalCombineRankInput>& inputs,
                                                       int ranks_per_group, bool round_partials) {
  check_combine_inputs(handle, params, inputs);
  const int num_ranks = handle.num_ranks;
  const int hidden = handle.hidden;
  const int num_topk = params.num_topk;

  std::vector<NormalCombineRankOutput> outputs(num_ranks);
  std::vector<float> acc(hidden), partial(hidden);
  std::vector<float> acc_weights(num_topk), partial_weights(num_topk);
  for (int s = 0; s < num_ranks; ++s) {
    const int num_tokens = handle.num_tokens[s];
    NormalCombineRankOutput& out = outputs[s];
    out.combined_x.resize(static_cast<size_t>(num_tokens) * hidden);
    out.combined_topk_weights.resize(static_cast<size_t>(num_tokens) * num_topk);
    for (int t = 0; t < num_tokens; ++t) {
      acc.assign(hidden, kSumStart);
      acc_weights.assign(num_topk, 0.0f);
      const size_t token_row = static_cast<size_t>(t) * hidden;
      const uint16_t* only_source = nullptr;  // the token's one source, while it has exactly one
      int num_sources = 0;
      const auto count_source = [&](const uint16_t* row) {
        only_source = ++num_sources == 1 ? row : nullptr;
      };
      for (int first = 0; first < num_ranks; first += ranks_per_group) {
        partial.assign(hidden, kSumStart);
        partial_weights.assign(num_topk, 0.0f);
        bool any = false;
        for (int d = first; d < first + ranks_per_group; ++d) {
          const int row = handle.recv_row[s][static_cast<size_t>(t) * num_ranks + d];
          if (row < 0) continue;
          any = true;
          count_source(&inputs[d].x[static_cast<size_t>(row) * hidden]);
          add_bf16_row(&inputs[d].x[static_cast<size_t>(row) * hidden], hidden, partial.data());
          for (int k = 0; k < num_topk; ++k) {
            partial_weights[k] += inputs[d].topk_weights[static_cast<size_t>(row) * num_topk + k];
          }
        }
        if (!any) continue;
        for (int c = 0; c < hidden; ++c)
          acc[c] += round_partials ? bf16_to_float(float_to_bf16(partial[c])) : partial[c];
        for (int k = 0; k < num_topk; ++k) acc_weights[k] += partial_weights[k];
      }
      if (params.num_biases >= 1) {
        count_source(&inputs[s].bias0[token_row]);
        add_bf16_row(&inputs[s].bias0[token_row], hidden, acc.data());
      }
      if (params.num_biases == 2) {
        count_source(&inputs[s].bias1[token_row]);
        add_bf16_row(&inputs[s].bias1[token_row], hidden, acc.data());
      }
      uint16_t* combined = &out.combined_x[token_row];
      if (num_sources == 0) {
        std::fill(combined, combined + hidden, uint16_t{0});  // +0.0
      } else if (only_source != nullptr && !round_partials) {
        std::copy(only_source, only_source + hidden, combined);  // bit for bit, NaN payloads included
      } else {
        for (int c = 0; c < hidden; ++c) combined[c] = float_to_bf16(acc[c]);
      }
      for (int k = 0; k < num_topk; ++k)
        out.combined_topk_weights[static_cast<size_t>(t) * num_topk + k] = acc_weights[k];
    }
  }
  return outputs;
}

}  // namespace detail

// One group of every rank, unrounded: acc = -0.0f + (-0.0f + x_0 + x_1 + ...) is bit-for-bit the documented
// -0.0f + x_0 + x_1 + ... (-0.0f is the identity of float addition).
std::vector<NormalCombineRankOutput> normal_combine(const NormalHandle& handle,
                                                    const NormalCombineParams& params,
                                                    const std::vector<NormalCombineRankInput>& inputs) {
  return detail::combine_by_groups(handle, params, inputs, handle.num_ranks, false);
}

}  // namespace epx::reference
