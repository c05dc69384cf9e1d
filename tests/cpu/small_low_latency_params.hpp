#pragma once

#include "reference/low_latency.hpp"

namespace epx::test_support {

// The smallest low-latency group the CPU tests check by hand: 2 ranks of 2 experts (0, 1 on rank 0; 2, 3 on
// rank 1), at most 3 tokens a rank, top-2, rows of `hidden` channels.
inline reference::LowLatencyParams small_low_latency_params(int hidden) {
  reference::LowLatencyParams params;
  params.num_ranks = 2;
  params.num_experts = 4;
  params.hidden = hidden;
  params.num_topk = 2;
  params.num_max_dispatch_tokens_per_rank = 3;
  return params;
}

}  // namespace epx::test_support
