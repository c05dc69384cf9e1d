#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "bootstrap/shm_segment.hpp"
#include "epx/bootstrap.hpp"

namespace epx::bootstrap {

// The Bootstrap of one rank of a local launch, over the launcher's shared segment.
//
// Each rank counts its collective calls (barriers and all_gathers together, from 0: the "#N" in error
// messages). Call c: write the CallRecord (and gather bytes) into the parity-(c % 2) slot, publish
// num_arrived = c + 1, wait until every rank's num_arrived > c, check that all ranks made the same call,
// then read. Per-rank arrival counters (rather than one shared counter) let a timeout name the missing ranks.
class ShmBootstrap final : public Bootstrap {
 public:
  ShmBootstrap(SharedSegment& segment, int rank, std::chrono::milliseconds timeout);

  int rank() const override { return rank_; }
  int num_ranks() const override { return segment_.header().num_ranks; }
  std::vector<std::byte> all_gather(const void* data, size_t bytes) override;
  void barrier() override;

 private:
  uint64_t arrive(CollectiveKind kind, const void* data, size_t bytes);
  void wait_for_all(uint64_t collective_idx, CollectiveKind kind) const;
  void check_same_call(uint64_t collective_idx, CollectiveKind kind) const;
  std::string describe(uint64_t collective_idx, CollectiveKind kind) const;
  [[noreturn]] void fail_waiting(uint64_t collective_idx, CollectiveKind kind, const std::string& why) const;

  SharedSegment& segment_;
  int rank_;
  std::chrono::milliseconds timeout_;
  uint64_t num_calls_ = 0;
};

}  // namespace epx::bootstrap
