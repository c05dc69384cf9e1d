#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "epx/buffer.hpp"
#include "epx/event.hpp"
#include "epx/fields.hpp"

// Normal (high-throughput) mode within one NVLink domain: layout, dispatch and combine on raw device
// pointers. Every call is collective over the Buffer's ranks and runs on the Buffer's communication stream.
namespace epx {

enum class TokenFormat { kBf16, kFp8 };

struct DispatchLayoutOutput {
  int* num_tokens_per_rank;    // [R]
  int* num_tokens_per_expert;  // [E]
  bool* is_token_in_rank;      // [T, R]
  // Optional: [R / Buffer::ranks_per_node()] tokens per node (a token counts once per node; DeepEP's
  // num_tokens_per_rdma_rank), or nullptr when not wanted.
  int* num_tokens_per_rdma_rank = nullptr;
};
// Its fields by name, for the binding and tools (epx/fields.hpp).
template <>
struct Fields<DispatchLayoutOutput> {
  template <typename Visit>
  static constexpr void visit(Visit&& v) {
    v("num_tokens_per_rank", &DispatchLayoutOutput::num_tokens_per_rank);
    v("num_tokens_per_expert", &DispatchLayoutOutput::num_tokens_per_expert);
    v("is_token_in_rank", &DispatchLayoutOutput::is_token_in_rank);
    v("num_tokens_per_rdma_rank", &DispatchLayoutOutput::num_tokens_per_rdma_rank);
  }
};
static_assert(lists_every_field<DispatchLayoutOutput>(),
              "Fields<DispatchLayoutOutput> must list every field");

// Tokens per rank (a token counts once per rank), per expert, per node (when asked), and the token-in-rank
// map.
// Ids outside [-1, E) are ignored by the kernel and reported by the next dispatch_notify.
Event get_dispatch_layout(Buffer& buffer, const int64_t* topk_idx, int num_tokens, int num_topk,
                          int num_experts, const DispatchLayoutOutput& out, const StreamOrder& order);

struct DispatchInput {
  const void* x = nullptr;  // [T, hidden] BF16, or FP8 e4m3 bytes
  TokenFormat format = TokenFormat::kBf16;
  // FP8 only: [T, num_scales] 4-byte words, moved as raw bits (float32 scales per 128 channels, UE8M0 bytes
  // packed four to an int32, one scale per token: whatever the caller's consumer reads).
  const float* x_scales = nullptr;
  int num_scales = 0;  // FP8 only: scale words per token; 0 means hidden / 128
  int num_tokens = 0;
  int hidden = 0;
  const int64_t* topk_idx = nullptr;  // [T, K] or nullptr (then recv top-k outputs are not produced)
  const float* topk_weights = nullptr;
  int num_topk = 0;
  int num_experts = 0;
  const bool* is_token_in_rank = nullptr;  // [T, R] from get_dispatch_layout (unused with a cached handle)
  const int* num_tokens_per_expert = nullptr;  // [E] from get_dispatch_layout (unused with a cached handle)
  // [R] from get_dispatch_layout, optional (unused with a cached handle and across nodes). Given, the host
  // learns the row counts without waiting for the per-channel counts, which are then checked against it: a
  // count that disagrees with is_token_in_rank aborts the group (rank, peer and both counts in the error).
  // Every rank gives it or none does (checked with the call's shapes).
  const int* num_tokens_per_rank = nullptr;
  int expert_alignment = 1;
  int num_worst_tokens = 0;  // > 0: no CPU sync, outputs sized num_worst_tokens rows
};
// Its fields by name, for the binding and tools (epx/fields.hpp).
template <>
struct Fields<DispatchInput> {
  template <typename Visit>
  static constexpr void visit(Visit&& v) {
    v("x", &DispatchInput::x);
    v("format", &DispatchInput::format);
    v("x_scales", &DispatchInput::x_scales);
    v("num_scales", &DispatchInput::num_scales);
    v("num_tokens", &DispatchInput::num_tokens);
    v("hidden", &DispatchInput::hidden);
    v("topk_idx", &DispatchInput::topk_idx);
    v("topk_weights", &DispatchInput::topk_weights);
    v("num_topk", &DispatchInput::num_topk);
    v("num_experts", &DispatchInput::num_experts);
    v("is_token_in_rank", &DispatchInput::is_token_in_rank);
    v("num_tokens_per_expert", &DispatchInput::num_tokens_per_expert);
    v("num_tokens_per_rank", &DispatchInput::num_tokens_per_rank);
    v("expert_alignment", &DispatchInput::expert_alignment);
    v("num_worst_tokens", &DispatchInput::num_worst_tokens);
  }
};
static_assert(lists_every_field<DispatchInput>(), "Fields<DispatchInput> must list every field");

// What combine and a cached re-dispatch need. Copyable (shared); device memory is freed with the last copy.
class DispatchHandle {
 public:
  struct State;
  DispatchHandle() = default;
  explicit DispatchHandle(std::shared_ptr<State> state) : state_(std::move(state)) {}
  bool valid() const { return state_ != nullptr; }
  State& state() const;

