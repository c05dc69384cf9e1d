// The recommended normal-mode configs by group size (deep_ep's Buffer.get_dispatch_config /
// get_combine_config, the same table): the chunk sizes deep_ep callers run with, so the C++ benchmark times
// what they get. DeepEP V1's, except the send chunks at 2 ranks, chosen from `epx-bench --tune --num-sms
// 8,16,24,32` (2 x H100, 4,096 tokens of 7168, top-8 of 256; docs/BENCHMARKS.md): a dispatch chunk of 48 was
// within 1.3 % of the fastest (chunk, queue) at every budget for BF16 and FP8, DeepEP's 24 was 12-24 % slower
// (a chunk of 24 leaves some of a peer's 16 sending warps with one row and others with two). The combine's
// chunk is 16 with its publisher warp (on by default with 2 ranks): as fast as 32 at 8 and 16 SMs, 2 % faster
// at 24, 10-17 % at 32; without the publisher 32 was best (16 was 12-23 % slower at 8-24 SMs). The queues
// stay at 256 tokens, so the buffer sizes do not change. On 2 x H200 the same sweep (16-40 SMs, two runs)
// found the best chunks moving with the budget: the combine's 32 below 24 SMs (266 against 290 us with 16 at
// 20 SMs), 16 at 24-27 (8 and 32 within 1 %), 8 from 28 (209-213 us against 225-236 with 16 at 32 SMs); the
// BF16 dispatch's 32 from 32 SMs (243-254 us against 261-271 with 48 at 32, 4 % faster at 40; FP8 the same
// either way), 48 below. Into the output window the chunk does not matter. H100 keeps the table (those
// chunks were not measured there with the combine's publisher warp).

#include <array>
#include <string_view>

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

// The 2-rank send chunks on 2 x H200 by SM budget (the sweep above).
int h200_two_rank_chunk(ConfigFor op, int num_sms) {
  if (op == ConfigFor::kDispatch) return num_sms >= 32 ? 32 : 48;
  if (num_sms >= 28) return 8;
  if (num_sms >= 24) return 16;
  return 32;
}

}  // namespace

GpuKind gpu_kind_of(std::string_view device_name) {
  if (device_name.find("H200") != std::string_view::npos) return GpuKind::kH200;
  if (device_name.find("H100") != std::string_view::npos) return GpuKind::kH100;
  return GpuKind::kOther;
}

const char* gpu_kind_name(GpuKind kind) {
  switch (kind) {
    case GpuKind::kH100:
      return "H100";
    case GpuKind::kH200:
      return "H200";
    case GpuKind::kOther:
      break;
  }
  return "other";
}

Config recommended_config(ConfigFor op, int num_ranks, int num_sms, GpuKind kind) {
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
  if (num_ranks == 2 && kind == GpuKind::kH200)
    config.num_max_nvl_chunked_send_tokens = h200_two_rank_chunk(op, num_sms);
  return config;
}

Config across_nodes_config(int num_sms) {
  Config config;
  config.num_sms = num_sms;
  config.num_max_rdma_chunked_send_tokens = 16;
  return config;
}

}  // namespace epx
