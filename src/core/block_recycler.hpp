#pragma once

#include <algorithm>
#include <cstddef>
#include <mutex>
#include <utility>
#include <vector>

// Device blocks a Buffer's handles gave back, kept for the next handles' arrays instead of one pool free and
// one pool allocation per dispatch (cudaFreeAsync and cudaMallocFromPoolAsync, each 1-2 us of host time).
//
// NOTES: every use of a handle's arrays by the runtime is ordered on the comm stream, and so is every new
// handle's first use; a block kept at host time and handed to the next allocation on that stream is reused in
// stream order, exactly as the pool reuses a block freed with cudaFreeAsync on the same stream. Allocations
// on another stream (a launched receive's rows, made on a private stream) must not take kept blocks.
//
// Plain host logic, no CUDA: the runtime allocates and frees around it. Thread-safe: a handle may be freed on
// any thread.
namespace epx {

class BlockRecycler {
 public:
  struct Block {
    void* address = nullptr;
    size_t bytes = 0;
  };
  static constexpr size_t kMaxKept = 8;
  // Requests are rounded up to this, so calls whose sizes differ a little (the rows vary) reuse each other's
  // blocks.
  static constexpr size_t kGranularityBytes = 4096;

  static constexpr size_t rounded(size_t bytes) {
    return (std::max<size_t>(bytes, 1) + kGranularityBytes - 1) / kGranularityBytes * kGranularityBytes;
  }

  // The smallest kept block of at least `bytes` and at most twice rounded(bytes) (a larger one stays for a
  // larger request), taken out; {} when none: allocate one of rounded(bytes) then. Twice the rounded size,
  // not twice `bytes`: a request under half the granularity (a worst-case dispatch's row array of a few
  // hundred rows) would otherwise refuse the very block size it allocates, and every such call paid a pool
  // allocation and a free.
  Block take(size_t bytes) {
    const std::lock_guard<std::mutex> lock(mutex_);
    auto best = kept_.end();
    const size_t largest = 2 * rounded(bytes);
    for (auto it = kept_.begin(); it != kept_.end(); ++it) {
      if (it->bytes >= bytes && it->bytes <= largest && (best == kept_.end() || it->bytes < best->bytes))
        best = it;
    }
    if (best == kept_.end()) return {};
    const Block block = *best;
    *best = kept_.back();
    kept_.pop_back();
    return block;
  }

  // Keeps `block` for a later take. False when closed or full: the caller frees it.
  bool keep(Block block) {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (closed_ || kept_.size() >= kMaxKept) return false;
    kept_.push_back(block);
    return true;
  }

  // Keeps nothing from now on; returns the kept blocks, for the caller to free.
  std::vector<Block> close() {
    const std::lock_guard<std::mutex> lock(mutex_);
    closed_ = true;
    return std::exchange(kept_, {});
  }

 private:
  std::mutex mutex_;
  std::vector<Block> kept_;
  bool closed_ = false;
};

}  // namespace epx
