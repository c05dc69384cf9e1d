#include "core/wait_record.hpp"

#include <atomic>
#include <cstdio>
#include <string>

#include "core/abort_word.hpp"
#include "core/shape_fingerprint.hpp"
#include "epx/error.hpp"

namespace epx {

const char* wait_phase_name(WaitPhase phase) {
  switch (phase) {
    case WaitPhase::kNone:
      return "none";
    case WaitPhase::kBarrier:
      return "barrier";
    case WaitPhase::kDispatchNotify:
      return "dispatch notify (count exchange)";
    case WaitPhase::kDispatchReceive:
      return "dispatch receive";
    case WaitPhase::kCombineReduce:
      return "combine reduce";
    case WaitPhase::kLowLatencyDispatchRecv:
      return "low-latency dispatch receive";
    case WaitPhase::kLowLatencyCombineRecv:
      return "low-latency combine receive";
    case WaitPhase::kCapacity:
      return "capacity check";
    case WaitPhase::kDispatchSend:
      return "dispatch send (room in the peer's queue)";
    case WaitPhase::kCombineSend:
      return "combine send (room in the peer's queue)";
    case WaitPhase::kPreviousCall:
      return "the peer's previous normal-mode call";
    case WaitPhase::kLowLatencyDispatchSend:
      return "low-latency dispatch send";
    case WaitPhase::kLowLatencyCombineSend:
      return "low-latency combine send";
    case WaitPhase::kShapeMismatch:
      return "shape check";
    case WaitPhase::kDispatchOutputs:
      return "dispatch receive (waiting for this rank's host to call dispatch_receive with the outputs)";
    case WaitPhase::kRankCounts:
      return "dispatch notify (num_tokens_per_rank check)";
    case WaitPhase::kLayoutCounts:
      return "dispatch notify (layout board check)";
  }
  return "unknown phase";
}

namespace {

std::string describe_released(const FailureRecord& record) {
  const auto phase = static_cast<WaitPhase>(record.phase);
  const std::string cause = describe_abort_cause(decode_abort_word(record.abort_word));
  if (record.peer < 0) {
    return detail::concat("rank ", record.rank, " skipped ", wait_phase_name(phase),
                          ": the group was aborted: ", cause);
  }
  return detail::concat("rank ", record.rank, " stopped waiting for peer ", record.peer, " in ",
                        wait_phase_name(phase), " (expected >= ", record.expected, ", saw ", record.seen,
                        "): the group was aborted: ", cause);
}

}  // namespace

std::string describe_failure(const FailureRecord& record) {
  if (record.abort_word != 0) return describe_released(record);
  const auto phase = static_cast<WaitPhase>(record.phase);
  char seconds[32];
  std::snprintf(seconds, sizeof(seconds), "%.1f", static_cast<double>(record.waited_ns) * 1e-9);
  if (phase == WaitPhase::kCapacity) {
    return detail::concat("rank ", record.rank, ": capacity exceeded for data from peer ", record.peer,
                          ": needed ", record.seen, " rows, room for ", record.expected);
  }
  if (phase == WaitPhase::kRankCounts) {
    return detail::concat("rank ", record.rank, ": num_tokens_per_rank of peer ", record.peer, " gives ",
                          record.expected, " tokens for this rank, but its is_token_in_rank marks ",
                          record.seen, " (pass get_dispatch_layout's outputs unchanged)");
  }
  if (phase == WaitPhase::kLayoutCounts && record.peer < 0) {
    return detail::concat("rank ", record.rank, ": the dispatch outputs hold ", record.expected,
                          " rows, but ", record.seen, " rows arrive");
  }
  if (phase == WaitPhase::kLayoutCounts) {
    return detail::concat(
        "rank ", record.rank, ": peer ", record.peer, "'s get_dispatch_layout posted ", record.seen,
        " tokens for this rank, but its dispatch sends ", record.expected,
        " (each rank must pass its own last get_dispatch_layout's outputs, unchanged, to the "
        "dispatch after it)");
  }
  if (phase == WaitPhase::kShapeMismatch) {
    return detail::concat("rank ", record.rank, ": peer ", record.peer, " called with ",
                          shape_field_name(record.detail), " = ", record.seen, ", this rank with ",
                          record.expected, " (every rank must pass the same shapes and config)");
  }
  return detail::concat("rank ", record.rank, " timed out after ", seconds, " s waiting for peer ",
                        record.peer, " in ", wait_phase_name(phase), ": expected >= ", record.expected,
                        ", saw ", record.seen);
}

std::string describe_abort_cause(const AbortCause& cause) {
  if (cause.phase == WaitPhase::kCapacity) {
    return detail::concat("rank ", cause.rank, " exceeded its capacity (num_worst_tokens)");
  }
  if (cause.phase == WaitPhase::kShapeMismatch) {
    return detail::concat("rank ", cause.rank, " found that peer ", cause.peer, " called with other shapes");
  }
  if (cause.phase == WaitPhase::kLayoutCounts && cause.peer < 0) {
    return detail::concat("rank ", cause.rank, " got more dispatch rows than its outputs hold");
  }
  if (cause.phase == WaitPhase::kLayoutCounts) {
    return detail::concat("rank ", cause.rank, " found that the counts peer ", cause.peer,
                          "'s get_dispatch_layout posted disagree with its dispatch");
  }
  if (cause.phase == WaitPhase::kRankCounts) {
    return detail::concat("rank ", cause.rank, " found that the num_tokens_per_rank of peer ", cause.peer,
                          " disagrees with its is_token_in_rank");
  }
  return detail::concat("rank ", cause.rank, " timed out waiting for peer ", cause.peer, " in ",
                        wait_phase_name(cause.phase));
}

std::string describe_abort_word(int rank, int32_t word) {
  return detail::concat("rank ", rank,
                        ": the group was aborted: ", describe_abort_cause(decode_abort_word(word)));
}

FailureRecord snapshot_failure_record(const FailureRecord& mapped) {
  FailureRecord copy{};
  copy.flag = reinterpret_cast<const volatile int32_t&>(mapped.flag);
  if (copy.flag != 1) return FailureRecord{};
  std::atomic_thread_fence(std::memory_order_acquire);
  const auto& fields = reinterpret_cast<const volatile FailureRecord&>(mapped);
  copy.rank = fields.rank;
  copy.peer = fields.peer;
  copy.phase = fields.phase;
  copy.expected = fields.expected;
  copy.seen = fields.seen;
  copy.waited_ns = fields.waited_ns;
  copy.abort_word = fields.abort_word;
  copy.detail = fields.detail;
  return copy;
}

const char* shape_field_name(int field) {
  switch (static_cast<ShapeField>(field)) {
    case ShapeField::kHidden:
      return "hidden";
    case ShapeField::kRowBytes:
      return "row bytes (hidden and format)";
    case ShapeField::kNumScales:
      return "num_scales";
    case ShapeField::kNumTopk:
      return "num_topk";
    case ShapeField::kNumExperts:
      return "num_experts";
    case ShapeField::kNumChannels:
      return "channels (num_sms / 2)";
    case ShapeField::kQueueTokens:
      return "num_max_nvl_chunked_recv_tokens";
    case ShapeField::kMaxTokens:
      return "num_max_dispatch_tokens_per_rank";
    case ShapeField::kNetworkQueueTokens:
      return "num_max_rdma_chunked_recv_tokens (across nodes), or the combine's staging rows per source "
             "within a node (num_nvl_staging_bytes, EPX_COMBINE_STAGING)";
    case ShapeField::kWarpRoles:
      return "the combine's reducing warps per sender block (EPX_COMBINE_SENDER_REDUCE_WARPS)";
    case ShapeField::kFormat:
      return "format (use_fp8, round_scale, use_ue8m0, use_logfmt, pre_reduce, logfmt_within_node; in normal "
             "mode the operation, dispatch or "
             "combine, use_fp8, and whether num_tokens_per_rank was given: 4)";
  }
  return "?";
}

}  // namespace epx
