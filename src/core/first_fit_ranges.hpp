#pragma once

#include <cstdint>
#include <iterator>
#include <map>
#include <mutex>

// First-fit ranges of one span of bytes: what a Buffer's output window hands torch's caching allocator as
// segments (python/torch_ext/epx_torch.cpp). Ranges start and end at multiples of `alignment` from the span's
// start; a range given back merges with its free neighbours. Plain host logic, thread-safe (torch may free a
// segment on any thread).
namespace epx {

class FirstFitRanges {
 public:
  FirstFitRanges(int64_t bytes, int64_t alignment) : alignment_(alignment > 0 ? alignment : 1) {
    const int64_t usable = bytes > 0 ? bytes / alignment_ * alignment_ : 0;
    if (usable > 0) free_[0] = usable;
  }

  // The offset of a range of `bytes` (rounded up to the alignment), the lowest that fits, or -1 when none
  // does (or bytes <= 0).
  int64_t take(int64_t bytes) {
    if (bytes <= 0) return -1;
    const int64_t size = (bytes + alignment_ - 1) / alignment_ * alignment_;
    const std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < size) continue;
      const int64_t offset = it->first;
      const int64_t left = it->second - size;
      free_.erase(it);
      if (left > 0) free_[offset + size] = left;
      taken_[offset] = size;
      return offset;
    }
    return -1;
  }

  // Returns the range taken at `offset` (anything else: nothing happens).
  void give_back(int64_t offset) {
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto found = taken_.find(offset);
    if (found == taken_.end()) return;
    int64_t start = offset;
    int64_t size = found->second;
    taken_.erase(found);
    const auto next = free_.find(start + size);
    if (next != free_.end()) {
      size += next->second;
      free_.erase(next);
    }
    const auto after = free_.lower_bound(start);
    if (after != free_.begin()) {
      const auto before = std::prev(after);
      if (before->first + before->second == start) {
        start = before->first;
        size += before->second;
        free_.erase(before);
      }
    }
    free_[start] = size;
  }

  // Bytes taken and not given back, for tests.
  int64_t taken() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    int64_t bytes = 0;
    for (const auto& range : taken_) bytes += range.second;
    return bytes;
  }

  // Free ranges (after merging), for tests.
  size_t free_ranges() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return free_.size();
  }

 private:
  const int64_t alignment_;
  mutable std::mutex mutex_;
  std::map<int64_t, int64_t> free_;   // offset -> bytes
  std::map<int64_t, int64_t> taken_;  // offset -> bytes
};

}  // namespace epx