  int num_tokens() const;     // tokens this rank dispatched
  int num_recv_rows() const;  // rows of recv_x (N, or num_worst_tokens in worst-case mode)
  int hidden() const;
  // Source token index of each received row ([num_recv_rows], -1 for padding rows), on the device.
  const int* recv_src_idx_device() const;
  // Rows received from each source rank ([R], host); empty in worst-case mode.
  const std::vector<int>& num_recv_per_rank() const;
  // Channels the dispatch split its tokens into (Config::num_channels() of its config).
  int num_channels() const;
  // Device arrays, written by the dispatch on the comm stream (read them in stream order after it):
  // [R * C + 1] first received row of each (source rank, channel), source-major, then the row count;
  const int* recv_channel_offset_device() const;
  // [T, R] position of token t in its channel's stream to rank r, -1 where it was not sent (across nodes
  // [T, N]: its entry in its channel's stream to node n, -1 where it went to none of n's ranks);
  const int* send_head_device() const;
  // [T, R] 0/1 bytes: whether token t went to rank r.
  const uint8_t* is_token_in_rank_device() const;
  // Within one node, DeepEP's handle matrices of this dispatch, written with recv_channel_offset: [R, R]
  // rank_prefix_matrix (column `rank`: rows received from sources 0..i; EPX knows no other column: -1), then
  // [R, C] channel_prefix_matrix (the senders' side, which EPX does not keep: -1), then [R, C]
  // recv_channel_prefix_matrix (first row of (source, channel) counted from the source's first row).
  // nullptr across nodes.
  const int* deep_ep_matrices_device() const;

  // Across nodes (src/runtime/dispatch_handle_nodes.cpp). Nodes the dispatch spanned (1 within one node).
  int num_nodes() const;
  // Records this rank forwards over NVLink as the rail peer of their sources (those of its own node
  // included): what the network queues delivered to it. 0 within one node.
  int num_forward_records() const;
  // [N * C + 1] first of those records from each (source node, channel), node-major, then their count;
  // nullptr within one node.
  const int* node_channel_offset_device() const;
  // [num_forward_records] bitmask of the local ranks each record went to (bit l: local rank l); nullptr
  // within one node.
  const uint8_t* forward_mask_device() const;

