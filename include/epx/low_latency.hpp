#pragma once

#include <cuda_runtime.h>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "epx/buffer.hpp"
#include "epx/event.hpp"
#include "epx/fields.hpp"

// Low-latency (decode) mode on raw device pointers: dispatch into the fixed per-expert layout [L, R*M, H] and
// the weighted combine back, through the Buffer's low-latency memory (size it with
// get_low_latency_rdma_size_hint). Every call is collective over the Buffer's ranks (all ranks make the same
// sequence of low-latency calls), allocates nothing and never synchronizes with the host, so it can be
// captured in a CUDA graph. Outputs are caller memory.
//
// Double buffering: successive calls (dispatch or combine) alternate between the two halves of the buffer.
// A call whose receive has not run yet (its hook was not called) keeps its half busy; a call that needs
// that half again throws instead of overwriting it. So at most two results are pending at once.
namespace epx {

// Rows of local expert le received from source rank s: rows [begin, begin + count) of le's block of R*M rows.
// NOTES: count comes first so that, on the little-endian GPU and host, the pair read as one int64 is
// begin << 32 | count: DeepEP's recv_layout_range, which callers and tests of deep_ep decode.
struct LowLatencyRange {
  int count;
  int begin;
};
static_assert(std::bit_cast<int64_t>(LowLatencyRange{.count = 7, .begin = 300}) == (int64_t(300) << 32 | 7),
              "a range is one int64, begin << 32 | count (DeepEP's packed layout range)");

// A top-k listing of a source token as the rank holding its expert sees it (a dispatch given
// recv_token_listings writes one per listing, for the pre-reduced combine): `row` is the flat row (local
// expert * R*M + row) of this rank's dispatch output that holds the listing's expert (duplicate listings name
// the same row), -1 when the expert lies on another rank or the id is -1; `weight` is the listing's top-k
// weight.
struct LowLatencyListing {
  int row;
  float weight;
};
static_assert(sizeof(LowLatencyListing) == 8, "a listing is two 32-bit words");

struct LowLatencyDispatchInput {
  const void* x = nullptr;            // [T, H] BF16, 16-byte aligned
  const int64_t* topk_idx = nullptr;  // [T, K] global expert ids, -1 = none (ids outside [-1, E) are ignored)
  int num_tokens = 0;                 // T <= M
  int num_topk = 0;                   // K in [1, 16]
  int hidden = 0;                     // H, a multiple of 128
  int num_max_dispatch_tokens_per_rank = 0;  // M, the same on every rank
  int num_experts = 0;                       // E, a multiple of the number of ranks
  bool use_fp8 = true;                       // cast per 128 channels in the kernel
  bool round_scale = false;                  // FP8 scales rounded up to powers of two
  bool use_ue8m0 = false;         // scales as packed UE8M0 bytes (requires use_fp8 and round_scale)
  bool return_recv_hook = false;  // only send now; LowLatencyRecvHook receives later
  int* cumulative_local_expert_recv_stats = nullptr;  // [L] or null: += received rows per local expert
  int64_t* dispatch_wait_recv_cost_stats = nullptr;   // [R] or null: += ns the receive waited per source
  // [T, K]: required when LowLatencyDispatchOutput::recv_token_listings is given (null allowed with T = 0),
  // refused without it. Each message then carries its token's top-k ids and weights, for the pre-reduced
  // combine.
  const float* topk_weights = nullptr;
};
// Its fields by name, for the binding and tools (epx/fields.hpp).
template <>
struct Fields<LowLatencyDispatchInput> {
  template <typename Visit>
  static constexpr void visit(Visit&& v) {
    v("x", &LowLatencyDispatchInput::x);
    v("topk_idx", &LowLatencyDispatchInput::topk_idx);
    v("num_tokens", &LowLatencyDispatchInput::num_tokens);
    v("num_topk", &LowLatencyDispatchInput::num_topk);
    v("hidden", &LowLatencyDispatchInput::hidden);
    v("num_max_dispatch_tokens_per_rank", &LowLatencyDispatchInput::num_max_dispatch_tokens_per_rank);
    v("num_experts", &LowLatencyDispatchInput::num_experts);
    v("use_fp8", &LowLatencyDispatchInput::use_fp8);
    v("round_scale", &LowLatencyDispatchInput::round_scale);
    v("use_ue8m0", &LowLatencyDispatchInput::use_ue8m0);
    v("return_recv_hook", &LowLatencyDispatchInput::return_recv_hook);
    v("cumulative_local_expert_recv_stats", &LowLatencyDispatchInput::cumulative_local_expert_recv_stats);
    v("dispatch_wait_recv_cost_stats", &LowLatencyDispatchInput::dispatch_wait_recv_cost_stats);
    v("topk_weights", &LowLatencyDispatchInput::topk_weights);
  }
};
static_assert(lists_every_field<LowLatencyDispatchInput>(),
              "Fields<LowLatencyDispatchInput> must list every field");

// Caller-allocated outputs (sizes: low_latency_dispatch_sizes). Rows past recv_count[le] are unspecified.
struct LowLatencyDispatchOutput {
  void* recv_x = nullptr;         // [L, R*M, H] BF16, or FP8 e4m3 bytes
  void* recv_x_scales = nullptr;  // FP8: float [L, R*M, H/128] stored column-major (as [L, H/128, R*M]);
                                  // UE8M0: int32 [L, R*M, ceil(H/512)] likewise; BF16: null
  int* recv_count = nullptr;      // [L]
  // The handle's arrays (combine reads them):
  int* recv_src_info = nullptr;                  // [L, R*M] source token index of each row
  int* recv_topk_pos = nullptr;                  // [L, R*M] top-k position of the token's (first) listing
  LowLatencyRange* recv_layout_range = nullptr;  // [L, R]
  // [R, M, K] or null: given, the dispatch carries the top-k weights (every rank gives it or none does) and
  // fills listing k of token t of source s at (s * M + t) * K + k, which a pre-reduced combine reads.
  // Entries of tokens that sent this rank nothing are unspecified.
  LowLatencyListing* recv_token_listings = nullptr;
};
// Its fields by name, for the binding and tools (epx/fields.hpp).
template <>
struct Fields<LowLatencyDispatchOutput> {
  template <typename Visit>
  static constexpr void visit(Visit&& v) {
    v("recv_x", &LowLatencyDispatchOutput::recv_x);
    v("recv_x_scales", &LowLatencyDispatchOutput::recv_x_scales);
    v("recv_count", &LowLatencyDispatchOutput::recv_count);
    v("recv_src_info", &LowLatencyDispatchOutput::recv_src_info);
    v("recv_topk_pos", &LowLatencyDispatchOutput::recv_topk_pos);
    v("recv_layout_range", &LowLatencyDispatchOutput::recv_layout_range);
    v("recv_token_listings", &LowLatencyDispatchOutput::recv_token_listings);
  }
};
static_assert(lists_every_field<LowLatencyDispatchOutput>(),
              "Fields<LowLatencyDispatchOutput> must list every field");

struct LowLatencyDispatchSizes {
  int num_local_experts = 0;    // L
  int num_rows_per_expert = 0;  // R*M
  int num_scale_columns = 0;    // H/128 floats, or ceil(H/512) int32 words with UE8M0, 0 for BF16
  size_t recv_x_bytes = 0;
  size_t recv_x_scales_bytes = 0;
  size_t recv_count_bytes = 0;
  size_t recv_src_info_bytes = 0;  // also recv_topk_pos
  size_t recv_layout_range_bytes = 0;
  size_t recv_token_listings_bytes = 0;  // R * M * K listings
};
LowLatencyDispatchSizes low_latency_dispatch_sizes(const Buffer& buffer,
                                                   const LowLatencyDispatchInput& input);

// What combine needs from its dispatch: shape and the (caller-owned, device) handle arrays. Plain values.
struct LowLatencyHandle {
  int num_tokens = 0;
  int num_topk = 0;
  int hidden = 0;
  int num_max_dispatch_tokens_per_rank = 0;
  int num_experts = 0;
  const int* recv_src_info = nullptr;
  const int* recv_topk_pos = nullptr;
  const LowLatencyRange* recv_layout_range = nullptr;
  const LowLatencyListing* recv_token_listings = nullptr;  // the dispatch's, or null
};

// Completes a send-only call: launches its receive phase on `stream` (the caller's). Runs once.
// Copyable; all copies share one state. Run it before the Buffer is destroyed.
class LowLatencyRecvHook {
 public:
  struct State;
  LowLatencyRecvHook() = default;
  explicit LowLatencyRecvHook(std::shared_ptr<State> state) : state_(std::move(state)) {}
  bool valid() const { return state_ != nullptr; }
  bool done() const;
  void operator()(cudaStream_t stream) const;

