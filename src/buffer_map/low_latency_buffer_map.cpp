#include "buffer_map/low_latency_buffer_map.hpp"

#include "epx/config.hpp"

namespace epx {

size_t get_low_latency_rdma_size_hint(int num_max_dispatch_tokens_per_rank, int hidden, int num_ranks,
                                      int num_experts) {
  const LowLatencyBufferMap map(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts);
  return align_up(map.total_bytes(), kLowLatencySizeHintAlign);
}

}  // namespace epx
