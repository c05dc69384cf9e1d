#include "core/wait_record.hpp"

#include <cstdio>

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
    case WaitPhase::kDispatchOutputs:
      return "dispatch receive (waiting for this rank's host to call dispatch_receive with the outputs)";
  }
  return "unknown phase";
}

std::string describe_wait_timeout(const WaitTimeoutRecord& record) {
  const auto phase = static_cast<WaitPhase>(record.phase);
  char seconds[32];
  std::snprintf(seconds, sizeof(seconds), "%.1f", static_cast<double>(record.waited_ns) * 1e-9);
  if (phase == WaitPhase::kCapacity) {
    return detail::concat("rank ", record.rank, ": capacity exceeded for data from peer ", record.peer,
                          ": needed ", record.seen, " rows, room for ", record.expected);
  }
  return detail::concat("rank ", record.rank, " timed out after ", seconds, " s waiting for peer ",
                        record.peer, " in ", wait_phase_name(phase), ": expected >= ", record.expected,
                        ", saw ", record.seen);
}

}  // namespace epx
