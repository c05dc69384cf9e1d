#pragma once

#include <cstdint>

#include "device/tma.cuh"

namespace epx::kernels {

// A warp's staging: kBuffers pieces of kPieceBytes in shared memory, one mbarrier each.
template <int kBuffers, int kPieceBytes>
struct TmaStage {
  static constexpr int kNumBuffers = kBuffers;
  static constexpr int kBytes = kPieceBytes;
  alignas(128) char pieces[kBuffers][kPieceBytes];
  uint64_t barriers[kBuffers];
};

// The combine's reducer staging: small pieces, so a warp's lanes add one piece while three more load.
constexpr int kTmaBuffers = 4;
constexpr int kTmaPieceBytes = 3072;
using TmaWarpStage = TmaStage<kTmaBuffers, kTmaPieceBytes>;

// Copies rows global -> shared -> global with bulk copies, driven by one lane of a warp (the others stay
// free for the rows' small fields). Rows are cut into pieces that stream through the buffers in order:
// piece p loads into buffer p % kTmaBuffers, its store is issued once it landed, and up to kTmaBuffers - 1
// loads are in flight at any time, across row boundaries.
// NOTES: copy() may return before its pieces landed. wait_loads() returns once every source byte was read
// (call it before a source may be overwritten, e.g. before a queue slot is released); finish() also waits
// for the stores, and must run before the block exits.
template <typename Stage>
class TmaRowCopier {
 public:
  static constexpr int kTmaBuffers = Stage::kNumBuffers;
  static constexpr int kTmaPieceBytes = Stage::kBytes;
  static_assert(kTmaBuffers >= 2 && kTmaBuffers <= 4, "bulk_store_wait_read_at_most waits for up to 3");

  // Every lane of the warp may construct it; only `driver` (one lane) initialises, copies and finishes.
  __device__ TmaRowCopier(Stage* stage, bool driver) : stage_(stage), driver_(driver) {
    if (!driver_) return;
    for (int b = 0; b < kTmaBuffers; ++b) device::mbarrier_init(&stage_->barriers[b], 1);
  }
  __device__ bool driver() const { return driver_; }

  __device__ void copy(void* dst, const void* src, int bytes) {
    for (int offset = 0; offset < bytes; offset += kTmaPieceBytes) {
      const int n = bytes - offset < kTmaPieceBytes ? bytes - offset : kTmaPieceBytes;
      push(static_cast<char*>(dst) + offset, static_cast<const char*>(src) + offset, n);
    }
  }

  __device__ void wait_loads() {
    while (stored_ != issued_) retire();
  }

  __device__ void finish() {
    if (!driver_) return;
    wait_loads();
    device::bulk_store_wait_all();
  }

 private:
  __device__ void push(char* dst, const char* src, int bytes) {
    // Keep one buffer's store issued ahead of its reuse, so the wait below rarely blocks.
    if (issued_ - stored_ >= kTmaBuffers - 1) retire();
    const int buffer = issued_ % kTmaBuffers;
    // The store that last read this buffer, and those issued after it: at most those after it may still read.
    if (issued_ >= kTmaBuffers) device::bulk_store_wait_read_at_most(stored_ + kTmaBuffers - 1 - issued_);
    dst_[buffer] = dst;
    bytes_[buffer] = bytes;
    device::mbarrier_expect_bytes(&stage_->barriers[buffer], bytes);
    device::bulk_load(stage_->pieces[buffer], src, bytes, &stage_->barriers[buffer]);
    ++issued_;
  }

  // The oldest load in flight: wait until it landed, then store it.
  __device__ void retire() {
    const int buffer = stored_ % kTmaBuffers;
    device::mbarrier_wait(&stage_->barriers[buffer], (parities_ >> buffer) & 1u);
    parities_ ^= 1u << buffer;
    device::bulk_store(dst_[buffer], stage_->pieces[buffer], bytes_[buffer]);
    ++stored_;
  }

  Stage* stage_;
  bool driver_;
  uint32_t issued_ = 0;  // pieces whose load was issued
  uint32_t stored_ = 0;  // pieces whose store was issued (always in load order)
  uint32_t parities_ = 0;
  char* dst_[kTmaBuffers] = {};
  int bytes_[kTmaBuffers] = {};
};

}  // namespace epx::kernels
