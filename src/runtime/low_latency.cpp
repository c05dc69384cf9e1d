#include "epx/low_latency.hpp"

#include <cstdint>

#include "epx/error.hpp"
#include "formats/scale_format.hpp"
#include "gpu/cuda_check.hpp"
#include "kernels/low_latency_kernels.hpp"
#include "kernels/work_split.hpp"
#include "runtime/buffer_access.hpp"
#include "runtime/low_latency_state.hpp"
#include "runtime/stream_order.hpp"

namespace epx {

namespace {

bool aligned16(const void* pointer) {
  return reinterpret_cast<uintptr_t>(pointer) % 16 == 0;
}

LowLatencyBufferMap map_for(const Buffer& buffer, int num_max_tokens, int hidden, int num_experts) {
  EPX_CHECK(buffer.num_rdma_bytes() > 0, "num_rdma_bytes", buffer.num_rdma_bytes(),
            "must be > 0 for low-latency mode (size it with get_low_latency_rdma_size_hint)");
  const LowLatencyBufferMap map(num_max_tokens, hidden, buffer.num_ranks(), num_experts);
  EPX_CHECK(map.total_bytes() <= buffer.num_rdma_bytes(), "num_rdma_bytes", buffer.num_rdma_bytes(),
            detail::concat("must be >= ", map.total_bytes(), " for M = ", num_max_tokens,
                           ", hidden = ", hidden, ", E = ", num_experts, " (get_low_latency_rdma_size_hint)")
                .c_str());
  return map;
}

kernels::PeerContext peer_context(const Buffer& buffer) {
  return kernels::PeerContext{BufferAccess::symmetric_peer_bases_device(buffer),
                              buffer.symmetric_buffer(),
                              buffer.rank(),
                              buffer.num_ranks(),
                              BufferAccess::failure_record_device(buffer),
                              buffer.wait_timeout_ns(),
                              BufferAccess::abort_words(buffer)};
}

// Where the kernels stamp their phases: null unless EPX_LL_PHASE_STAMPS=1 (and the grid fits the memory).
uint64_t* phase_stamps(const Buffer& buffer) {
  uint64_t* stamps = BufferAccess::low_latency_state(buffer)->phase_stamps.get();
  return buffer.num_device_sms() <= kernels::kMaxPhaseStampBlocks ? stamps : nullptr;
}

kernels::LowLatencyMaskArgs mask_args(const Buffer& buffer) {
  kernels::LowLatencyMaskArgs mask;
  mask.masked = BufferAccess::rank_mask_words(buffer);
  mask.masked_by_timeout = mask.masked + 1;
  mask.shrink = buffer.enable_shrink();
  return mask;
}

// Runs one mask kernel on the comm stream, ordered like the other calls.
void run_mask_op(Buffer& buffer, const kernels::LowLatencyMaskUpdateArgs& args, const StreamOrder& order) {
  begin_on_comm_stream(buffer, order);
  kernels::launch_low_latency_mask_update(args, buffer.comm_stream());
  end_on_comm_stream(buffer, order);
}

// What every rank's low-latency call must agree on (checked by every receiver against each NVLink source):
// the map's shape and the wire format. `format`: a dispatch's ScaleFormat value (+16 with listings); a
// combine's LogFMT (8), pre-reduced (32) and LogFMT-within-node (64) bits.
ShapeFingerprint low_latency_shape_fingerprint(const LowLatencyBufferMap& map, int format) {
  int32_t values[kNumShapeFields] = {};
  values[static_cast<int>(ShapeField::kHidden)] = map.hidden;
  values[static_cast<int>(ShapeField::kNumExperts)] = map.num_experts;
  values[static_cast<int>(ShapeField::kMaxTokens)] = map.num_max_tokens;
  values[static_cast<int>(ShapeField::kFormat)] = format;
  return make_shape_fingerprint(values);
}

void check_tokens(int num_tokens, int num_topk, const LowLatencyBufferMap& map, const int64_t* topk_idx) {
  EPX_CHECK(num_tokens >= 0, "num_tokens", num_tokens, "must be >= 0");
  EPX_CHECK(num_tokens <= map.num_max_tokens, "num_tokens", num_tokens,
            "must be <= num_max_dispatch_tokens_per_rank");
  EPX_CHECK(num_topk >= 1, "num_topk", num_topk, "must be >= 1");
  EPX_CHECK(num_topk <= kMaxTopk, "num_topk", num_topk, "must be <= 16 (top-k > 16 is unsupported)");
  EPX_CHECK(num_tokens == 0 || topk_idx != nullptr, "topk_idx", "null",
            "must point to [num_tokens, num_topk] ids");
}

void validate_dispatch(const Buffer& buffer, const LowLatencyDispatchInput& in,
                       const LowLatencyDispatchOutput& out, const LowLatencyBufferMap& map,
                       const LowLatencyState& state, const StreamOrder& order) {
  check_tokens(in.num_tokens, in.num_topk, map, in.topk_idx);
  EPX_CHECK(in.num_tokens == 0 || in.x != nullptr, "x", "null",
            "must point to [num_tokens, hidden] BF16 tokens");
  EPX_CHECK(aligned16(in.x), "x", in.x, "must be 16-byte aligned");
  const RowFormat format = row_format(low_latency_scale_format(in));
  EPX_CHECK(!(in.return_recv_hook && order.async_finish), "async_finish", order.async_finish,
            "must be false with return_recv_hook (the hook orders the receive)");
  EPX_CHECK(out.recv_x != nullptr, "recv_x", "null", "must point to [L, R*M, hidden] rows");
  EPX_CHECK(aligned16(out.recv_x), "recv_x", out.recv_x, "must be 16-byte aligned");
  EPX_CHECK(!format.has_scales() || out.recv_x_scales != nullptr, "recv_x_scales", "null",
            "are required with use_fp8");
  EPX_CHECK(out.recv_count != nullptr, "recv_count", "null", "must point to [L] ints");
  EPX_CHECK(out.recv_src_info != nullptr, "recv_src_info", "null", "must point to [L, R*M] ints");
  EPX_CHECK(out.recv_topk_pos != nullptr, "recv_topk_pos", "null", "must point to [L, R*M] ints");
  EPX_CHECK(out.recv_layout_range != nullptr, "recv_layout_range", "null", "must point to [L, R] ranges");
  // With listings every rank's messages carry weights, so the choice can not depend on this rank's tokens
  // (a rank with none may pass no weights).
  EPX_CHECK(in.topk_weights == nullptr || out.recv_token_listings != nullptr, "recv_token_listings", "null",
            "must point to [R, M, K] listings when topk_weights is given");
  EPX_CHECK(in.num_tokens == 0 || out.recv_token_listings == nullptr || in.topk_weights != nullptr,
            "topk_weights", "null",
            "must point to [num_tokens, num_topk] weights when recv_token_listings is given");
  const size_t smem_bytes = kernels::low_latency_dispatch_smem_bytes(map);
  EPX_CHECK(smem_bytes <= static_cast<size_t>(state.max_smem_bytes), "num_experts", map.num_experts,
            detail::concat("needs ", smem_bytes, " bytes of shared memory for routing, more than the GPU's ",
                           state.max_smem_bytes, " (unsupported)")
                .c_str());
}

// Runs `launch` for a call: with a hook on the caller's stream (send now, receive in the hook); else both
// phases, on the caller's stream when the comm stream has nothing it must wait for and no event is wanted,
// else on the comm stream ordered against the caller's stream.
template <typename Args, typename Launch>
std::pair<Event, LowLatencyRecvHook> issue(Buffer& buffer, Args args, bool return_recv_hook,
                                           const StreamOrder& order, Launch launch) {
  const std::shared_ptr<LowLatencyState> state = BufferAccess::low_latency_state(buffer);
  const uint64_t call = state->num_calls;
  args.half = static_cast<int>(call & 1);
  check_low_latency_signals_clean(*state);
  check_low_latency_half_free(*state, args.half);
  args.num_blocks = buffer.num_device_sms();
  EPX_CHECK(args.num_blocks < kernels::kLowLatencyPublishUnit, "num_device_sms", args.num_blocks,
            "must be below 4096 for the low-latency kernels (each block adds a share to the flags)");
  if (return_recv_hook) {
    if (order.previous_event != nullptr)
      EPX_CUDA_CHECK(cudaStreamWaitEvent(order.compute_stream, order.previous_event, 0));
    args.phases = kernels::kLowLatencySend;
    launch(args, order.compute_stream);
    state->num_calls += 1;
    Args receive = args;
    receive.phases = kernels::kLowLatencyRecv;
    return {Event{}, make_low_latency_hook(state, call, args.half, [receive, launch](cudaStream_t stream) {
              launch(receive, stream);
            })};
  }
  args.phases = kernels::kLowLatencyBoth;
  if (!order.async_finish && order.previous_event == nullptr &&
      state->joined_stream == order.compute_stream) {
    // Every earlier call is ordered before this stream's next work, and the caller waits on this stream
    // anyway: the comm stream would only add two cross-stream hops.
    launch(args, order.compute_stream);
    // Recorded now, not when a later call needs it: the caller may destroy this stream first. Not when the
    // stream is the comm stream (its own later work is ordered anyway), nor while it is captured: the launch
    // is then a graph's, ordered by whoever launches the graph, and a wait for an event recorded in a capture
    // would pull the comm stream into that capture (or fail once it ended).
    const bool other_stream = order.compute_stream != buffer.comm_stream();
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (other_stream) EPX_CUDA_CHECK(cudaStreamIsCapturing(order.compute_stream, &capture));
    if (other_stream && capture == cudaStreamCaptureStatusNone) {
      EPX_CUDA_CHECK(cudaEventRecord(BufferAccess::ordering_event(buffer, 2), order.compute_stream));
      state->launched_on_joined = true;
    }
    state->num_calls += 1;
    return {Event{}, LowLatencyRecvHook{}};
  }
  begin_on_comm_stream(buffer, order);
  launch(args, buffer.comm_stream());
  state->num_calls += 1;
  return {end_on_comm_stream(buffer, order), LowLatencyRecvHook{}};
}

}  // namespace

LowLatencyDispatchSizes low_latency_dispatch_sizes(const Buffer& buffer, const LowLatencyDispatchInput& in) {
  const LowLatencyBufferMap map(in.num_max_dispatch_tokens_per_rank, in.hidden, buffer.num_ranks(),
                                in.num_experts);
  LowLatencyDispatchSizes sizes;
  sizes.num_local_experts = map.num_local_experts();
  sizes.num_rows_per_expert = map.num_recv_rows();
  const size_t rows = size_t(sizes.num_local_experts) * sizes.num_rows_per_expert;
  const RowFormat format = row_format(low_latency_scale_format(in));
  sizes.num_scale_columns = format.scale_words(map.hidden);
  sizes.recv_x_bytes = rows * format.row_bytes(map.hidden);
  sizes.recv_x_scales_bytes = rows * format.scale_bytes(map.hidden);
  sizes.recv_count_bytes = sizeof(int) * sizes.num_local_experts;
  sizes.recv_src_info_bytes = sizeof(int) * rows;
  sizes.recv_layout_range_bytes = sizeof(LowLatencyRange) * size_t(sizes.num_local_experts) * map.num_ranks;
  sizes.recv_token_listings_bytes =
      sizeof(LowLatencyListing) * size_t(map.num_ranks) * map.num_max_tokens * in.num_topk;
  return sizes;
}

LowLatencyDispatchResult low_latency_dispatch(Buffer& buffer, const LowLatencyDispatchInput& in,
                                              const LowLatencyDispatchOutput& out, const StreamOrder& order) {
  const ExclusiveUse::Claim claim = BufferAccess::enter_call(buffer, "low_latency_dispatch");
  const LowLatencyBufferMap map =
      map_for(buffer, in.num_max_dispatch_tokens_per_rank, in.hidden, in.num_experts);
  validate_dispatch(buffer, in, out, map, *BufferAccess::low_latency_state(buffer), order);

  kernels::LowLatencyDispatchArgs args{};
  args.peers = peer_context(buffer);
  args.map = map;
  args.in = in;
  args.out = out;
  args.format = row_format(low_latency_scale_format(in));
  args.topk = SmallDivisor(static_cast<uint32_t>(in.num_topk));
  // The format's value in the low bits (below 8: LogFMT's bit in a combine's fingerprint).
  static_assert(kNumScaleFormats <= 8, "a scale format's value must stay below the listings bit");
  args.shape = low_latency_shape_fingerprint(
      map, static_cast<int>(args.format.format) | (out.recv_token_listings != nullptr ? 16 : 0));
  args.mask = mask_args(buffer);
  args.phase_stamps = phase_stamps(buffer);
  auto [event, hook] = issue(buffer, args, in.return_recv_hook, order,
                             buffer.spans_nodes() ? kernels::launch_low_latency_dispatch_remote
                                                  : kernels::launch_low_latency_dispatch);

  LowLatencyDispatchResult result;
  result.handle = LowLatencyHandle{
      in.num_tokens,          in.num_topk,       in.hidden,         in.num_max_dispatch_tokens_per_rank,
      in.num_experts,         out.recv_src_info, out.recv_topk_pos, out.recv_layout_range,
      out.recv_token_listings};
  result.event = std::move(event);
  result.hook = std::move(hook);
  return result;
}

void* next_low_latency_combine_buffer(const Buffer& buffer, const LowLatencyHandle& handle) {
  const LowLatencyBufferMap map =
      map_for(buffer, handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts);
  return LowLatencyBufferMap::at<char>(buffer.symmetric_buffer(), map.combine_send_offset());
}

LowLatencyCombineResult low_latency_combine(Buffer& buffer, const LowLatencyHandle& handle,
                                            const LowLatencyCombineInput& in, void* combined_x,
                                            const StreamOrder& order) {
  const ExclusiveUse::Claim claim = BufferAccess::enter_call(buffer, "low_latency_combine");
  const LowLatencyBufferMap map =
      map_for(buffer, handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts);
  check_tokens(in.num_tokens, in.num_topk, map, in.topk_idx);
  EPX_CHECK(handle.recv_src_info != nullptr && handle.recv_topk_pos != nullptr &&
                handle.recv_layout_range != nullptr,
            "handle", "without arrays", "must come from low_latency_dispatch");
  EPX_CHECK(in.num_tokens == handle.num_tokens, "num_tokens", in.num_tokens,
            detail::concat("must equal the dispatch's (", handle.num_tokens, ")").c_str());
  EPX_CHECK(in.num_topk == handle.num_topk, "num_topk", in.num_topk,
            detail::concat("must equal the dispatch's (", handle.num_topk, ")").c_str());
  EPX_CHECK(in.num_tokens == 0 || in.pre_reduce || in.topk_weights != nullptr, "topk_weights", "null",
            "must point to [num_tokens, num_topk] weights (pre_reduce takes the dispatch's instead)");
  EPX_CHECK(in.num_tokens == 0 || combined_x != nullptr, "combined_x", "null",
            "must point to [num_tokens, hidden]");
  EPX_CHECK(aligned16(combined_x), "combined_x", combined_x, "must be 16-byte aligned");
  EPX_CHECK(!in.pre_reduce || handle.recv_token_listings != nullptr, "pre_reduce", in.pre_reduce,
            "needs a handle from a dispatch given recv_token_listings and topk_weights");
  EPX_CHECK(!(in.return_recv_hook && order.async_finish), "async_finish", order.async_finish,
            "must be false with return_recv_hook (the hook orders the receive)");
  void* const zero_copy_rows = next_low_latency_combine_buffer(buffer, handle);
  const void* x = in.x;
  if (in.zero_copy) {
    EPX_CHECK(x == nullptr || x == zero_copy_rows, "x", x,
              "must be null or next_low_latency_combine_buffer() with zero_copy");
    x = zero_copy_rows;
  } else {
    EPX_CHECK(x != nullptr, "x", "null", "must point to [L, R*M, hidden] BF16 rows (or use zero_copy)");
    EPX_CHECK(aligned16(x), "x", x, "must be 16-byte aligned");
  }

  kernels::LowLatencyCombineArgs args{};
  args.peers = peer_context(buffer);
  args.map = map;
  args.in = in;
  args.in.x = x;
  // LogFMT codes rows that cross nodes (and, asked, the others): within one node, the BF16 combine. The
  // fingerprint holds the format the kernel runs, so ranks that would read each other's rows differently
  // abort instead.
  args.in.use_logfmt = in.use_logfmt && (in.logfmt_within_node || buffer.spans_nodes());
  args.handle = handle;
  args.out = combined_x;
  args.shape = low_latency_shape_fingerprint(map, (args.in.use_logfmt ? 8 : 0) | (in.pre_reduce ? 32 : 0) |
                                                      (args.in.use_logfmt && in.logfmt_within_node ? 64 : 0));
  args.mask = mask_args(buffer);
  args.phase_stamps = phase_stamps(buffer);
  auto [event, hook] = issue(buffer, args, in.return_recv_hook, order,
                             buffer.spans_nodes() ? kernels::launch_low_latency_combine_remote
                                                  : kernels::launch_low_latency_combine);
  return LowLatencyCombineResult{std::move(event), std::move(hook)};
}

void clean_low_latency_buffer(Buffer& buffer, int num_max_dispatch_tokens_per_rank, int hidden,
                              int num_experts, const StreamOrder& order) {
  const ExclusiveUse::Claim claim = BufferAccess::enter_call(buffer, "clean_low_latency_buffer");
  const LowLatencyBufferMap map = map_for(buffer, num_max_dispatch_tokens_per_rank, hidden, num_experts);
  begin_on_comm_stream(buffer, order);
  const kernels::LowLatencyCleanArgs args{peer_context(buffer), map, mask_args(buffer)};
  if (buffer.spans_nodes()) {
    kernels::launch_low_latency_clean_remote(args, buffer.comm_stream());
  } else {
    kernels::launch_low_latency_clean(args, buffer.comm_stream());
  }
  end_on_comm_stream(buffer, order);
  restart_low_latency_calls(*BufferAccess::low_latency_state(buffer));
}

void low_latency_update_mask_buffer(Buffer& buffer, int rank_to_mask, bool mask, const StreamOrder& order) {
  const ExclusiveUse::Claim claim = BufferAccess::enter_call(buffer, "low_latency_update_mask_buffer");
  EPX_CHECK(rank_to_mask >= 0, "rank_to_mask", rank_to_mask, "must be >= 0");
  EPX_CHECK(rank_to_mask < buffer.num_ranks(), "rank_to_mask", rank_to_mask,
            detail::concat("must be < num_ranks (", buffer.num_ranks(), ")").c_str());
  kernels::LowLatencyMaskUpdateArgs args{};
  args.mask = mask_args(buffer);
  args.op = mask ? kernels::LowLatencyMaskOp::kSet : kernels::LowLatencyMaskOp::kClear;
  args.rank = rank_to_mask;
  run_mask_op(buffer, args, order);
}

void low_latency_query_mask_buffer(Buffer& buffer, int* mask_status, const StreamOrder& order) {
  const ExclusiveUse::Claim claim = BufferAccess::enter_call(buffer, "low_latency_query_mask_buffer");
  EPX_CHECK(mask_status != nullptr, "mask_status", "null",
            "must point to [num_ranks] int32 in device memory");
  kernels::LowLatencyMaskUpdateArgs args{};
  args.mask = mask_args(buffer);
  args.op = kernels::LowLatencyMaskOp::kQuery;
  args.num_ranks = buffer.num_ranks();
  args.mask_status = mask_status;
  run_mask_op(buffer, args, order);
}

void low_latency_clean_mask_buffer(Buffer& buffer, const StreamOrder& order) {
  const ExclusiveUse::Claim claim = BufferAccess::enter_call(buffer, "low_latency_clean_mask_buffer");
  kernels::LowLatencyMaskUpdateArgs args{};
  args.mask = mask_args(buffer);
  args.op = kernels::LowLatencyMaskOp::kCleanAll;
  run_mask_op(buffer, args, order);
}

LowLatencyMaskBits read_low_latency_mask(const Buffer& buffer) {
  unsigned long long words[2] = {0, 0};
  const cudaStream_t stream = BufferAccess::private_stream(buffer);
  EPX_CUDA_CHECK(cudaMemcpyAsync(words, BufferAccess::rank_mask_words(buffer), sizeof(words),
                                 cudaMemcpyDeviceToHost, stream));
  EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
  return LowLatencyMaskBits{words[0], words[1]};
}

}  // namespace epx
