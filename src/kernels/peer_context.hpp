#pragma once

#include <cstdint>

#include "core/abort_word.hpp"
#include "core/wait_record.hpp"

namespace epx::kernels {

// What every EPX kernel knows about its group: the peers' mapped buffers and where bounded waits report.
struct PeerContext {
  void* const* peer_bases;  // device array [R]: every rank's buffer as seen from this GPU (nullptr: unmapped)
  void* local_base;
  int rank;
  int num_ranks;
  FailureRecord* failure_record;
  uint64_t timeout_ns;
  AbortWords abort;  // every bounded wait stops once the group is aborted (core/abort_word.hpp)
};

}  // namespace epx::kernels
