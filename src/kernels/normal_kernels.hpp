#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/wait_record.hpp"
#include "epx/layout/normal_layout.hpp"

// Launchers of the normal-mode kernels; each takes one Args struct of plain pointers.
namespace epx::kernels {

struct PeerContext {
  void* const* peer_bases;  // device array [R]: every rank's NVLink buffer as seen from this GPU
  void* local_base;
  int rank;
  int num_ranks;
  WaitTimeoutRecord* timeout_record;
  uint64_t timeout_ns;
};

// Device-side handle arrays (allocated by the host, filled by the kernels).
struct HandleArrays {
  uint8_t* is_token_in_rank;        // [T, R] copy, for cached dispatch
  int* send_pos;                    // [T, R]: row of token t in destination r's receive order, -1 if not sent
  int* recv_offsets;                // [R + 1]: first row received from each source; [R] = total
  int* recv_src_idx;                // [rows]
  int* num_recv_tokens_per_expert;  // [L] rounded to expert_alignment
};

struct LayoutArgs {
  const int64_t* topk_idx;
  int num_tokens, num_topk, num_experts, num_ranks;
  int* num_tokens_per_rank;
  int* num_tokens_per_expert;
  bool* is_token_in_rank;
  int* invalid_id_flag;  // host-mapped: set to 1 + the first bad id's token index when an id is out of range
};
void launch_layout(const LayoutArgs& args, cudaStream_t stream);

struct StageArgs {
  PeerContext peers;
  NormalLayout layout;
  const void* x;
  const float* x_scales;
  const int64_t* topk_idx;
  const float* topk_weights;
  int num_tokens;
  int num_sms;
};

struct NotifyArgs {
  PeerContext peers;
  NormalLayout layout;
  const uint8_t* is_token_in_rank;   // [T, R] (bool bytes)
  const int* num_tokens_per_expert;  // [E] or nullptr
  int num_tokens;
  int expert_alignment;
  int num_worst_tokens;  // 0 or the row capacity of the outputs
  HandleArrays handle;
  int* host_counts;  // host-mapped: [0] = rows, [1 + le] = aligned count of local expert le
  int* host_ready;   // host-mapped or nullptr: set to ready_value once host_counts are written
  int ready_value;
};

// One launch: notify in one block, the stage in stage.num_sms others.
struct NotifyStageArgs {
  NotifyArgs notify;
  StageArgs stage;
};
void launch_dispatch_notify_stage(const NotifyStageArgs& args, cudaStream_t stream);

struct PullArgs {
  PeerContext peers;
  NormalLayout layout;
  HandleArrays handle;
  int num_out_rows;  // rows of the outputs (N, or num_worst_tokens)
  void* recv_x;
  float* recv_x_scales;
  int64_t* recv_topk_idx;
  float* recv_topk_weights;
  int num_sms;
};
void launch_dispatch_pull(const PullArgs& args, cudaStream_t stream);

struct CombineStageArgs {
  PeerContext peers;
  NormalLayout layout;
  HandleArrays handle;
  const void* x;  // [rows, hidden] BF16
  const float* topk_weights;
  int num_sms;
};
void launch_combine_stage(const CombineStageArgs& args, cudaStream_t stream);

// One block: all ranks meet; advances the operation counter.
void launch_barrier(const PeerContext& peers, cudaStream_t stream);

struct ReduceArgs {
  PeerContext peers;
  NormalLayout layout;
  HandleArrays handle;
  int num_tokens;
  const void* x;  // the combine input: this rank's own copies are read from it, never staged
  const float* topk_weights;
  const void* bias0;
  const void* bias1;
  void* combined_x;
  float* combined_topk_weights;
  int num_sms;
};
void launch_combine_reduce(const ReduceArgs& args, cudaStream_t stream);

}  // namespace epx::kernels
