#include <cstddef>

#include "epx/error.hpp"
#include "formats/bf16.hpp"
#include "formats/logfmt.hpp"
#include "reference/low_latency.hpp"
#include "reference/low_latency_checks.hpp"

namespace epx::reference {

namespace {

// The values of one expert output row as the combine receives them: BF16 widened, or LogFMT round-tripped.
void received_row(const uint16_t* row, int hidden, bool use_logfmt, float* values) {
  if (!use_logfmt) {
    for (int c = 0; c < hidden; ++c) values[c] = bf16_to_float(row[c]);
    return;
  }
  uint8_t slot[kLogfmtGroupSlotBytes];
  for (int c = 0; c < hidden; c += kLogfmtGroupSize) {
    logfmt_encode_group(row + c, slot);
    logfmt_decode_group(slot, values + c);
  }
}

// Whether a row from rank `from` to rank `to` travels LogFMT-coded.
bool logfmt_coded(const LowLatencyCombineOptions& options, int from, int to) {
  if (!options.use_logfmt) return false;
  if (options.logfmt_within_node) return true;
  return options.ranks_per_node > 0 && from / options.ranks_per_node != to / options.ranks_per_node;
}

}  // namespace

std::vector<LowLatencyCombineRankOutput> low_latency_combine(
    const LowLatencyParams& params, const LowLatencyCombineOptions& options,
    const std::vector<LowLatencyCombineRankInput>& inputs) {
  detail::check_low_latency_params(params);
  if (options.use_logfmt) {
    EPX_CHECK(params.hidden % kLogfmtGroupSize == 0, "hidden", params.hidden,
              "must be a multiple of 128 for LogFMT");
  }
  EPX_CHECK(options.ranks_per_node >= 0 &&
                (options.ranks_per_node == 0 || params.num_ranks % options.ranks_per_node == 0),
            "ranks_per_node", options.ranks_per_node, "must be 0 or divide num_ranks");
  const int num_ranks = params.num_ranks;
  const int num_local_experts = params.num_experts / num_ranks;
  const int num_topk = params.num_topk;
  const int hidden = params.hidden;
  const int num_rows_per_expert = ll_num_rows_per_expert(params);
  const size_t expert_x_size = static_cast<size_t>(num_local_experts) * num_rows_per_expert * hidden;
  EPX_CHECK(inputs.size() == static_cast<size_t>(num_ranks), "inputs.size()", inputs.size(),
            "must equal num_ranks");

  std::vector<const int64_t*> ids(num_ranks);
  std::vector<int> num_tokens(num_ranks);
  for (int s = 0; s < num_ranks; ++s) {
    const LowLatencyCombineRankInput& in = inputs[s];
    EPX_CHECK(in.x.size() == expert_x_size, "x.size()", in.x.size(), "must be L * R * M * hidden");
    detail::check_low_latency_tokens(params, in.num_tokens, static_cast<size_t>(in.num_tokens) * hidden,
                                     in.topk_idx);
    EPX_CHECK(in.topk_weights.size() == in.topk_idx.size(), "topk_weights.size()", in.topk_weights.size(),
              "must be num_tokens * num_topk");
    ids[s] = in.topk_idx.data();
    num_tokens[s] = in.num_tokens;
  }
  const std::vector<std::vector<int>> recv_rows = low_latency_recv_rows(params, ids, num_tokens);

  std::vector<LowLatencyCombineRankOutput> outputs(num_ranks);
  std::vector<float> acc(hidden);
  std::vector<float> values(hidden);
  std::vector<float> partial(hidden);
  std::vector<uint16_t> partial_bf16(hidden);
  for (int s = 0; s < num_ranks; ++s) {
    const LowLatencyCombineRankInput& in = inputs[s];
    std::vector<uint16_t>& combined = outputs[s].combined_x;
    combined.resize(static_cast<size_t>(in.num_tokens) * hidden);
    for (int t = 0; t < in.num_tokens; ++t) {
      acc.assign(hidden, 0.0f);
      if (options.pre_reduce) {
        // Rank d's partial: its experts' weighted rows in top-k order; then the partials in rank order.
        for (int d = 0; d < num_ranks; ++d) {
          partial.assign(hidden, 0.0f);
          bool any = false;
          for (int k = 0; k < num_topk; ++k) {
            const size_t i = static_cast<size_t>(t) * num_topk + k;
            const int64_t expert = in.topk_idx[i];
            if (expert < 0 || recv_rows[s][i] < 0 || expert / num_local_experts != d) continue;
            const int le = static_cast<int>(expert % num_local_experts);
            const size_t flat_row = static_cast<size_t>(le) * num_rows_per_expert + recv_rows[s][i];
            for (int c = 0; c < hidden; ++c)
              partial[c] += in.topk_weights[i] * bf16_to_float(inputs[d].x[flat_row * hidden + c]);
            any = true;
          }
          if (!any) continue;
          for (int c = 0; c < hidden; ++c) partial_bf16[c] = float_to_bf16(partial[c]);
          received_row(partial_bf16.data(), hidden, logfmt_coded(options, d, s), values.data());
          for (int c = 0; c < hidden; ++c) acc[c] += values[c];
        }
        for (int c = 0; c < hidden; ++c)
          combined[static_cast<size_t>(t) * hidden + c] = float_to_bf16(acc[c]);
        continue;
      }
      for (int k = 0; k < num_topk; ++k) {
        const size_t i = static_cast<size_t>(t) * num_topk + k;
        const int64_t expert = in.topk_idx[i];
        if (expert < 0 || recv_rows[s][i] < 0) continue;  // no expert, or its rank (or this one) is masked
        const int d = static_cast<int>(expert / num_local_experts);
        const int le = static_cast<int>(expert % num_local_experts);
        const size_t flat_row = static_cast<size_t>(le) * num_rows_per_expert + recv_rows[s][i];
        received_row(&inputs[d].x[flat_row * hidden], hidden, logfmt_coded(options, d, s), values.data());
        const float weight = in.topk_weights[i];
        for (int c = 0; c < hidden; ++c) {
          const float weighted = weight * values[c];
          acc[c] += weighted;
        }
      }
      for (int c = 0; c < hidden; ++c) combined[static_cast<size_t>(t) * hidden + c] = float_to_bf16(acc[c]);
    }
  }
  return outputs;
}

}  // namespace epx::reference
