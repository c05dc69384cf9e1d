#include <cstddef>
#include <cstring>

#include "epx/error.hpp"
#include "formats/fp8.hpp"
#include "formats/scale_format.hpp"
#include "formats/ue8m0.hpp"
#include "reference/low_latency.hpp"
#include "reference/low_latency_checks.hpp"

namespace epx::reference {

namespace {

// One source rank's payload as it goes on the wire: BF16 rows, or FP8 rows plus one scale per group.
struct SourcePayload {
  std::vector<uint8_t> x_fp8;  // [T, H]
  std::vector<float> scales;   // [T, G]
};

SourcePayload quantize_source(const LowLatencyDispatchRankInput& in, int hidden, const RowFormat& format) {
  const int num_groups = format.num_groups(hidden);
  const size_t row_bytes = format.row_bytes(hidden);
  SourcePayload payload;
  payload.x_fp8.resize(static_cast<size_t>(in.num_tokens) * row_bytes);
  payload.scales.resize(static_cast<size_t>(in.num_tokens) * num_groups);
  for (int t = 0; t < in.num_tokens; ++t) {
    cast_row(format, &in.x[static_cast<size_t>(t) * hidden], hidden,
             &payload.x_fp8[static_cast<size_t>(t) * row_bytes],
             &payload.scales[static_cast<size_t>(t) * num_groups]);
  }
  return payload;
}

LowLatencyDispatchRankOutput make_output(const LowLatencyParams& params, const RowFormat& format) {
  const int num_local_experts = params.num_experts / params.num_ranks;
  const size_t num_rows = static_cast<size_t>(num_local_experts) * ll_num_rows_per_expert(params);
  const size_t scale_words = num_rows * format.scale_words(params.hidden);
  LowLatencyDispatchRankOutput out;
  if (!format.casts()) {
    out.recv_x.assign(num_rows * params.hidden, 0);
  } else {
    out.recv_x_fp8.assign(num_rows * format.row_bytes(params.hidden), 0);
  }
  if (format.storage == ScaleStorage::kUe8m0x4) out.recv_x_scales_ue8m0.assign(scale_words, 0u);
  if (format.storage == ScaleStorage::kFloat) out.recv_x_scales.assign(scale_words, 0.0f);
  out.recv_count.assign(num_local_experts, 0);
  out.recv_src_begin.assign(static_cast<size_t>(num_local_experts) * params.num_ranks, 0);
  out.recv_src_count.assign(static_cast<size_t>(num_local_experts) * params.num_ranks, 0);
  out.recv_src_rank.assign(num_rows, -1);
  out.recv_src_token_idx.assign(num_rows, -1);
  return out;
}

// Writes one row's scales in the column-major layout (floats, or UE8M0 bytes packed 4 per word).
void store_scales(const LowLatencyParams& params, const RowFormat& format, const float* scales,
                  int local_expert, int row, LowLatencyDispatchRankOutput& out) {
  const int num_groups = format.num_groups(params.hidden);
  const int num_rows = ll_num_rows_per_expert(params);
  if (format.storage == ScaleStorage::kFloat) {
    for (int g = 0; g < num_groups; ++g) {
      out.recv_x_scales[ll_scale_index(local_expert, row, g, num_rows, num_groups)] = scales[g];
    }
    return;
  }
  const int num_words = format.scale_words(params.hidden);
  for (int w = 0; w < num_words; ++w) {
    uint8_t bytes[4] = {0, 0, 0, 0};
    for (int j = 0; j < 4 && 4 * w + j < num_groups; ++j) bytes[j] = ue8m0_from_pow2_scale(scales[4 * w + j]);
    out.recv_x_scales_ue8m0[ll_scale_index(local_expert, row, w, num_rows, num_words)] =
        pack_ue8m0x4(bytes[0], bytes[1], bytes[2], bytes[3]);
  }
}

}  // namespace

std::vector<LowLatencyDispatchRankOutput> low_latency_dispatch(
    const LowLatencyParams& params, const LowLatencyDispatchOptions& options,
    const std::vector<LowLatencyDispatchRankInput>& inputs,
    std::vector<std::vector<int>>* cumulative_local_expert_recv_stats) {
  detail::check_low_latency_params(params);
  const RowFormat format = row_format(low_latency_scale_format(options));
  if (format.has_scales()) {
    EPX_CHECK(params.hidden % format.group_size == 0, "hidden", params.hidden,
              "must be a multiple of 128 for FP8");
  }
  const int num_ranks = params.num_ranks;
  const int num_local_experts = params.num_experts / num_ranks;
  const int num_topk = params.num_topk;
  const int hidden = params.hidden;
  const int num_groups = format.num_groups(hidden);
  const size_t row_bytes = format.row_bytes(hidden);
  const int num_rows_per_expert = ll_num_rows_per_expert(params);
  EPX_CHECK(inputs.size() == static_cast<size_t>(num_ranks), "inputs.size()", inputs.size(),
            "must equal num_ranks");
  if (cumulative_local_expert_recv_stats != nullptr) {
    EPX_CHECK(cumulative_local_expert_recv_stats->size() == static_cast<size_t>(num_ranks),
              "cumulative_local_expert_recv_stats.size()", cumulative_local_expert_recv_stats->size(),
              "must equal num_ranks");
    for (const std::vector<int>& stats : *cumulative_local_expert_recv_stats) {
      EPX_CHECK(stats.size() == static_cast<size_t>(num_local_experts),
                "cumulative_local_expert_recv_stats[r].size()", stats.size(),
                "must equal num_experts / num_ranks");
    }
  }

  std::vector<const int64_t*> ids(num_ranks);
  std::vector<int> num_tokens(num_ranks);
  for (int s = 0; s < num_ranks; ++s) {
    detail::check_low_latency_tokens(params, inputs[s].num_tokens, inputs[s].x.size(), inputs[s].topk_idx);
    ids[s] = inputs[s].topk_idx.data();
    num_tokens[s] = inputs[s].num_tokens;
  }
  const std::vector<std::vector<int>> recv_rows = low_latency_recv_rows(params, ids, num_tokens);

  std::vector<LowLatencyDispatchRankOutput> outputs;
  outputs.reserve(num_ranks);
  for (int d = 0; d < num_ranks; ++d) outputs.push_back(make_output(params, format));

  for (int s = 0; s < num_ranks; ++s) {
    const LowLatencyDispatchRankInput& in = inputs[s];
    const SourcePayload payload = format.casts() ? quantize_source(in, hidden, format) : SourcePayload{};
    for (int t = 0; t < in.num_tokens; ++t) {
      for (int k = 0; k < num_topk; ++k) {
        const size_t i = static_cast<size_t>(t) * num_topk + k;
        const int64_t expert = in.topk_idx[i];
        if (expert < 0) continue;
        bool repeated = false;
        for (int j = 0; j < k; ++j) repeated = repeated || in.topk_idx[i - k + j] == expert;
        if (repeated) continue;
        const int row = recv_rows[s][i];
        if (row < 0) continue;  // the source or the destination is masked
        const int d = static_cast<int>(expert / num_local_experts);
        const int le = static_cast<int>(expert % num_local_experts);
        LowLatencyDispatchRankOutput& out = outputs[d];
        const size_t flat_row = static_cast<size_t>(le) * num_rows_per_expert + row;
        out.recv_src_rank[flat_row] = s;
        out.recv_src_token_idx[flat_row] = t;
        ++out.recv_count[le];
        ++out.recv_src_count[static_cast<size_t>(le) * num_ranks + s];
        if (!format.casts()) {
          std::memcpy(&out.recv_x[flat_row * hidden], &in.x[static_cast<size_t>(t) * hidden],
                      sizeof(uint16_t) * hidden);
          continue;
        }
        std::memcpy(&out.recv_x_fp8[flat_row * row_bytes], &payload.x_fp8[static_cast<size_t>(t) * row_bytes],
                    row_bytes);
        store_scales(params, format, &payload.scales[static_cast<size_t>(t) * num_groups], le, row, out);
      }
    }
  }

  for (int d = 0; d < num_ranks; ++d) {
    LowLatencyDispatchRankOutput& out = outputs[d];
    for (int le = 0; le < num_local_experts; ++le) {
      int begin = 0;
      for (int s = 0; s < num_ranks; ++s) {
        out.recv_src_begin[static_cast<size_t>(le) * num_ranks + s] = begin;
        begin += out.recv_src_count[static_cast<size_t>(le) * num_ranks + s];
      }
    }
    if (cumulative_local_expert_recv_stats != nullptr) {
      for (int le = 0; le < num_local_experts; ++le)
        (*cumulative_local_expert_recv_stats)[d][le] += out.recv_count[le];
    }
  }
  return outputs;
}

}  // namespace epx::reference
