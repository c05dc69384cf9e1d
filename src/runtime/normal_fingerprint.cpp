#include "runtime/normal_fingerprint.hpp"

#include <algorithm>

namespace epx {

namespace {

// The format field of a notify's fingerprint: the bit that says num_tokens_per_rank was given.
constexpr int kNotifyWithRankTotals = 4;

}  // namespace

ShapeFingerprint normal_shape_fingerprint(const NormalShape& shape, const Config& config, bool across_nodes,
                                          bool with_rank_totals) {
  int32_t values[kNumShapeFields] = {};
  values[static_cast<int>(ShapeField::kHidden)] = shape.hidden;
  values[static_cast<int>(ShapeField::kRowBytes)] = shape.x_row_bytes;
  values[static_cast<int>(ShapeField::kNumScales)] = shape.num_scales;
  values[static_cast<int>(ShapeField::kNumTopk)] = shape.num_topk;
  values[static_cast<int>(ShapeField::kNumExperts)] = shape.num_experts;
  values[static_cast<int>(ShapeField::kNumChannels)] = config.num_channels();
  values[static_cast<int>(ShapeField::kQueueTokens)] = config.num_max_nvl_chunked_recv_tokens;
  values[static_cast<int>(ShapeField::kFormat)] = with_rank_totals ? kNotifyWithRankTotals : 0;
  if (across_nodes)
    values[static_cast<int>(ShapeField::kNetworkQueueTokens)] = config.num_max_rdma_chunked_recv_tokens;
  return make_shape_fingerprint(values);
}

ShapeFingerprint normal_launch_fingerprint(int num_channels, int queue_tokens, int network_queue_tokens,
                                           const NormalRecord& record, int hidden, int num_experts,
                                           NormalOperation op, bool fp8, int warp_roles) {
  int32_t values[kNumShapeFields] = {};
  values[static_cast<int>(ShapeField::kHidden)] = hidden;
  values[static_cast<int>(ShapeField::kRowBytes)] = record.x_bytes;
  values[static_cast<int>(ShapeField::kNumScales)] = record.num_scales;
  values[static_cast<int>(ShapeField::kNumTopk)] = std::max(record.num_topk_idx, record.num_topk_weights);
  values[static_cast<int>(ShapeField::kNumExperts)] = num_experts;
  values[static_cast<int>(ShapeField::kNumChannels)] = num_channels;
  values[static_cast<int>(ShapeField::kQueueTokens)] = queue_tokens;
  values[static_cast<int>(ShapeField::kFormat)] = 2 * static_cast<int>(op) + (fp8 ? 1 : 0);
  values[static_cast<int>(ShapeField::kNetworkQueueTokens)] = network_queue_tokens;
  values[static_cast<int>(ShapeField::kWarpRoles)] = warp_roles;
  return make_shape_fingerprint(values);
}

ShapeFingerprint normal_launch_fingerprint(const NormalBufferMap& map, const NormalRecord& record, int hidden,
                                           int num_experts, NormalOperation op, bool fp8, int warp_roles) {
  return normal_launch_fingerprint(map.num_channels, map.queue_tokens, 0, record, hidden, num_experts, op,
                                   fp8, warp_roles);
}

}  // namespace epx
