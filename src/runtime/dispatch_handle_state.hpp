#pragma once

#include <memory>
#include <vector>

#include "epx/normal.hpp"
#include "kernels/normal_kernels.hpp"

namespace epx {

struct DispatchHandle::State {
  NormalLayout layout{};
  TokenFormat format = TokenFormat::kBf16;
  int num_ranks = 0;
  int rank = 0;
  int num_tokens = 0;
  int num_topk = 0;
  int num_recv_rows = 0;  // rows of the outputs
  int num_worst_tokens = 0;
  int expert_alignment = 1;
  std::vector<int> num_recv_per_rank;           // host copy; empty in worst-case mode
  std::vector<int> num_recv_tokens_per_expert;  // host copy; empty in worst-case mode
  kernels::HandleArrays arrays{};
  std::shared_ptr<void> device_memory;  // owns every array above, freed on the comm stream

  // Allocates the arrays on `stream` for `num_tokens` tokens and `max_rows` received rows.
  void allocate(const std::shared_ptr<CUstream_st>& stream, int max_rows, int num_local_experts);
};

}  // namespace epx
