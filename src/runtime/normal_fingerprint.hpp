#pragma once

// What the ranks of a normal-mode call must agree on, as shape fingerprints (core/shape_fingerprint.hpp):
// the notify's, checked across ranks with the counts, and each dispatch or combine launch's, checked by every
// receiver before it reads a source's records.
#include "buffer_map/normal_buffer_map.hpp"
#include "core/shape_fingerprint.hpp"
#include "epx/config.hpp"

namespace epx {

// What every rank's dispatch must agree on (checked by notify across ranks): the records' shape and the
// queues' config (across nodes, the network queues' too). `with_rank_totals`: the caller gave
// num_tokens_per_rank. Every rank must, or none: a rank given them waits for every peer's totals, which a
// rank without them never posts.
ShapeFingerprint normal_shape_fingerprint(const NormalShape& shape, const Config& config, bool across_nodes,
                                          bool with_rank_totals = false);

// What every rank's dispatch or combine launch must agree on, checked by each receiver before it reads a
// source's records (kernels/normal_queue.cuh, kernels/internode_common.cuh): the queues' map, the records,
// and the operation. `network_queue_tokens`: records per network queue across nodes (0 within one node).
// kDispatchWithWindow: a dispatch whose receivers post how they receive (a Buffer with an output window):
// every rank's must be one, whichever way each receives.
enum class NormalOperation { kDispatch = 1, kCombine = 2, kDispatchWithWindow = 3 };
// `warp_roles`: a within-node combine's reducing warps per sender block (0 otherwise).
ShapeFingerprint normal_launch_fingerprint(int num_channels, int queue_tokens, int network_queue_tokens,
                                           const NormalRecord& record, int hidden, int num_experts,
                                           NormalOperation op, bool fp8, int warp_roles = 0);
// Within one node: the queues of `map`.
ShapeFingerprint normal_launch_fingerprint(const NormalBufferMap& map, const NormalRecord& record, int hidden,
                                           int num_experts, NormalOperation op, bool fp8, int warp_roles = 0);

}  // namespace epx
