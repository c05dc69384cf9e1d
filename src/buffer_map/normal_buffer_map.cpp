#include "buffer_map/normal_buffer_map.hpp"

#include "buffer_map/buffer_map_checks.hpp"
#include "buffer_map/internode_buffer_map.hpp"
#include "epx/error.hpp"

namespace epx {

namespace {

// A send chunk and the queue it goes into: both at least one token, the chunk no larger than the queue.
void check_chunk_pair(int send, const char* send_name, int recv, const char* recv_name) {
  EPX_CHECK(send >= 1, send_name, send, "must be >= 1");
  EPX_CHECK(recv >= 1, recv_name, recv, "must be >= 1");
  EPX_CHECK(send <= recv, send_name, send, detail::concat("must be <= ", recv_name, " (", recv, ")").c_str());
}

}  // namespace

void validate_config(const Config& config) {
  EPX_CHECK(config.num_sms >= 1, "num_sms", config.num_sms, "must be >= 1");
  EPX_CHECK(config.num_channels() <= kMaxChannels, "num_sms", config.num_sms,
            "must be < 258 (at most 128 channels of two SMs)");
  check_chunk_pair(config.num_max_nvl_chunked_send_tokens, "num_max_nvl_chunked_send_tokens",
                   config.num_max_nvl_chunked_recv_tokens, "num_max_nvl_chunked_recv_tokens");
  check_chunk_pair(config.num_max_rdma_chunked_send_tokens, "num_max_rdma_chunked_send_tokens",
                   config.num_max_rdma_chunked_recv_tokens, "num_max_rdma_chunked_recv_tokens");
}

void validate_normal_shape(const NormalShape& shape) {
  EPX_CHECK(shape.num_ranks >= 1, "num_ranks", shape.num_ranks, "must be >= 1");
  EPX_CHECK(shape.num_ranks <= kMaxInternodeRanks, "num_ranks", shape.num_ranks, "must be <= 64");
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

void check_normal_map_fits(const NormalBufferMap& map, size_t buffer_bytes) {
  detail::check_queues_fit(map.total_bytes(), buffer_bytes, "num_nvl_bytes",
                           detail::concat(map.num_ranks, " ranks"), map.num_channels, map.queue_tokens,
                           map.record_bytes, "Config::get_nvl_buffer_size_hint");
}

size_t normal_nvl_buffer_size_hint(size_t hidden_bytes, int num_ranks, const Config& config) {
  detail::check_hidden_bytes(hidden_bytes);
  EPX_CHECK(num_ranks >= 1, "num_ranks", num_ranks, "must be >= 1");
  EPX_CHECK(num_ranks <= kMaxInternodeRanks, "num_ranks", num_ranks, "must be <= 64");
  validate_config(config);
  // DeepEP's convention: one node up to 8 ranks (the normal queues), nodes beyond (the forwarding queues).
  // Virtual nodes on up to 8 ranks need less than one node's queues, so this hint covers them too.
  if (num_ranks > kMaxNvlRanks) return forward_nvl_buffer_size_hint(hidden_bytes, num_ranks, config);
  const NormalBufferMap map = NormalBufferMap::of(num_ranks, config, NormalRecord::largest(hidden_bytes));
  return align_up(map.total_bytes(), kNormalAlign);
}

size_t Config::get_nvl_buffer_size_hint(size_t hidden_bytes, int num_ranks) const {
  return normal_nvl_buffer_size_hint(hidden_bytes, num_ranks, *this);
}

}  // namespace epx
