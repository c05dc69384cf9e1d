#include "epx/normal.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>

#include "buffer_map/internode_buffer_map.hpp"
#include "buffer_map/layout_board_map.hpp"
#include "buffer_map/normal_buffer_map.hpp"
#include "buffer_map/normal_nodes.hpp"
#include "common/tagged_word.hpp"
#include "core/block_recycler.hpp"
#include "core/env.hpp"
#include "core/host_steps.hpp"
#include "epx/error.hpp"
#include "formats/scale_format.hpp"
#include "gpu/cuda_check.hpp"
#include "kernels/combine_warp_roles.hpp"
#include "kernels/deep_ep_matrices.hpp"
#include "kernels/internode_kernels.hpp"
#include "kernels/normal_kernels.hpp"
#include "runtime/buffer_access.hpp"
#include "runtime/combine_staging.hpp"
#include "runtime/dispatch_handle_state.hpp"
#include "runtime/layout_board.hpp"
#include "runtime/low_latency_state.hpp"
#include "runtime/normal_fingerprint.hpp"
#include "runtime/normal_host_scratch.hpp"
#include "runtime/stream_order.hpp"

namespace epx {

namespace {

// The host's bound on notify's counts: the device's bound plus a grace second. The device gives up first and
// publishes its counts with a record naming the peer; the host bound only catches a notify that never ran.
uint64_t host_bound_ns(uint64_t device_bound_ns) {
  constexpr uint64_t kGraceNs = 1'000'000'000;
  return device_bound_ns > UINT64_MAX - kGraceNs ? UINT64_MAX : device_bound_ns + kGraceNs;
}

// Spins until notify published this call's counts, i.e. until each of the first `num_words` tagged words
// carries `sequence` (no flag: each word says itself whether it is current), and returns their values.
// Bounded like the device waits; a failed launch raises its error.
std::vector<int> wait_for_counts(const Buffer& buffer, cudaStream_t stream, uint32_t sequence,
                                 int num_words) {
  const volatile uint64_t* words = normal_host_scratch(buffer).counts;
  std::vector<int> values(num_words);
  int done = 0;  // words [0, done) carry the sequence
  const auto start = std::chrono::steady_clock::now();
  for (uint64_t spin = 0;; ++spin) {
    for (; done < num_words; ++done) {
      const uint64_t word = words[done];
      if (tagged_sequence(word) != sequence) break;
      values[done] = tagged_value(word);
    }
    if (done == num_words) break;
    if (spin % 1024 != 1023) continue;
    const cudaError_t status = cudaStreamQuery(stream);
    if (status != cudaSuccess && status != cudaErrorNotReady) buffer.synchronize(stream);  // raises
    if (status == cudaSuccess && tagged_sequence(words[done]) != sequence) {
      EPX_FAIL("rank ", buffer.rank(), ": dispatch notify finished without publishing count ", done,
               " (sequence ", tagged_sequence(words[done]), ", expected ", sequence, ")");
    }
    const uint64_t waited = elapsed_ns(start);
    if (waited > host_bound_ns(buffer.wait_timeout_ns())) {
      buffer.check_timeout();  // the device's own report names the peer; prefer it
      EPX_FAIL("rank ", buffer.rank(), ": timed out after ", waited / 1e9,
               " s waiting for dispatch notify's counts (phase dispatch notify; a peer may not have called "
               "dispatch)");
    }
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  normal_host_scratch(buffer).count_wait_ns += elapsed_ns(start);
  buffer.check_timeout();  // an aborted notify publishes its counts too; they mean nothing then
  return values;
}

// EPX_LAUNCH_RECEIVE=0 turns DispatchOverlap::kLaunchReceive into kNone for the whole process. For
// compute-sanitizer's memcheck: it checks a kernel's accesses against the allocations that existed when the
// kernel was launched, so it reports a launched receive's writes into outputs allocated after notify.
bool launch_receive_allowed() {
  static const bool allowed = !env_equals("EPX_LAUNCH_RECEIVE", "0");
  return allowed;
}

// Where channel 0's stream leaders report their cycles (DispatchArgs::phases): the Buffer's reports with
// EPX_NORMAL_PHASES=1, else null.
kernels::PhaseReport* phase_reports(const Buffer& buffer) {
  return phase_reports_requested() ? device_address(buffer, normal_host_scratch(buffer).phases) : nullptr;
}

kernels::PeerContext peer_context(const Buffer& buffer) {
  return kernels::PeerContext{buffer.nvl_peer_bases_device(),
                              buffer.nvl_buffer(),
                              buffer.rank(),
                              buffer.num_ranks(),
                              BufferAccess::failure_record_device(buffer),
                              buffer.wait_timeout_ns(),
                              BufferAccess::abort_words(buffer)};
}

// The buffer's config with the handle's channels: a cached dispatch and the combine split the tokens as the
// dispatch that made the handle did, whatever the SM budget is now.
Config queue_config(const Buffer& buffer, const DispatchHandle::State& state) {
  Config config = buffer.config();
  config.num_sms = 2 * state.num_channels;
  return config;
}

NormalBufferMap dispatch_buffer_map(const Buffer& buffer, const DispatchHandle::State& state) {
  return NormalBufferMap::of(buffer.num_ranks(), queue_config(buffer, state),
                             NormalRecord::dispatch(state.shape));
}

// Across nodes: the queues of a call with records of `record`, in the symmetric and the NVLink buffer. Both
// must fit before anything is launched.
struct InternodeBufferMaps {
  InternodeBufferMap rdma;
  ForwardBufferMap nvl;
};
InternodeBufferMaps internode_buffer_maps(const Buffer& buffer, const DispatchHandle::State& state,
                                          const InternodeRecord& record) {
  const Config config = queue_config(buffer, state);
  const NodeMap nodes{buffer.num_ranks(), buffer.ranks_per_node()};
  check_normal_forward_queues(config, nodes.num_nodes());
  InternodeBufferMaps maps{InternodeBufferMap::of(nodes.num_nodes(), config, record),
                           ForwardBufferMap::of(nodes.ranks_per_node, nodes.num_nodes(), config, record)};
  EPX_CHECK(buffer.num_rdma_bytes() > 0, "num_rdma_bytes", buffer.num_rdma_bytes(),
            "must be > 0 for normal mode across nodes (size it with Config::get_rdma_buffer_size_hint)");
  check_internode_map_fits(maps.rdma, buffer.num_rdma_bytes());
  check_forward_map_fits(maps.nvl, buffer.num_nvl_queue_bytes());
  // Every call across nodes passes here before it launches: its queues take the symmetric buffer's shared
  // area.
  lend_symmetric_buffer_to_normal_mode(*BufferAccess::low_latency_state(buffer));
  return maps;
}

kernels::InternodeContext internode_context(const Buffer& buffer) {
  // EPX_INTERNODE_PUTS is read per call: a test switches it between Buffers.
  return {peer_context(buffer), buffer.symmetric_buffer(),
          NodeMap{buffer.num_ranks(), buffer.ranks_per_node()}, !env_equals("EPX_INTERNODE_PUTS", "1")};
}

// Rows move with 16-byte accesses and bulk copies, which fault (killing the CUDA context) on a misaligned
// address: refuse it on the host instead.
void check_row_alignment(const void* rows, const char* name) {
  EPX_CHECK(reinterpret_cast<uintptr_t>(rows) % 16 == 0, name, rows,
            "must be 16-byte aligned (rows move with 16-byte and bulk copies)");
}

// The public TokenFormat as a scale format (the boundary of the API). Normal mode moves rows already cast and
// their scales as opaque words, so FP8 is one format whatever its scales hold (num_scales says how many).
ScaleFormat scale_format_of(TokenFormat format) {
  return format == TokenFormat::kFp8 ? ScaleFormat::kFp8 : ScaleFormat::kBf16;
}

// Scale words per row of a dispatch of `in`: the caller's num_scales, else its format's.
int scale_words_of(const DispatchInput& in) {
  return in.num_scales > 0 ? in.num_scales : row_format(scale_format_of(in.format)).scale_words(in.hidden);
}

// The outputs of a dispatch with `state`'s shape and format, for `rows` rows (`rows_text` names them).
void check_outputs(const DispatchOutput& out, const DispatchHandle::State& state, int rows,
                   const char* rows_text) {
  EPX_CHECK(rows == 0 || out.recv_x != nullptr, "recv_x", "null",
            detail::concat("must point to ", rows_text).c_str());
  EPX_CHECK(!row_format(state.format).has_scales() || rows == 0 || out.recv_x_scales != nullptr,
            "recv_x_scales", "null", "are required for FP8 tokens");
  EPX_CHECK(out.recv_topk_idx == nullptr || state.shape.num_topk > 0, "recv_topk_idx", "non-null",
            "needs a dispatch with topk_idx");
  EPX_CHECK((out.recv_topk_idx == nullptr) == (out.recv_topk_weights == nullptr), "recv_topk_weights",
            out.recv_topk_weights == nullptr ? "null" : "non-null",
            "must be given together with recv_topk_idx");
  check_row_alignment(out.recv_x, "recv_x");
}

bool same_outputs(const DispatchOutput& a, const DispatchOutput& b) {
  return a.recv_x == b.recv_x && a.recv_x_scales == b.recv_x_scales && a.recv_topk_idx == b.recv_topk_idx &&
         a.recv_topk_weights == b.recv_topk_weights;
}

void validate_dispatch_input(const Buffer& buffer, const DispatchInput& in, bool cached) {
  EPX_CHECK(buffer.num_nvl_bytes() > 0, "num_nvl_bytes", buffer.num_nvl_bytes(),
            "must be > 0 for normal-mode dispatch (construct the Buffer with an NVLink buffer)");
  EPX_CHECK(in.num_tokens >= 0, "num_tokens", in.num_tokens, "must be >= 0");
  EPX_CHECK(in.hidden > 0, "hidden", in.hidden, "must be > 0");
  EPX_CHECK(in.hidden % 8 == 0, "hidden", in.hidden, "must be a multiple of 8");
  const RowFormat format = row_format(scale_format_of(in.format));
  if (format.has_scales()) {
    // FP8 rows move with 16-byte accesses; the scales are opaque words, so only their default count
    // (one per 128 channels) needs hidden to be a multiple of 128.
    EPX_CHECK(format.row_bytes(in.hidden) % 16 == 0, "hidden", in.hidden,
              "must be a multiple of 16 for FP8 tokens (16-byte rows)");
    EPX_CHECK(in.num_scales >= 0, "num_scales", in.num_scales, "must be >= 0 (0: hidden / 128)");
    EPX_CHECK(in.num_scales > 0 || in.hidden % format.group_size == 0, "hidden", in.hidden,
              "must be a multiple of 128 for FP8 tokens with the default num_scales = hidden / 128");
    EPX_CHECK(in.num_tokens == 0 || in.x_scales != nullptr, "x_scales", "null",
              "are required for FP8 tokens");
  } else {
    EPX_CHECK(in.x_scales == nullptr, "x_scales", "non-null", "must be null for BF16 tokens");
    EPX_CHECK(in.num_scales == 0, "num_scales", in.num_scales, "must be 0 for BF16 tokens");
  }
  EPX_CHECK(in.num_tokens == 0 || in.x != nullptr, "x", "null", "must point to [num_tokens, hidden] tokens");
  check_row_alignment(in.x, "x");
  EPX_CHECK(in.num_topk >= 0, "num_topk", in.num_topk, "must be >= 0");
  EPX_CHECK(in.num_topk <= kMaxTopk, "num_topk", in.num_topk, "must be <= 16");
  // num_topk > 0 means "with top-k" on every rank, even one whose empty tensors have null addresses: the
  // buffer map depends on it and must agree across ranks.
  EPX_CHECK(in.topk_weights == nullptr || in.topk_idx != nullptr || in.num_tokens == 0, "topk_weights",
            "non-null", "need topk_idx as well");
  EPX_CHECK(in.topk_idx == nullptr || in.num_topk > 0, "num_topk", in.num_topk,
            "must be > 0 when topk_idx is given");
  EPX_CHECK(in.num_topk == 0 || in.num_tokens == 0 || in.topk_idx != nullptr, "topk_idx", "null",
            "must point to [num_tokens, num_topk] ids when num_topk > 0");
  EPX_CHECK(in.num_experts >= 0, "num_experts", in.num_experts, "must be >= 0");
  EPX_CHECK(in.num_experts % buffer.num_ranks() == 0, "num_experts", in.num_experts,
            "must be a multiple of the number of ranks");
  EPX_CHECK(in.num_topk == 0 || in.num_experts > 0, "num_experts", in.num_experts, "must be > 0 with top-k");
  EPX_CHECK(in.expert_alignment >= 1, "expert_alignment", in.expert_alignment, "must be >= 1");
  EPX_CHECK(in.num_worst_tokens >= 0, "num_worst_tokens", in.num_worst_tokens, "must be >= 0");
  check_normal_dispatch_nodes(buffer.num_ranks() / buffer.ranks_per_node(), in.num_worst_tokens);
  if (!cached) {
    EPX_CHECK(in.num_tokens == 0 || in.is_token_in_rank != nullptr, "is_token_in_rank", "null",
              "is required without a cached handle");
  }
}

}  // namespace

DispatchHandle::State& DispatchHandle::state() const {
  if (state_ == nullptr) EPX_FAIL("empty DispatchHandle");
  return *state_;
}
int DispatchHandle::num_tokens() const {
  return state().num_tokens;
}
int DispatchHandle::num_recv_rows() const {
  return state().num_recv_rows;
}
int DispatchHandle::hidden() const {
  return state().shape.hidden;
}
const int* DispatchHandle::recv_src_idx_device() const {
  return state().arrays.recv_src_idx;
}
const std::vector<int>& DispatchHandle::num_recv_per_rank() const {
  return state().num_recv_per_rank;
}
int DispatchHandle::num_channels() const {
  return state().num_channels;
}
const int* DispatchHandle::recv_channel_offset_device() const {
  return state().arrays.recv_channel_offset;
}
const int* DispatchHandle::send_head_device() const {
  return state().arrays.send_head;
}
const uint8_t* DispatchHandle::is_token_in_rank_device() const {
  return state().arrays.is_token_in_rank;
}
const int* DispatchHandle::deep_ep_matrices_device() const {
  return state().arrays.deep_ep_matrices;
}

namespace {

// `bytes` from the Buffer's handle pool, ordered on its comm stream, freed on it with the last owner. With
// `complete_on` (a private, otherwise idle stream) the allocation is made there and waited for instead: then
// it is valid for any work, even a kernel the comm stream already runs (a launched receive), which a
// stream-ordered allocation behind that kernel would not be. On the comm stream a block a dead handle gave
// back serves first (core/block_recycler.hpp says why that is stream-ordered too), and the last owner gives
// its block back instead of freeing it: no pool call either way.
std::shared_ptr<void> allocate_on_stream(const Buffer& buffer, size_t bytes,
                                         cudaStream_t complete_on = nullptr) {
  std::shared_ptr<CUstream_st> stream = BufferAccess::comm_stream_shared(buffer);
  std::shared_ptr<CUmemPoolHandle_st> pool = BufferAccess::handle_memory_pool(buffer);
  void* raw = nullptr;
  if (complete_on != nullptr) {
    EPX_CUDA_CHECK(cudaMallocFromPoolAsync(&raw, bytes, pool.get(), complete_on));
    EPX_CUDA_CHECK(cudaStreamSynchronize(complete_on));
    // The array holds the pool: a handle that outlives its Buffer frees into a pool that still exists.
    return std::shared_ptr<void>(raw, [stream = std::move(stream), pool = std::move(pool)](void* p) {
      cudaFreeAsync(p, stream.get());
    });
  }
  std::shared_ptr<BlockRecycler> blocks = BufferAccess::handle_blocks(buffer);
  BlockRecycler::Block block = blocks->take(bytes);
  if (block.address == nullptr) {
    block.bytes = BlockRecycler::rounded(bytes);
    EPX_CUDA_CHECK(cudaMallocFromPoolAsync(&block.address, block.bytes, pool.get(), stream.get()));
  }
  return std::shared_ptr<void>(block.address, [stream = std::move(stream), pool = std::move(pool),
                                               blocks = std::move(blocks), bytes = block.bytes](void* p) {
    if (!blocks->keep({p, bytes})) cudaFreeAsync(p, stream.get());
  });
}

// What the caller sizes the outputs with, and the handle.
DispatchPlan plan_of(std::shared_ptr<DispatchHandle::State> state) {
  DispatchPlan plan;
  plan.num_recv_rows = state->num_recv_rows;
  if (state->num_worst_tokens == 0) plan.num_recv_tokens_per_expert = state->num_recv_tokens_per_expert;
  plan.handle = DispatchHandle(std::move(state));
  return plan;
}

}  // namespace

void DispatchHandle::State::allocate_routing(const Buffer& buffer, int num_local_experts, int num_rows) {
  const int num_ranks = shape.num_ranks;
  const size_t cells = static_cast<size_t>(std::max(num_tokens, 1)) * num_ranks;
  const size_t node_cells = static_cast<size_t>(num_nodes) * num_channels + 1;
  const size_t deep_ep_cells = num_nodes > 1 ? 0 : kernels::deep_ep_matrices_size(num_ranks, num_channels);
  const size_t ints = cells /*send_head*/ + static_cast<size_t>(num_ranks) * num_channels + 1 +
                      std::max(num_local_experts, 1) + (num_nodes > 1 ? node_cells : 0) + deep_ep_cells +
                      num_rows;
  routing_memory = allocate_on_stream(buffer, ints * sizeof(int) + cells /*is_token_in_rank*/);
  arrays.send_head = static_cast<int*>(routing_memory.get());
  arrays.recv_channel_offset = arrays.send_head + cells;
  arrays.num_recv_tokens_per_expert =
      arrays.recv_channel_offset + static_cast<size_t>(num_ranks) * num_channels + 1;
  int* end = arrays.num_recv_tokens_per_expert + std::max(num_local_experts, 1);
  if (num_nodes > 1) {
    arrays.node_channel_offset = end;
    end += node_cells;
  } else {
    arrays.deep_ep_matrices = end;
    end += deep_ep_cells;
  }
  if (num_rows > 0) {
    arrays.recv_src_idx = end;
    end += num_rows;
    rows_memory = routing_memory;
    rows_capacity = num_rows;
  }
  arrays.is_token_in_rank = reinterpret_cast<uint8_t*>(end);
}

void DispatchHandle::State::allocate_rows(const Buffer& buffer, int num_rows, cudaStream_t complete_on) {
  const size_t row_bytes = sizeof(int) * std::max(num_rows, 1);
  rows_memory = allocate_on_stream(buffer, row_bytes + std::max(num_forward_records, 1), complete_on);
  rows_capacity = std::max(num_rows, 1);
  arrays.recv_src_idx = static_cast<int*>(rows_memory.get());
  arrays.forward_mask = num_nodes > 1 ? static_cast<uint8_t*>(rows_memory.get()) + row_bytes : nullptr;
}

Event get_dispatch_layout(Buffer& buffer, const int64_t* topk_idx, int num_tokens, int num_topk,
                          int num_experts, const DispatchLayoutOutput& out, const StreamOrder& order) {
  const ExclusiveUse::Claim claim = BufferAccess::enter_call(buffer, "get_dispatch_layout");
  EPX_CHECK(num_tokens >= 0, "num_tokens", num_tokens, "must be >= 0");
  EPX_CHECK(num_topk >= 1, "num_topk", num_topk, "must be >= 1");
  EPX_CHECK(num_topk <= kMaxTopk, "num_topk", num_topk, "must be <= 16");
  EPX_CHECK(num_experts > 0, "num_experts", num_experts, "must be > 0");
  EPX_CHECK(num_experts <= kMaxExperts, "num_experts", num_experts, "must be <= 4096");
  EPX_CHECK(num_experts % buffer.num_ranks() == 0, "num_experts", num_experts,
            "must be a multiple of the number of ranks");
  EPX_CHECK(num_tokens == 0 || topk_idx != nullptr, "topk_idx", "null",
            "must point to [num_tokens, num_topk] ids");
  begin_on_comm_stream(buffer, order);
  NormalHostScratch& scratch = normal_host_scratch(buffer);
  scratch.invalid_id = 0;
  kernels::LayoutArgs args{topk_idx,
                           num_tokens,
                           num_topk,
                           num_experts,
                           buffer.num_ranks(),
                           out.num_tokens_per_rank,
                           out.num_tokens_per_expert,
                           out.is_token_in_rank,
                           device_address(buffer, &scratch.invalid_id),
                           buffer.ranks_per_node(),
                           out.num_tokens_per_rdma_rank,
                           BufferAccess::layout_scratch(buffer)};
  // One node: the counts go to the layout board too, for the notify after this layout.
  const BufferAccess::LayoutBoard board = BufferAccess::layout_board(buffer);
  scratch.layout_post = {};
  if (board.device != nullptr) {
    args.board = board.device;
    args.board_map = board.map;
    args.board_sequence = next_sequence(scratch.notify_sequence);
    args.rank = buffer.rank();
    scratch.layout_post = {out.num_tokens_per_rank, out.num_tokens_per_expert, num_experts,
                           args.board_sequence};
  }
  kernels::launch_layout(args, buffer.comm_stream());
  return end_on_comm_stream(buffer, order);
}

namespace {

// EPX_DISPATCH_SENDER_OWN_WARPS=N: N warps of each sender block copy rows this rank keeps (DispatchArgs::
// sender_own_warps; read once, bounded by the kernel; 0: the receiver blocks copy them all). Unset: -1, the
// kernel's measured default (default_sender_own_warps).
int sender_own_warps() {
  static const int requested = env_count("EPX_DISPATCH_SENDER_OWN_WARPS");
  return requested;
}

// EPX_COMBINE_SENDER_REDUCE_WARPS=N: N warps of each combine sender block reduce a share of the tokens beside
// the reducer block (CombineArgs::sender_reduce_warps; read once, bounded by combine_sender_roles; 0: the
// reducer block reduces them all). It must be the same on every rank: the launch's fingerprint carries it, so
// ranks that differ fail the shape check. Unset: -1, the default (default_combine_sender_reduce_warps).
int combine_sender_reduce_warps() {
  static const int requested = env_count("EPX_COMBINE_SENDER_REDUCE_WARPS");
  return requested;
}

// Whether each combine sender group's last warp publishes the queue's tail while the others write on
// (CombineArgs::publisher_warp): by default with 2 ranks, where it was measured (with the send chunk of 16
// the 2-rank config recommends: docs/BENCHMARKS.md); EPX_COMBINE_PUBLISHER_WARP=1 / 0 turns it on / off for
// any group (read once). The receivers read the tails alike either way, so ranks may differ.
bool combine_publisher_warp(int num_ranks) {
  static const int requested = env_count("EPX_COMBINE_PUBLISHER_WARP");
  return requested < 0 ? num_ranks == 2 : requested == 1;
}

// EPX_DISPATCH_RECEIVER_OWN_WARPS=N: N warps of each receiver block copy own rows, the rest receive
// (DispatchArgs::receiver_own_warps; read once, bounded by the kernel: 0 only while the sender block has
// own-row warps). Unset: -1, the measured default (default_receiver_own_warps).
int receiver_own_warps() {
  static const int requested = env_count("EPX_DISPATCH_RECEIVER_OWN_WARPS");
  return requested;
}

// The single-node dispatch launch of `state` for input `in`: into `out`, or (published != nullptr) into the
// outputs the host publishes there later.
kernels::DispatchArgs dispatch_args(const Buffer& buffer, const DispatchHandle::State& state,
                                    const DispatchInput& in, const DispatchOutput& out) {
  const NormalBufferMap map = dispatch_buffer_map(buffer, state);
  const NormalRecord record = NormalRecord::dispatch(state.shape);
  // A Buffer with an output window: every receiver posts how it receives, into its window or through its
  // queues (kernels/normal_window.cuh), so each rank chooses for itself.
  const bool window_posts = buffer.num_nvl_output_bytes() > 0 && buffer.num_ranks() > 1;
  kernels::DispatchArgs args{
      peer_context(buffer),
      map,
      record,
      state.num_tokens,
      state.shape.num_experts,
      buffer.config().num_max_nvl_chunked_send_tokens,
      state.arrays.is_token_in_rank,
      in,
      state.arrays,
      state.num_recv_rows,
      out,
      normal_launch_fingerprint(
          map, record, state.shape.hidden, state.shape.num_experts,
          window_posts ? NormalOperation::kDispatchWithWindow : NormalOperation::kDispatch,
          state.format != ScaleFormat::kBf16),
      nullptr,
      0,
      0,
      false,
      {},
      state.board,
      phase_reports(buffer)};
  args.sender_own_warps = sender_own_warps();
  args.receiver_own_warps = receiver_own_warps();
  args.window_posts = window_posts;
  return args;
}

// A dispatch within one node whose recv_x lies in the output window goes straight into its outputs
// (DispatchArgs::to_window): then every output it has must lie there, 16-byte aligned. Without a cached
// handle the sources put the rows' source indices into this rank's queues (no source writes them while this
// rank receives into its window: its posts say so), for the receiver to copy into the handle; when they do
// not fit there (tiny queues, very many rows) this rank receives through its queues. Returns the offsets from
// the buffer's base in 16-byte units (NormalBufferMap::DirectOutput order, -1: none), or nothing for the
// queue's way. Each rank chooses for itself: its receivers post which way it receives
// (DispatchArgs::window_posts).
// `rows`: of the outputs (a guess's room before the counts are known; -1: the state's num_recv_rows).
// `strict`: outputs of which only recv_x lies in the window are an error; otherwise (a guess) they take the
// queues' way.
using WindowOffsets = std::array<int, NormalBufferMap::kDirectOutputs>;
std::optional<WindowOffsets> window_placement(const Buffer& buffer, const DispatchHandle::State& state,
                                              const NormalBufferMap& map, const DispatchOutput& out,
                                              int rows_of_outputs = -1, bool strict = true) {
  const char* window = static_cast<const char*>(buffer.nvl_output_window());
  const char* window_end = window + buffer.num_nvl_output_bytes();
  const auto* x = static_cast<const char*>(out.recv_x);
  if (state.num_nodes > 1 || buffer.num_ranks() == 1 || x == nullptr || x < window || x >= window_end) {
    return std::nullopt;
  }
  const auto rows = static_cast<size_t>(rows_of_outputs >= 0 ? rows_of_outputs : state.num_recv_rows);
  const auto topk = static_cast<size_t>(state.shape.num_topk);
  const char* base = static_cast<const char*>(buffer.nvl_buffer());
  if (!state.cached && rows * sizeof(int) > map.total_bytes() - NormalBufferMap::kQueuesOffset)
    return std::nullopt;
  const struct {
    const void* data;
    size_t bytes;
    const char* name;
  } outputs[4] = {{out.recv_x, rows * state.shape.x_row_bytes, "recv_x"},
                  {out.recv_x_scales, rows * state.shape.num_scales * sizeof(float), "recv_x_scales"},
                  {out.recv_topk_idx, rows * topk * sizeof(int64_t), "recv_topk_idx"},
                  {out.recv_topk_weights, rows * topk * sizeof(float), "recv_topk_weights"}};
  WindowOffsets offsets;
  offsets.fill(-1);
  for (int i = 0; i < 4; ++i) {
    const char* data = static_cast<const char*>(outputs[i].data);
    if (data == nullptr) continue;
    const bool inside = data >= window && data + outputs[i].bytes <= window_end;
    const bool aligned = (data - base) % 16 == 0;
    if (!strict && !(inside && aligned)) return std::nullopt;
    EPX_CHECK(inside, outputs[i].name, "outside the window",
              "must lie in the output window (Buffer::nvl_output_window) when recv_x does");
    EPX_CHECK(aligned, outputs[i].name, "not 16-byte aligned",
              "must be 16-byte aligned in the output window");
    offsets[i] = static_cast<int>((data - base) / 16);
  }
  if (!state.cached) offsets[NormalBufferMap::kDirectSrcIdx] = NormalBufferMap::kQueuesOffset / 16;
  return offsets;
}

// The dispatch launch `args` runs the count exchange `exchange` too (DispatchArgs::with_notify). Its senders
// then read the caller's is_token_in_rank, since they write the handle's copy.
void exchange_in_launch(kernels::DispatchArgs& args, const kernels::NotifyArgs& exchange) {
  args.with_notify = true;
  args.notify = exchange;
  args.is_token_in_rank = exchange.is_token_in_rank;
}

// Tells the receive dispatch_notify launched with `sequence` where its rows go (cancelled: nowhere, it only
// drains its queues), if that receive still waits; a no-op otherwise, so a spent or stale plan can never hand
// its outputs to a later call's receive. The fields are written before the sequence; x86 stores become
// visible in program order, and the kernel reads the sequence with acquire before the fields.
void publish_outputs(const Buffer& buffer, uint32_t sequence, const DispatchOutput& out, int* recv_src_idx,
                     int rows, bool cancelled) {
  NormalHostScratch& scratch = normal_host_scratch(buffer);
  if (sequence == 0 || scratch.pending_receive != sequence) return;
  kernels::PublishedOutputs& p = scratch.outputs;
  p.recv_x = out.recv_x;
  p.recv_x_scales = out.recv_x_scales;
  p.recv_topk_idx = out.recv_topk_idx;
  p.recv_topk_weights = out.recv_topk_weights;
  p.recv_src_idx = recv_src_idx;
  p.cancelled = cancelled ? 1 : 0;
  p.rows = rows;
  std::atomic_thread_fence(std::memory_order_release);
  *static_cast<volatile uint32_t*>(&p.sequence) = sequence;
  scratch.pending_receive = 0;
}

// The receive launched with `sequence`, if it still waits, drains its queues and writes nothing.
void cancel_receive(const Buffer& buffer, uint32_t sequence) {
  publish_outputs(buffer, sequence, DispatchOutput{}, nullptr, 0, true);
}

// The host's copy of the counts a notify published (HostCountIndex's order), into `state`.
void take_counts(DispatchHandle::State& state, const std::vector<int>& counts,
                 const kernels::HostCountIndex& index, bool with_experts) {
  state.num_recv_rows = counts[index.rows()];
  state.num_recv_per_rank.assign(counts.begin() + index.rows_from(0),
                                 counts.begin() + index.rows_from(index.num_ranks));
  // Per-expert counts exist only when the layout's per-expert counts were given (as the reference says).
  if (with_experts) {
    state.num_recv_tokens_per_expert.assign(counts.begin() + index.expert(0),
                                            counts.begin() + index.expert(index.num_local_experts));
  } else {
    state.num_recv_tokens_per_expert.clear();
  }
  if (state.num_nodes > 1) state.num_forward_records = counts[index.forward_records()];
}

void check_no_invalid_id(const std::vector<int>& counts, const kernels::HostCountIndex& index) {
  const int invalid = counts[index.invalid_id()];
  EPX_CHECK(invalid == 0, "topk_idx", detail::concat("an id of token ", invalid - 1),
            "must be -1 or in [0, num_experts)");
}

// One dispatch_notify call: what each of its paths reads, and the handle state it fills.
struct NotifyCall {
  Buffer& buffer;
  const DispatchInput& in;
  const StreamOrder& order;
  DispatchOverlap overlap;
  const DispatchOutputGuess* guess;
  NormalShape shape;
  int num_local_experts;
  kernels::HostCountIndex count_index;
  NormalHostScratch& scratch;
  std::shared_ptr<DispatchHandle::State> state;
  // The receive goes out with the notify (DispatchOverlap::kLaunchReceive, one node, counts awaited).
  bool launches_receive = false;
  int guess_rows = 0;     // > 0: the rows the guess's outputs hold, which a launched receive may write
  uint32_t sequence = 0;  // the notify's; none for a cached handle (no notify runs)
};

// The records' shape of a dispatch of `in`, checked.
NormalShape notify_shape(const DispatchInput& in, int num_ranks) {
  const int row_bytes = static_cast<int>(row_format(scale_format_of(in.format)).row_bytes(in.hidden));
  const NormalShape shape{num_ranks, in.num_experts, in.hidden, row_bytes, scale_words_of(in), in.num_topk};
  validate_normal_shape(shape);
  return shape;
}

// The handle state this call fills: a copy of the cached handle's (`cached`, when valid; it shares the device
// arrays and keeps the counts and channels) or a fresh one. Either way it takes this call's shape and format
// and nothing of an earlier call's receive or board.
std::shared_ptr<DispatchHandle::State> notify_handle_state(const Buffer& buffer, const DispatchInput& in,
                                                           const NormalShape& shape,
                                                           const DispatchHandle* cached) {
  std::shared_ptr<DispatchHandle::State> state;
  if (cached != nullptr) {
    const auto& old = cached->state();
    EPX_CHECK(old.num_tokens == in.num_tokens, "num_tokens", in.num_tokens,
              "must equal the cached handle's token count");
    EPX_CHECK(old.shape.num_ranks == buffer.num_ranks(), "handle", "from another buffer",
              "must come from this buffer");
    state = std::make_shared<DispatchHandle::State>(old);  // shares the device arrays
    state->cached = true;
  } else {
    state = std::make_shared<DispatchHandle::State>();
    state->num_channels = buffer.config().num_channels();
    state->num_tokens = in.num_tokens;
    state->num_worst_tokens = in.num_worst_tokens;
    state->expert_alignment = in.expert_alignment;
    state->num_nodes = buffer.num_ranks() / buffer.ranks_per_node();
  }
  state->shape = shape;
  state->launched_receive = 0;
  state->guessed_outputs.reset();
  state->board = {};
  state->exchange.reset();
  // The queues this dispatch needs must fit before anything is launched.
  if (state->num_nodes > 1) {
    internode_buffer_maps(buffer, *state, InternodeRecord::dispatch(shape));
  } else {
    check_normal_map_fits(dispatch_buffer_map(buffer, *state), buffer.num_nvl_queue_bytes());
  }
  state->format = scale_format_of(in.format);
  // A cached re-dispatch without top-k keeps the handle's top-k, so its combine can still reduce weights.
  if (cached == nullptr || in.num_topk > 0) state->num_topk = shape.num_topk;
  return state;
}

// Everything a call decides before it touches the device: its shape, its handle state, whether its receive
// goes out with the notify and how many rows the guess holds (all checked). `cached`: a valid handle or null.
NotifyCall notify_call(Buffer& buffer, const DispatchInput& in, const StreamOrder& order,
                       const DispatchHandle* cached, DispatchOverlap overlap,
                       const DispatchOutputGuess* guess) {
  const int num_ranks = buffer.num_ranks();
  const NormalShape shape = notify_shape(in, num_ranks);
  const int num_local_experts = in.num_experts / num_ranks;
  const kernels::HostCountIndex count_index{num_ranks, num_local_experts};
  EPX_CHECK(count_index.num_words(true) <= NormalHostScratch::kMaxCountWords, "num_experts", in.num_experts,
            detail::concat("must leave at most ", NormalHostScratch::kMaxCountWords - 3 - num_ranks,
                           " local experts per rank (the host-mapped counts)")
                .c_str());
  NotifyCall call{buffer,
                  in,
                  order,
                  overlap,
                  guess,
                  shape,
                  num_local_experts,
                  count_index,
                  normal_host_scratch(buffer),
                  notify_handle_state(buffer, in, shape, cached)};
  const DispatchHandle::State& state = *call.state;
  call.launches_receive = cached == nullptr && state.num_worst_tokens == 0 &&
                          overlap == DispatchOverlap::kLaunchReceive && state.num_nodes == 1 &&
                          launch_receive_allowed();
  call.guess_rows = call.launches_receive && guess != nullptr ? std::max(guess->rows, 0) : 0;
  if (call.guess_rows > 0) check_outputs(guess->outputs, state, call.guess_rows, "the guess's rows");
  return call;
}

// The single-node count exchange, run by a notify kernel or inside the receive's launch. `host`: where it
// publishes the counts for the host (words null: nobody waits for them).
kernels::NotifyArgs exchange_args(const NotifyCall& call, const kernels::HostCounts& host) {
  const DispatchInput& in = call.in;
  const DispatchHandle::State& state = *call.state;
  return kernels::NotifyArgs{peer_context(call.buffer),
                             call.sequence,
                             state.num_channels,
                             reinterpret_cast<const uint8_t*>(in.is_token_in_rank),
                             in.num_tokens_per_expert,
                             in.num_tokens_per_rank,
                             in.num_tokens,
                             in.num_experts,
                             state.expert_alignment,
                             state.num_worst_tokens,
                             state.arrays,
                             host,
                             device_address(call.buffer, &call.scratch.invalid_id),
                             normal_shape_fingerprint(call.shape, queue_config(call.buffer, state), false,
                                                      in.num_tokens_per_rank != nullptr)};
}

// ---- Counts off the layout board ----

// Whether the call's guess lies in the output window whole (a Buffer with one; its offsets then go into
// args.window_outputs): the launched receive may take the rows straight into it. Otherwise it receives
// through its queues.
bool place_guess_in_window(const NotifyCall& call, kernels::DispatchArgs& args) {
  if (!args.window_posts || call.guess_rows <= 0) return false;
  const auto window =
      window_placement(call.buffer, *call.state, args.map, call.guess->outputs, call.guess_rows, false);
  if (window) std::copy(window->begin(), window->end(), args.window_outputs);
  return window.has_value();
}

// The guess's outputs are the outputs: the receive goes out now, running the count exchange `exchange` too,
// and needs nothing more from the host.
void launch_receive_into_guess(NotifyCall& call, const kernels::NotifyArgs& exchange) {
  DispatchHandle::State& state = *call.state;
  {
    const HostStep order("dispatch_notify: board: order streams");
    begin_on_comm_stream(call.buffer, call.order);
  }
  const HostStep launch("dispatch_notify: board: launch receive");
  kernels::DispatchArgs args = dispatch_args(call.buffer, state, call.in, call.guess->outputs);
  exchange_in_launch(args, exchange);
  // The host has the counts: a guess in the output window that holds the rows takes them straight in.
  args.to_window = place_guess_in_window(call, args);
  kernels::launch_dispatch(args, call.buffer.comm_stream());
  call.scratch.pending_receive = call.sequence;  // dispatch_receive completes the call
  state.launched_receive = call.sequence;
  state.guessed_outputs = call.guess->outputs;
}

// The plan of a notify whose host read `counts` off the board before any launch. The count exchange still
// runs, inside the receive's launch (which checks the rows from each source against the board's before it
// writes any): now, into a guess the rows fit, else in dispatch_receive; or now in a notify kernel when the
// caller reads the handle before the receive.
DispatchPlan plan_from_board_counts(NotifyCall& call, const std::vector<int>& counts, bool with_experts) {
  DispatchHandle::State& state = *call.state;
  const kernels::HostCountIndex& index = call.count_index;
  check_no_invalid_id(counts, index);
  take_counts(state, counts, index, with_experts);
  call.scratch.last_recv_rows = state.num_recv_rows;
  {
    // Nothing runs before dispatch_receive, which orders the comm stream; the rows come with the routing.
    const HostStep allocate("dispatch_notify: board: allocate routing");
    state.allocate_routing(call.buffer, call.num_local_experts, std::max(state.num_recv_rows, 1));
  }
  // The receive's launch checks the rows from each source against these before it writes.
  state.board.active = true;
  for (int src = 0; src < index.num_ranks; ++src) state.board.rows_from[src] = counts[index.rows_from(src)];
  // The exchange publishes nothing for the host, which has its counts.
  const kernels::NotifyArgs exchange = exchange_args(call, {nullptr, call.sequence});
  const bool rows_in_guess =
      call.launches_receive && call.guess_rows > 0 && state.num_recv_rows <= call.guess_rows;
  if (rows_in_guess) {
    launch_receive_into_guess(call, exchange);
  } else if (call.overlap == DispatchOverlap::kHandleBeforeReceive) {
    // The caller reads the handle before the receive: the exchange runs now, in a notify kernel.
    begin_on_comm_stream(call.buffer, call.order);
    kernels::launch_dispatch_notify(exchange, call.buffer.comm_stream());
  } else {
    state.exchange = exchange;
  }
  DispatchPlan plan = plan_of(std::move(call.state));
  plan.rows_in_guess = rows_in_guess;
  plan.counts_from_layout = true;
  return plan;
}

// The layout board (one node): this rank's dispatch sends what its layout posted for this notify when it
// passes that layout's outputs. Its mark says whether it does, so a peer reads this rank's counts off the
// board only then, and otherwise takes the count exchange's. Then, once every peer's layout posted and its
// mark says its counts hold, the host has its counts off the board: the plan. Nothing (and nothing launched)
// when the count exchange must bring the host its counts instead.
std::optional<DispatchPlan> notify_from_layout_board(NotifyCall& call) {
  const DispatchInput& in = call.in;
  const DispatchHandle::State& state = *call.state;
  const BufferAccess::LayoutBoard board = BufferAccess::layout_board(call.buffer);
  const bool one_node_board = board.host != nullptr && state.num_nodes == 1;
  const bool posted_counts_hold =
      one_node_board && layout_post_matches(call.scratch.layout_post, in, call.sequence);
  if (one_node_board) mark_posted_counts(board, call.buffer.rank(), call.sequence, posted_counts_hold);
  const bool host_waits = state.num_worst_tokens == 0;
  if (!posted_counts_hold || !host_waits) return std::nullopt;
  const size_t half = board.map.row(call.buffer.rank(), call.sequence);
  const bool with_experts = in.num_tokens_per_expert != nullptr;
  const BoardCounts board_counts{board.host + half, board.map, call.num_local_experts, state.expert_alignment,
                                 with_experts};
  std::vector<int> counts(call.count_index.num_words(false));
  {
    const HostStep wait("dispatch_notify: board: wait");
    if (!wait_for_board(call.buffer, board_counts, call.sequence, call.count_index, counts))
      return std::nullopt;
  }
  return plan_from_board_counts(call, counts, with_experts);
}

// ---- Counts from the count exchange ----

// Across nodes: the count exchange over the network and NVLink, in its own kernel (no board, no launched
// receive there).
void launch_notify_across_nodes(const NotifyCall& call, const kernels::HostCounts& host) {
  const DispatchInput& in = call.in;
  const DispatchHandle::State& state = *call.state;
  const kernels::InternodeNotifyArgs args{
      internode_context(call.buffer),
      state.num_channels,
      reinterpret_cast<const uint8_t*>(in.is_token_in_rank),
      in.num_tokens_per_expert,
      in.num_tokens,
      in.num_experts,
      state.expert_alignment,
      state.arrays,
      host,
      device_address(call.buffer, &call.scratch.invalid_id),
      normal_shape_fingerprint(call.shape, queue_config(call.buffer, state), true),
      phase_reports(call.buffer)};
  kernels::launch_internode_notify(args, call.buffer.comm_stream());
}

// The receive goes out before the host waits: senders fill the peers' queues while the counts travel to the
// host, and the receivers write into the guess's outputs when the rows fit, else wait for the outputs
// dispatch_receive publishes. `notify_in_receive`: the launch runs the count exchange too.
void launch_receive_before_counts(NotifyCall& call, const kernels::HostCounts& host, bool notify_in_receive) {
  DispatchHandle::State& state = *call.state;
  kernels::DispatchArgs args = dispatch_args(call.buffer, state, call.in,
                                             call.guess_rows > 0 ? call.guess->outputs : DispatchOutput{});
  args.published = device_address(call.buffer, &call.scratch.outputs);
  args.published_sequence = call.scratch.notify_sequence;
  args.guess_rows = call.guess_rows;
  if (notify_in_receive) exchange_in_launch(args, exchange_args(call, host));
  // A guess in the output window: the receivers take the rows straight into it when they fit it, which the
  // launch learns from the counts (DispatchArgs::window_guess); otherwise through the queues.
  args.window_guess = place_guess_in_window(call, args);
  kernels::launch_dispatch(args, call.buffer.comm_stream());
  call.scratch.pending_receive = call.scratch.notify_sequence;
  state.launched_receive = call.scratch.notify_sequence;
}

// The host waits for the counts the exchange publishes and sizes the rows by them. recv_src_idx for a guess
// came with the routing arrays; one allocated after a launched receive goes through a private stream (see
// allocate_on_stream).
DispatchPlan plan_after_host_wait(NotifyCall& call) {
  Buffer& buffer = call.buffer;
  DispatchHandle::State& state = *call.state;
  const bool rows_before_counts = state.num_nodes == 1;
  // The host waits for the counts next, so it allocates the rows meanwhile (one node: nothing else there
  // depends on the counts), for as many as the last notify received with room to grow, and again after the
  // wait only if that was too small.
  const cudaStream_t rows_stream =
      state.launched_receive != 0 ? BufferAccess::private_stream(buffer) : nullptr;
  if (rows_before_counts && call.guess_rows == 0) {
    const HostStep allocate("dispatch_notify: allocate rows");
    const int rows_guess = call.scratch.last_recv_rows + call.scratch.last_recv_rows / 4 + 64;
    state.allocate_rows(buffer, rows_guess, rows_stream);
  }
  // The one CPU synchronisation of normal mode: the host needs the row count to size the outputs.
  std::vector<int> counts;
  try {
    const HostStep wait("dispatch_notify: wait for counts");
    counts = wait_for_counts(buffer, buffer.comm_stream(), call.sequence,
                             call.count_index.num_words(state.num_nodes > 1));
  } catch (...) {
    cancel_receive(buffer, state.launched_receive);
    throw;
  }
  take_counts(state, counts, call.count_index, call.in.num_tokens_per_expert != nullptr);
  call.scratch.last_recv_rows = state.num_recv_rows;
  const bool rows_in_guess = call.guess_rows > 0 && state.num_recv_rows <= call.guess_rows;
  if (rows_in_guess) {
    // The launched receive writes there already and waits for nothing: dispatch_receive only completes.
    state.guessed_outputs = call.guess->outputs;
  } else if (!rows_before_counts || state.num_recv_rows > state.rows_capacity) {
    state.allocate_rows(buffer, state.num_recv_rows, rows_stream);
  }
  if (counts[call.count_index.invalid_id()] != 0) cancel_receive(buffer, state.launched_receive);
  check_no_invalid_id(counts, call.count_index);
  DispatchPlan plan = plan_of(std::move(call.state));
  plan.rows_in_guess = rows_in_guess;
  return plan;
}

// The count exchange runs on the device (a notify kernel, or inside the receive's launch) and publishes the
// counts to the host, which waits for them; in worst-case mode (num_worst_tokens) nobody waits.
DispatchPlan notify_with_count_exchange(NotifyCall& call) {
  DispatchHandle::State& state = *call.state;
  const bool host_waits = state.num_worst_tokens == 0;
  if (!host_waits && state.num_nodes == 1 && call.in.num_tokens_per_rank != nullptr &&
      call.overlap != DispatchOverlap::kHandleBeforeReceive) {
    // Worst-case mode with the layout's per-rank totals (which the exchange inside a launch checks the
    // channels against): nobody waits for the counts, so the exchange runs inside the receive's launch in
    // dispatch_receive, as after counts read off the layout board. One launch and one ordering of the streams
    // instead of two; recv_src_idx comes with the routing arrays.
    const HostStep allocate("dispatch_notify: allocate routing");
    state.num_recv_rows = state.num_worst_tokens;
    state.allocate_routing(call.buffer, call.num_local_experts, state.num_worst_tokens);
    state.exchange = exchange_args(call, {nullptr, call.sequence});
    return plan_of(std::move(call.state));
  }
  {
    const HostStep order("dispatch_notify: order streams");
    begin_on_comm_stream(call.buffer, call.order);
  }
  // With a guess, recv_src_idx for its rows comes in the same allocation: one pool call less before the
  // receive's launch.
  {
    const HostStep allocate("dispatch_notify: allocate routing");
    state.allocate_routing(call.buffer, call.num_local_experts, call.guess_rows);
  }
  const kernels::HostCounts host{host_waits ? device_address(call.buffer, call.scratch.counts) : nullptr,
                                 call.sequence};
  // One launch for the count exchange and the receive: the host's counts come one launch after the call.
  const bool notify_in_receive = call.guess_rows > 0 && call.in.num_tokens_per_rank != nullptr;
  {
    const HostStep launch("dispatch_notify: launch exchange");
    if (state.num_nodes > 1) {
      launch_notify_across_nodes(call, host);
    } else if (!notify_in_receive) {
      // With a guess and the per-rank totals the receive launched below runs the exchange itself.
      kernels::launch_dispatch_notify(exchange_args(call, host), call.buffer.comm_stream());
    }
  }
  if (!host_waits) {
    // Worst-case mode: the outputs hold num_worst_tokens rows whatever arrives.
    const HostStep allocate("dispatch_notify: allocate rows");
    state.num_recv_rows = state.num_worst_tokens;
    state.allocate_rows(call.buffer, state.num_recv_rows);
    return plan_of(std::move(call.state));
  }
  if (call.launches_receive) {
    const HostStep launch("dispatch_notify: launch receive");
    launch_receive_before_counts(call, host, notify_in_receive);
  }
  return plan_after_host_wait(call);
}

}  // namespace

// The paths of a notify: a cached handle (counts known, nothing runs); counts off the layout board (one node,
// the inputs are the last layout's outputs); else the count exchange, with or without the receive launched
// beside it, or across nodes.
DispatchPlan dispatch_notify(Buffer& buffer, const DispatchInput& in, const StreamOrder& order,
                             const DispatchHandle* cached, DispatchOverlap overlap,
                             const DispatchOutputGuess* guess) {
  const HostStep step("dispatch_notify");
  const ExclusiveUse::Claim claim = BufferAccess::enter_call(buffer, "dispatch_notify");
  const bool is_cached = cached != nullptr && cached->valid();
  {
    const HostStep validate("dispatch_notify: validate");
    validate_dispatch_input(buffer, in, is_cached);
  }
  NotifyCall call = [&] {
    const HostStep plan("dispatch_notify: notify_call");
    return notify_call(buffer, in, order, is_cached ? cached : nullptr, overlap, guess);
  }();
  // A receive an earlier notify launched and nobody received: let it drain, writing nothing.
  cancel_receive(buffer, call.scratch.pending_receive);
  // A cached dispatch has its counts: nothing runs before dispatch_receive, which orders the comm stream.
  if (is_cached) return plan_of(std::move(call.state));
  // Every rank makes the same notifies, so every rank gives this one the same sequence.
  call.scratch.notify_sequence = next_sequence(call.scratch.notify_sequence);
  call.sequence = call.scratch.notify_sequence;
  {
    const HostStep board("dispatch_notify: layout board");
    if (std::optional<DispatchPlan> plan = notify_from_layout_board(call)) return std::move(*plan);
  }
  return notify_with_count_exchange(call);
}

// No enter_call: it runs on error paths (an aborted Buffer, a failed allocation) and must not raise there.
void dispatch_cancel(Buffer& buffer, const DispatchPlan& plan) {
  if (plan.handle.valid()) cancel_receive(buffer, plan.handle.state().launched_receive);
}

bool phase_reports_requested() {
  static const bool requested = env_equals("EPX_NORMAL_PHASES", "1");
  return requested;
}

std::array<kernels::PhaseReport, kernels::kPhaseStreams> take_phase_reports(const Buffer& buffer) {
  NormalHostScratch& scratch = normal_host_scratch(buffer);
  std::array<kernels::PhaseReport, kernels::kPhaseStreams> reports{};
  std::atomic_thread_fence(std::memory_order_acquire);
  for (int s = 0; s < kernels::kPhaseStreams; ++s) {
    reports[s] = const_cast<const kernels::PhaseReport&>(scratch.phases[s]);
    scratch.phases[s] = {};
  }
  return reports;
}

uint64_t dispatch_count_wait_ns(const Buffer& buffer) {
  return normal_host_scratch(buffer).count_wait_ns;
}

Event dispatch_receive(Buffer& buffer, const DispatchPlan& plan, const DispatchInput& in,
                       const DispatchOutput& out, const StreamOrder& order) {
  const HostStep step("dispatch_receive");
  const ExclusiveUse::Claim claim = BufferAccess::enter_call(buffer, "dispatch_receive");
  const auto& state = plan.handle.state();
  const int rows = state.num_recv_rows;
  const uint32_t launched = state.launched_receive;
  std::optional<WindowOffsets> window;
  // A receive dispatch_notify launched waits for these outputs: a rejected call lets it drain instead.
  try {
    EPX_CHECK(
        launched == 0 || normal_host_scratch(buffer).pending_receive == launched, "plan", "already received",
        "its receive was launched by dispatch_notify and must be received once, before the next notify");
    EPX_CHECK(in.num_tokens == state.num_tokens, "num_tokens", in.num_tokens,
              "must equal the num_tokens given to dispatch_notify (pass the same input)");
    EPX_CHECK(scale_format_of(in.format) == state.format, "format",
              scale_format_name(scale_format_of(in.format)),
              "must equal the format given to dispatch_notify (pass the same input)");
    EPX_CHECK(in.hidden == state.shape.hidden, "hidden", in.hidden,
              "must equal the hidden size given to dispatch_notify (pass the same input)");
    EPX_CHECK(scale_words_of(in) == state.shape.num_scales, "num_scales", in.num_scales,
              "must equal the num_scales given to dispatch_notify (pass the same input)");
    if (state.guessed_outputs) {
      EPX_CHECK(
          same_outputs(out, *state.guessed_outputs), "out", "other outputs",
          "must be the guess's outputs: the launched receive wrote the rows there (plan.rows_in_guess)");
    }
    check_outputs(out, state, rows, "the plan's num_recv_rows rows");
    // A launched receive chose its way at launch (or on the device, for a guess in the window).
    if (launched == 0) window = window_placement(buffer, state, dispatch_buffer_map(buffer, state), out);
  } catch (...) {
    cancel_receive(buffer, launched);
    throw;
  }
  if (launched != 0) {
    if (state.guessed_outputs) {
      normal_host_scratch(buffer).pending_receive = 0;  // received: it needs nothing more
    } else {
      publish_outputs(buffer, launched, out, state.arrays.recv_src_idx, rows, false);
    }
    return end_on_comm_stream(buffer, order);
  }
  // Work the caller queued between notify and receive (e.g. allocating or clearing the outputs) comes first.
  begin_on_comm_stream(buffer, order);
  if (state.num_nodes > 1) {
    const InternodeRecord record = InternodeRecord::dispatch(state.shape);
    const InternodeBufferMaps maps = internode_buffer_maps(buffer, state, record);
    const Config& config = buffer.config();
    const kernels::InternodeDispatchArgs args{
        internode_context(buffer),
        maps.rdma,
        maps.nvl,
        record,
        state.num_tokens,
        state.shape.num_experts,
        config.num_max_rdma_chunked_send_tokens,
        config.num_max_nvl_chunked_send_tokens,
        state.arrays.is_token_in_rank,
        in,
        state.arrays,
        out,
        normal_launch_fingerprint(maps.rdma.num_channels, maps.nvl.queue_tokens, maps.rdma.queue_tokens,
                                  record.normal, state.shape.hidden, state.shape.num_experts,
                                  NormalOperation::kDispatch, state.format != ScaleFormat::kBf16),
        phase_reports(buffer)};
    kernels::launch_internode_dispatch(args, buffer.comm_stream());
    return end_on_comm_stream(buffer, order);
  }
  kernels::DispatchArgs args = dispatch_args(buffer, state, in, out);
  // The count exchange of a notify that read its counts off the layout board runs here.
  if (state.exchange) exchange_in_launch(args, *state.exchange);
  if (window) {
    args.to_window = true;
    std::copy(window->begin(), window->end(), args.window_outputs);
  }
  kernels::launch_dispatch(args, buffer.comm_stream());
  return end_on_comm_stream(buffer, order);
}

Event combine(Buffer& buffer, const DispatchHandle& handle, const CombineInput& in, const CombineOutput& out,
              const StreamOrder& order) {
  const ExclusiveUse::Claim claim = BufferAccess::enter_call(buffer, "combine");
  EPX_CHECK(handle.valid(), "handle", "empty", "must come from dispatch_notify");
  const auto& state = handle.state();
  EPX_CHECK(state.shape.num_ranks == buffer.num_ranks(), "handle", "from another buffer",
            "must come from this buffer");
  EPX_CHECK(state.num_recv_rows == 0 || in.x != nullptr, "x", "null",
            "must point to [num_recv_rows, hidden] BF16");
  EPX_CHECK(state.num_tokens == 0 || out.combined_x != nullptr, "combined_x", "null",
            "must point to [num_tokens, hidden] BF16");
  check_row_alignment(in.x, "x");
  check_row_alignment(in.bias0, "bias0");
  check_row_alignment(in.bias1, "bias1");
  check_row_alignment(out.combined_x, "combined_x");
  // As in dispatch, num_topk > 0 means "with weights" on every rank, whatever the addresses of empty tensors.
  EPX_CHECK(in.num_topk == 0 || in.num_topk == state.num_topk, "num_topk", in.num_topk,
            "must be 0 or the dispatch's top-k");
  EPX_CHECK(in.topk_weights == nullptr || in.num_topk > 0, "num_topk", in.num_topk,
            "must be the dispatch's top-k when topk_weights are given");
  EPX_CHECK(in.num_topk == 0 || in.topk_weights != nullptr || state.num_recv_rows == 0, "topk_weights",
            "null", "must point to [num_recv_rows, num_topk] weights when num_topk > 0");
  EPX_CHECK(out.combined_topk_weights == nullptr || in.num_topk > 0, "topk_weights", "null",
            "are needed to produce combined_topk_weights");
  // The handle fixes which rows go where, not their width: x may be narrower or wider than the dispatch's
  // tokens, and the combine's queue records are sized for it (checked against the buffer just below).
  EPX_CHECK(in.hidden >= 0, "hidden", in.hidden, "must be >= 0 (0: the dispatch's hidden)");
  const int hidden = in.hidden > 0 ? in.hidden : state.shape.hidden;
  EPX_CHECK(hidden % 8 == 0, "hidden", hidden, "must be a multiple of 8 (16-byte BF16 rows)");
  if (state.num_nodes > 1) {
    const InternodeRecord record = InternodeRecord::combine(hidden, in.num_topk);
    const InternodeBufferMaps maps = internode_buffer_maps(buffer, state, record);
    begin_on_comm_stream(buffer, order);
    const Config& config = buffer.config();
    const kernels::InternodeCombineArgs args{
        internode_context(buffer),
        maps.rdma,
        maps.nvl,
        record,
        state.num_tokens,
        config.num_max_rdma_chunked_send_tokens,
        config.num_max_nvl_chunked_send_tokens,
        state.arrays,
        in,
        out,
        normal_launch_fingerprint(maps.rdma.num_channels, maps.nvl.queue_tokens, maps.rdma.queue_tokens,
                                  record.normal, hidden, state.shape.num_experts, NormalOperation::kCombine,
                                  false),
        phase_reports(buffer)};
    kernels::launch_internode_combine(args, buffer.comm_stream());
    return end_on_comm_stream(buffer, order);
  }
  const NormalRecord record = NormalRecord::combine(hidden, in.num_topk);
  const NormalBufferMap map = NormalBufferMap::of(buffer.num_ranks(), queue_config(buffer, state), record);
  check_normal_map_fits(map, buffer.num_nvl_queue_bytes());
  begin_on_comm_stream(buffer, order);
  const int reduce_warps =
      kernels::combine_sender_roles(kernels::kQueueWarps, buffer.num_ranks(), combine_sender_reduce_warps())
          .reduce;
  const CombineStagingMap staging = combine_staging_map(buffer, state, hidden, in.num_topk);
  ShapeFingerprint shape = normal_launch_fingerprint(map, record, hidden, state.shape.num_experts,
                                                     NormalOperation::kCombine, false, reduce_warps);
  shape.values[static_cast<int>(ShapeField::kNetworkQueueTokens)] = staging.slot_rows();
  shape = make_shape_fingerprint(shape.values);
  kernels::CombineArgs args{peer_context(buffer),
                            map,
                            record,
                            state.num_tokens,
                            buffer.combine_send_chunk(),
                            state.arrays,
                            in,
                            out,
                            shape,
                            phase_reports(buffer)};
  args.sender_reduce_warps = reduce_warps;
  args.publisher_warp = combine_publisher_warp(buffer.num_ranks());
  args.staging = staging;
  const bool copies = start_staged_copies(buffer, args.peers, state, in, staging);
  kernels::launch_combine(args, buffer.comm_stream());
  if (copies) join_staged_copies(buffer);
  return end_on_comm_stream(buffer, order);
}

}  // namespace epx
