#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "epx/normal.hpp"
#include "formats/scale_format.hpp"
#include "kernels/normal_kernels.hpp"

namespace epx {

struct DispatchHandle::State {
  NormalShape shape{};   // of the dispatch that made the handle
  int num_channels = 0;  // its token split; a cached dispatch and the combine keep it
  ScaleFormat format = ScaleFormat::kBf16;
  int num_tokens = 0;
  int num_topk = 0;
  int num_recv_rows = 0;  // rows of the outputs
  int num_worst_tokens = 0;
  int expert_alignment = 1;
  int num_nodes = 1;            // > 1: the group spans nodes (normal mode across nodes)
  int num_forward_records = 0;  // across nodes: records this rank forwards (the size of forward_mask)
  bool cached = false;          // a cached re-dispatch: recv_src_idx holds its rows' sources already
  // The sequence of the notify that launched the receive (DispatchOverlap::kLaunchReceive), 0: none. Outputs
  // go only to the receive of this sequence, so a spent or stale plan cannot feed a later notify's receive.
  uint32_t launched_receive = 0;
  // What the host read off the layout board for this dispatch, checked by its launch (none for a cached
  // dispatch: no notify ran).
  kernels::BoardCheck board;
  // The count exchange still to run, inside the receive's launch (dispatch_receive): the host read its counts
  // off the layout board before any launch.
  std::optional<kernels::NotifyArgs> exchange;
  // The launched receive writes into these outputs (they held the rows: DispatchPlan::rows_in_guess).
  std::optional<DispatchOutput> guessed_outputs;
  std::vector<int> num_recv_per_rank;           // host copy; empty in worst-case mode
  std::vector<int> num_recv_tokens_per_expert;  // host copy; empty in worst-case mode
  kernels::HandleArrays arrays{};
  std::shared_ptr<void> routing_memory;  // owns every array but recv_src_idx, freed on the comm stream
  std::shared_ptr<void> rows_memory;     // owns recv_src_idx (and forward_mask); may be routing_memory
  int rows_capacity = 0;                 // rows recv_src_idx has room for (>= num_recv_rows)

  // Allocates the routing arrays from `buffer`'s handle pool on its comm stream (their sizes do not depend on
  // what arrives), and recv_src_idx for `num_rows` rows when > 0.
  void allocate_routing(const Buffer& buffer, int num_local_experts, int num_rows = 0);
  // Allocates recv_src_idx for `num_rows` rows (and, across nodes, forward_mask) likewise; `complete_on`:
  // see allocate_on_stream in normal.cpp (a receive launched before the allocation).
  void allocate_rows(const Buffer& buffer, int num_rows, cudaStream_t complete_on = nullptr);
};

}  // namespace epx
