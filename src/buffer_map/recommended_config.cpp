// DeepEP V1's recommended normal-mode configs by group size (its Buffer.get_dispatch_config /
// get_combine_config): the chunk sizes deep_ep callers run with, so the C++ benchmark times what they get.

#include <array>

#include "epx/config.hpp"

namespace epx {

namespace {

struct Recommended {
  int num_ranks;
  int nvl_send, nvl_recv, rdma_send, rdma_recv;
};

constexpr std::array<Recommended, 10> kDispatch{{{2, 24, 256, 6, 128},
                                                 {4, 6, 256, 6, 128},
                                                 {8, 6, 256, 6, 128},
                                                 {16, 36, 288, 20, 128},
                                                 {24, 8, 288, 32, 128},
                                                 {32, 32, 288, 32, 128},
                                                 {64, 20, 288, 28, 128},
                                                 {128, 20, 560, 32, 128},
                                                 {144, 32, 720, 12, 128},
                                                 {160, 28, 720, 12, 128}}};
constexpr std::array<Recommended, 10> kCombine{{{2, 10, 256, 6, 128},
                                                {4, 9, 256, 6, 128},
                                                {8, 4, 256, 6, 128},
                                                {16, 4, 288, 12, 128},
                                                {24, 1, 288, 8, 128},
                                                {32, 1, 288, 8, 128},
                                                {64, 1, 288, 20, 128},
                                                {128, 1, 560, 12, 128},
                                                {144, 2, 720, 8, 128},
                                                {160, 2, 720, 8, 128}}};

}  // namespace

Config recommended_config(ConfigFor op, int num_ranks, int num_sms) {
  Config config;
  config.num_sms = num_sms;
  for (const Recommended& r : op == ConfigFor::kDispatch ? kDispatch : kCombine) {
    if (r.num_ranks != num_ranks) continue;
    config.num_max_nvl_chunked_send_tokens = r.nvl_send;
    config.num_max_nvl_chunked_recv_tokens = r.nvl_recv;
    config.num_max_rdma_chunked_send_tokens = r.rdma_send;
    config.num_max_rdma_chunked_recv_tokens = r.rdma_recv;
  }
  return config;
}

}  // namespace epx