 private:
  std::shared_ptr<State> state_;
};

struct LowLatencyDispatchResult {
  LowLatencyHandle handle;
  Event event;              // with async_finish (and no hook)
  LowLatencyRecvHook hook;  // with return_recv_hook
};

// Without a hook the call runs on the Buffer's comm stream, ordered after order.compute_stream (or
// order.previous_event), and the compute stream waits for it unless order.async_finish. With a hook the send
// phase runs on order.compute_stream itself (async_finish is not allowed with a hook).
LowLatencyDispatchResult low_latency_dispatch(Buffer& buffer, const LowLatencyDispatchInput& input,
                                              const LowLatencyDispatchOutput& output,
                                              const StreamOrder& order);

struct LowLatencyCombineInput {
  const void* x = nullptr;  // [L, R*M, H] BF16 expert outputs in the dispatch output order; with zero_copy
                            // null (or next_low_latency_combine_buffer()): the rows are already there
  const int64_t* topk_idx = nullptr;    // [T, K] the ids this rank dispatched with
  const float* topk_weights = nullptr;  // [T, K]
  int num_tokens = 0;                   // T of the dispatch
  int num_topk = 0;                     // K of the dispatch
  // LogFMT-10 on the links between nodes: a row that crosses to another node goes packed, 0.64x BF16's
  // bytes, decoded bit-exactly as the CPU reference does, at the cost of arithmetic on both sides (one H200,
  // 128 tokens of hidden 7168: 44 us more than BF16, docs/BENCHMARKS.md). That pays on links slower than
  // about 120 GB/s (a network), not over NVLink: rows that stay within the NVLink node travel as BF16
  // (exact), and a Buffer within one node runs the BF16 combine. Every rank passes the same value.
  bool use_logfmt = false;
  // With use_logfmt: LogFMT-code the rows that stay within the node as well (the same numerics on every
  // link, at LogFMT's cost). Every rank passes the same value.
  bool logfmt_within_node = false;
  // The expert side sums each token's rows over its own experts first (the weights come from the dispatch,
  // which must have had recv_token_listings) and sends one row per (token, rank) instead of one per (token,
  // expert); the token's rank adds those partial rows in ascending rank order. The roundings differ from
  // the default's wherever a rank holds several of a token's experts (reference::LowLatencyCombineOptions).
  // Every rank passes the same value.
  bool pre_reduce = false;
  bool zero_copy = false;
  bool return_recv_hook = false;
  int64_t* combine_wait_recv_cost_stats = nullptr;  // [R] or null
};
// Its fields by name, for the binding and tools (epx/fields.hpp).
template <>
struct Fields<LowLatencyCombineInput> {
  template <typename Visit>
  static constexpr void visit(Visit&& v) {
    v("x", &LowLatencyCombineInput::x);
    v("topk_idx", &LowLatencyCombineInput::topk_idx);
    v("topk_weights", &LowLatencyCombineInput::topk_weights);
    v("num_tokens", &LowLatencyCombineInput::num_tokens);
    v("num_topk", &LowLatencyCombineInput::num_topk);
    v("use_logfmt", &LowLatencyCombineInput::use_logfmt);
    v("logfmt_within_node", &LowLatencyCombineInput::logfmt_within_node);
    v("pre_reduce", &LowLatencyCombineInput::pre_reduce);
    v("zero_copy", &LowLatencyCombineInput::zero_copy);
    v("return_recv_hook", &LowLatencyCombineInput::return_recv_hook);
    v("combine_wait_recv_cost_stats", &LowLatencyCombineInput::combine_wait_recv_cost_stats);
  }
};
static_assert(lists_every_field<LowLatencyCombineInput>(),
              "Fields<LowLatencyCombineInput> must list every field");

struct LowLatencyCombineResult {
  Event event;
  LowLatencyRecvHook hook;
};

// combined_x [T, H] BF16 (caller memory, 16-byte aligned) = sum over the token's experts of weight * output,
// in top-k order with float accumulation (a duplicated expert counts once per listing); with pre_reduce in
// the order reference::LowLatencyCombineOptions::pre_reduce defines.
LowLatencyCombineResult low_latency_combine(Buffer& buffer, const LowLatencyHandle& handle,
                                            const LowLatencyCombineInput& input, void* combined_x,
                                            const StreamOrder& order);

// The BF16 [L, R*M, H] rows the next zero-copy combine with this handle's shape sends from (in the Buffer).
void* next_low_latency_combine_buffer(const Buffer& buffer, const LowLatencyHandle& handle);

// Resets the low-latency signals of every rank and the host's call sequence (collective over the ranks this
// rank has not masked; no low-latency call may be in flight). Needed to recover after an error and before an
// unmasked rank takes part again; shapes may change between calls without it. The rank mask is kept.
void clean_low_latency_buffer(Buffer& buffer, int num_max_dispatch_tokens_per_rank, int hidden,
                              int num_experts, const StreamOrder& order);

// ---- Rank masks (DeepEP's low_latency_*_mask_buffer; docs/RELIABILITY.md) ----
// Each rank keeps its own mask of the group's ranks, in device memory that every low-latency kernel reads
// when it runs (so a change between CUDA graph replays takes effect at the next replay). A rank masked here
// is left out of this rank's low-latency calls: dispatch sends nothing to it and does not wait for it (its
// receive counts are 0), combine sends nothing to it, does not wait for it and leaves its experts'
// contributions out (like -1 top-k entries), and clean_low_latency_buffer's barrier skips it. With
// BufferOptions::enable_shrink a wait that times out on a peer masks it. The mask calls are stream ordered
// like the other calls (on the comm stream after `order`), allocate nothing and can be captured. Every rank
// that still calls should mask the same ranks; a rank that was masked takes part again after every rank
// unmasked it and called clean_low_latency_buffer (collective).

// mask = true: masks `rank_to_mask`; false: unmasks it. rank_to_mask in [0, num_ranks).
void low_latency_update_mask_buffer(Buffer& buffer, int rank_to_mask, bool mask, const StreamOrder& order);
// Writes int32 [num_ranks] into `mask_status` (device memory): 1 = masked, 0 = not.
void low_latency_query_mask_buffer(Buffer& buffer, int* mask_status, const StreamOrder& order);
// Unmasks every rank.
void low_latency_clean_mask_buffer(Buffer& buffer, const StreamOrder& order);

// The mask as bits (bit r = rank r), read now from the device (host-synchronous, on a private stream: it
// does not wait for calls in flight; synchronize first). For tests and logs.
struct LowLatencyMaskBits {
  uint64_t masked = 0;
  uint64_t masked_by_timeout = 0;  // masked by a wait that timed out (enable_shrink)
};
LowLatencyMaskBits read_low_latency_mask(const Buffer& buffer);

}  // namespace epx
