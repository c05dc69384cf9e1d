#include "bootstrap/shm_segment.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>

#include "epx/error.hpp"

namespace epx::bootstrap {
namespace {

constexpr size_t kPageBytes = 4096;
constexpr size_t kSlotAlignBytes = 64;

size_t round_up(size_t value, size_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

}  // namespace

const char* collective_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kBarrier:
      return "barrier";
    case CollectiveKind::kAllGather:
      return "all_gather";
    case CollectiveKind::kNone:
      break;
  }
  return "none";
}

void copy_message(char (&buffer)[kMessageBytes], const std::string& text) {
  const size_t num_chars = std::min(text.size(), kMessageBytes - 1);
  std::memcpy(buffer, text.data(), num_chars);
  buffer[num_chars] = '\0';
}

SharedSegment::SharedSegment(int num_ranks, size_t max_gather_bytes) {
  const size_t slot_stride_bytes = round_up(std::max<size_t>(max_gather_bytes, 1), kSlotAlignBytes);
  data_offset_ = round_up(sizeof(SegmentHeader), kPageBytes);
  total_bytes_ = data_offset_ + 2 * static_cast<size_t>(num_ranks) * slot_stride_bytes;
  // MAP_NORESERVE: the slots are sized for the largest gather, most of them are never touched.
  base_ =
      mmap(nullptr, total_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base_ == MAP_FAILED) {
    base_ = nullptr;
    EPX_FAIL("local launcher: mmap of ", total_bytes_, " shared bytes failed: ", std::strerror(errno));
  }
  // Fresh anonymous pages are zero, which is the initial state of every field; placement-new starts the
  // objects' lifetimes (and the atomics') formally.
  header_ = new (base_) SegmentHeader{};
  header_->num_ranks = num_ranks;
  header_->max_gather_bytes = max_gather_bytes;
  header_->slot_stride_bytes = slot_stride_bytes;
  header_->abort_rank = -1;
}

SharedSegment::~SharedSegment() {
  if (base_ != nullptr) munmap(base_, total_bytes_);
}

std::byte* SharedSegment::slot(uint64_t collective_idx, int rank) const {
  const size_t slot_idx = (collective_idx % 2) * header_->num_ranks + rank;
  return static_cast<std::byte*>(base_) + data_offset_ + slot_idx * header_->slot_stride_bytes;
}

void SharedSegment::abort(int rank, const std::string& reason) {
  if (header_->aborted.load(std::memory_order_relaxed) != 0) return;
  header_->abort_rank = rank;
  copy_message(header_->abort_reason, reason);
  header_->aborted.store(1, std::memory_order_release);
}

}  // namespace epx::bootstrap