 private:
  std::shared_ptr<State> state_;
};

// Result of the count exchange: how big the outputs must be.
struct DispatchPlan {
  int num_recv_rows = 0;  // rows to allocate for recv_x and friends
  std::vector<int>
      num_recv_tokens_per_expert;  // [L], rounded up to expert_alignment; empty in worst-case mode
  DispatchHandle handle;
  // The launched receive writes into the guess's outputs (DispatchOutputGuess): pass those to
  // dispatch_receive, which then only completes the call.
  bool rows_in_guess = false;
  // The host read the counts off the layout board, posted by every rank's get_dispatch_layout just before
  // (one node, num_tokens_per_rank given as the layout's output), instead of waiting for the notify kernel.
  bool counts_from_layout = false;
};

struct DispatchOutput {
  void* recv_x = nullptr;              // [rows, hidden] same format as the input
  float* recv_x_scales = nullptr;      // FP8 only: [rows, num_scales] words
  int64_t* recv_topk_idx = nullptr;    // [rows, K] local expert ids, -1 elsewhere (only with top-k input)
  float* recv_topk_weights = nullptr;  // [rows, K]
};
// Its fields by name, for the binding and tools (epx/fields.hpp).
template <>
struct Fields<DispatchOutput> {
  template <typename Visit>
  static constexpr void visit(Visit&& v) {
    v("recv_x", &DispatchOutput::recv_x);
    v("recv_x_scales", &DispatchOutput::recv_x_scales);
    v("recv_topk_idx", &DispatchOutput::recv_topk_idx);
    v("recv_topk_weights", &DispatchOutput::recv_topk_weights);
  }
};
static_assert(lists_every_field<DispatchOutput>(), "Fields<DispatchOutput> must list every field");

// Which step launches the receive of a dispatch whose host waits for the counts.
enum class DispatchOverlap {
  // dispatch_receive launches it, after whatever the caller queued in between (e.g. clearing the outputs).
  kNone,
  // dispatch_notify launches it right after the count exchange, before the host waits: senders fill the
  // peers' queues while the counts travel to the host, and the receive writes rows as soon as
  // dispatch_receive hands it the outputs (through host-mapped memory; nothing is launched then). The caller
  // must call dispatch_receive next, with the same input, and queue no GPU work on the outputs in between
  // (allocating them is fine). A notify of the same Buffer before that cancels the receive (it drains its
  // queues and writes nothing). Ignored with a cached handle, in worst-case mode, across nodes and when the
  // environment sets EPX_LAUNCH_RECEIVE=0 (for compute-sanitizer's memcheck, which checks a kernel's
  // accesses against the allocations made before its launch).
  kLaunchReceive,
  // As kNone, and the handle's device arrays (recv_channel_offset, num_recv_tokens_per_expert, the map copy)
  // are written on the comm stream before dispatch_notify returns, so work the caller queues there before
  // dispatch_receive may read them. (With kNone the counts may come off the layout board, and the exchange
  // that writes those arrays then runs inside dispatch_receive's launch.)
  kHandleBeforeReceive,
};

// Outputs a receive that dispatch_notify launches (DispatchOverlap::kLaunchReceive) writes into at once when
// the rows fit (num_recv_rows <= rows): it then waits for nothing from the host, which only learns the row
// count. When they do not fit, the receive waits for dispatch_receive's outputs as without a guess. The
// caller allocates them before the notify, e.g. for the last dispatch's rows plus a margin. Rows that fit are
// written there even if the caller then cancels (dispatch_cancel, or a notify before dispatch_receive). With
// the input's num_tokens_per_rank, the receive's launch also runs the count exchange: one launch per call.
struct DispatchOutputGuess {
  DispatchOutput outputs;
  int rows = 0;  // rows each output has room for; 0: no guess
};

// Step 1: exchange the counts. Synchronizes with the host unless num_worst_tokens > 0 or a cached handle is
// given (then the counts are already known). `guess` (optional, only with kLaunchReceive): see
// DispatchOutputGuess; DispatchPlan::rows_in_guess says whether the rows went there.
DispatchPlan dispatch_notify(Buffer& buffer, const DispatchInput& input, const StreamOrder& order,
                             const DispatchHandle* cached = nullptr,
                             DispatchOverlap overlap = DispatchOverlap::kNone,
                             const DispatchOutputGuess* guess = nullptr);
// Step 2: receive the rows into caller-allocated outputs (sized by the plan; the guess's outputs when
// plan.rows_in_guess).
Event dispatch_receive(Buffer& buffer, const DispatchPlan& plan, const DispatchInput& input,
                       const DispatchOutput& out, const StreamOrder& order);
// Instead of step 2, when the caller will not receive (e.g. allocating the outputs failed): a receive that
// dispatch_notify launched drains its queues, writing nothing, so the peers' calls complete. A no-op for any
// other plan.
void dispatch_cancel(Buffer& buffer, const DispatchPlan& plan);

// Nanoseconds this rank's host spent in dispatch_notify waiting for counts (a dispatch without a cached
// handle or num_worst_tokens), summed since construction or reset(): the part of a dispatch's host time that
// is the GPU's count exchange (and the stream's earlier work), not host work.
uint64_t dispatch_count_wait_ns(const Buffer& buffer);

struct CombineInput {
  const void* x = nullptr;              // [rows, hidden] BF16, rows in the dispatch output order
  const float* topk_weights = nullptr;  // [rows, K] or nullptr
  int num_topk = 0;
  const void* bias0 = nullptr;  // [T, hidden] BF16 or nullptr
  const void* bias1 = nullptr;
  // Channels of x's rows; 0 means the dispatch's. It may differ from the dispatch's (as DeepEP allows, e.g.
  // experts whose output width is not their input's): the handle fixes only which rows go where.
  int hidden = 0;
};
// Its fields by name, for the binding and tools (epx/fields.hpp).
template <>
struct Fields<CombineInput> {
  template <typename Visit>
  static constexpr void visit(Visit&& v) {
    v("x", &CombineInput::x);
    v("topk_weights", &CombineInput::topk_weights);
    v("num_topk", &CombineInput::num_topk);
    v("bias0", &CombineInput::bias0);
    v("bias1", &CombineInput::bias1);
    v("hidden", &CombineInput::hidden);
  }
};
static_assert(lists_every_field<CombineInput>(), "Fields<CombineInput> must list every field");

struct CombineOutput {
  void* combined_x = nullptr;              // [T, hidden] BF16 (the combine's hidden)
  float* combined_topk_weights = nullptr;  // [T, K] (when topk_weights given)
};
// Its fields by name, for the binding and tools (epx/fields.hpp).
template <>
struct Fields<CombineOutput> {
  template <typename Visit>
  static constexpr void visit(Visit&& v) {
    v("combined_x", &CombineOutput::combined_x);
    v("combined_topk_weights", &CombineOutput::combined_topk_weights);
  }
};
static_assert(lists_every_field<CombineOutput>(), "Fields<CombineOutput> must list every field");

// Sums, without weights, every copy of each token returned by the ranks it went to, then adds the biases.
// The outputs must not overlap x or topk_weights: the reduce that writes them reads own rows from there.
Event combine(Buffer& buffer, const DispatchHandle& handle, const CombineInput& input,
              const CombineOutput& out, const StreamOrder& order);

}  // namespace epx
