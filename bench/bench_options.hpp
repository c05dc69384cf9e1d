#pragma once

#include <string>
#include <vector>

namespace epx::bench {

struct BenchOptions {
  std::string mode = "all";  // normal | low-latency | all
  int num_ranks = 0;         // 0: every visible GPU
  int num_tokens = 4096;
  int hidden = 7168;
  int num_topk = 8;
  int num_experts = 256;
  std::vector<int> num_sms = {24};
  int ll_num_tokens = 128;
  int ll_num_experts = 288;
  int ll_ranks_per_node = 0;  // 0: one node; fewer than the ranks: virtual nodes joined by NVSHMEM
  int warmup = 5;
  int iters = 30;
  bool json = false;
  unsigned seed = 1;
};

}  // namespace epx::bench
