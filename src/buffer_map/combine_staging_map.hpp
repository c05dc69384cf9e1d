#pragma once

#include <cstddef>
#include <cstdint>

#include "buffer_map/normal_buffer_map.hpp"
#include "common/host_device.hpp"

namespace epx {

// The combine's staging area within one node (BufferOptions::num_nvl_staging_bytes): a part of each rank's
// NVLink buffer into which every peer's copy engine returns the rows this rank sent it (cudaMemcpyAsync over
// NVLink, no SM), so the combine's SMs only reduce. Shared by the host (which copies) and the kernels (which
// wait and read). Every rank has the same area at the same offset of its buffer.
//
// NOTES: peer p returns to source s the rows it received from s, x[first(s), first(s) + n) of its combine
// input (contiguous: a dispatch's rows are ordered by source), in kStagingChunks chunks of chunk_rows(n)
// rows, top-k weights first; after each chunk p raises flag (p, chunk) in s's area to its call number (the
// copies before it in p's stream are complete and visible then). s's reducers find token t's copy from p at
// staging row (rows s sent p on earlier channels) + send_head[t][p], and wait for that row's chunk flag. One
// slot per source, rewritten by the next combine: p copies only after s finished its previous launch (the
// gate kernel before the copies waits for it), and that launch is at least s's previous combine.
//
//   flags   uint32 [kMaxNvlRanks sources][kStagingChunks], written by the source: its call number + 1
//   slots   one per peer source (ascending rank, this rank skipped): rows [slot_rows][row_bytes], then
//           weights [slot_rows][num_topk] float
//
// A pair (p -> s) uses the area when s's rows from p fit a slot (fits(n)); both ends decide alike from n:
// p's host from its handle's counts, s's kernel from what it sent p. Other pairs go through the queues.
constexpr int kStagingChunks = 4;  // copy-engine chunks per peer (epx-link-bench: 4 best, 16+ slower)

struct CombineStagingMap {
  size_t offset = 0;  // of the area from the start of each rank's NVLink buffer
  size_t bytes = 0;   // 0: no staging
  int num_ranks = 1;
  int row_bytes = 0;  // of this combine's rows (hidden * 2)
  int num_topk = 0;   // weights per row this combine reduces (0: none)

  static constexpr size_t kFlagBytes =
      align_up(sizeof(uint32_t) * kMaxNvlRanks * kStagingChunks, kNormalAlign);

  EPX_HD size_t slot_bytes() const {
    if (num_ranks < 2 || bytes <= kFlagBytes) return 0;
    return (bytes - kFlagBytes) / (num_ranks - 1) / kNormalAlign * kNormalAlign;
  }
  EPX_HD size_t staged_row_bytes() const { return size_t(row_bytes) + sizeof(float) * num_topk; }
  // Rows one source's slot holds (0: staging is off for this combine).
  EPX_HD int slot_rows() const {
    if (row_bytes <= 0) return 0;
    const size_t rows = slot_bytes() / staged_row_bytes();
    return rows > 0x7fffffff ? 0x7fffffff : static_cast<int>(rows);
  }
  EPX_HD bool enabled() const { return slot_rows() > 0; }
  // Whether n rows between two ranks go through the area (both ends ask this with the same n).
  EPX_HD bool fits(int n) const { return enabled() && n <= slot_rows(); }
  EPX_HD static int chunk_rows(int n) {
    return n <= kStagingChunks ? 1 : (n + kStagingChunks - 1) / kStagingChunks;
  }
  EPX_HD static int num_chunks(int n) { return (n + chunk_rows(n) - 1) / chunk_rows(n); }

  // In rank `owner`'s area (`base`: its NVLink buffer as this GPU sees it).
  EPX_HD uint32_t* flag(void* base, int src, int chunk) const {
    return reinterpret_cast<uint32_t*>(static_cast<char*>(base) + offset) + src * kStagingChunks + chunk;
  }
  EPX_HD char* rows(void* base, int src, int owner) const {
    const int slot = src < owner ? src : src - 1;
    return static_cast<char*>(base) + offset + kFlagBytes + slot * slot_bytes();
  }
  EPX_HD float* weights(void* base, int src, int owner) const {
    return reinterpret_cast<float*>(rows(base, src, owner) + size_t(slot_rows()) * row_bytes);
  }
};

}  // namespace epx
