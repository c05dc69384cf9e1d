// The recommended normal-mode configs by group size (deep_ep's Buffer.get_dispatch_config /
// get_combine_config, the same table): the chunk sizes deep_ep callers run with, so the C++ benchmark times
// what they get. DeepEP V1's, except the send chunks at 2 ranks, chosen from `epx-bench --tune --num-sms
// 8,16,24,32` (2 x H100, 4,096 tokens of 7168, top-8 of 256; docs/BENCHMARKS.md): a dispatch chunk of 48 was
// within 1.3 % of the fastest (chunk, queue) at every budget for BF16 and FP8, DeepEP's 24 was 12-24 % slower
// (a chunk of 24 leaves some of a peer's 16 sending warps with one row and others with two). The combine's
// chunk is 16 with its publisher warp (on by default with 2 ranks): as fast as 32 at 8 and 16 SMs, 2 % faster
// at 24, 10-17 % at 32; without the publisher 32 was best (16 was 12-23 % slower at 8-24 SMs). The queues
// stay at 256 tokens, so the buffer sizes do not change.

#include <array>

#include "epx/config.hpp"

namespace epx {

namespace {

// The NVLink and network queues' send chunk and size, in records.
struct Chunks {
  int nvl_send, nvl_recv, rdma_send, rdma_recv;
};

struct Recommended {
  int num_ranks;
  Chunks dispatch, combine;
};

constexpr std::array<Recommended, 10> kRecommended{{
    {2, {48, 256, 6, 128}, {16, 256, 6, 128}},
    {4, {6, 256, 6, 128}, {9, 256, 6, 128}},
    {8, {6, 256, 6, 128}, {4, 256, 6, 128}},
    {16, {36, 288, 20, 128}, {4, 288, 12, 128}},
    {24, {8, 288, 32, 128}, {1, 288, 8, 128}},
    {32, {32, 288, 32, 128}, {1, 288, 8, 128}},
    {64, {20, 288, 28, 128}, {1, 288, 20, 128}},
    {128, {20, 560, 32, 128}, {1, 560, 12, 128}},
    {144, {32, 720, 12, 128}, {2, 720, 8, 128}},
    {160, {28, 720, 12, 128}, {2, 720, 8, 128}},
}};

}  // namespace

Config recommended_config(ConfigFor op, int num_ranks, int num_sms) {
  Config config;
  config.num_sms = num_sms;
  for (const Recommended& r : kRecommended) {
    if (r.num_ranks != num_ranks) continue;
    const Chunks& chunks = op == ConfigFor::kDispatch ? r.dispatch : r.combine;
    config.num_max_nvl_chunked_send_tokens = chunks.nvl_send;
    config.num_max_nvl_chunked_recv_tokens = chunks.nvl_recv;
    config.num_max_rdma_chunked_send_tokens = chunks.rdma_send;
    config.num_max_rdma_chunked_recv_tokens = chunks.rdma_recv;
  }
  return config;
}

Config across_nodes_config(int num_sms) {
  Config config;
  config.num_sms = num_sms;
  config.num_max_rdma_chunked_send_tokens = 16;
  return config;
}

}  // namespace epx
