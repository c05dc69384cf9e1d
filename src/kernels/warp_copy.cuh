#pragma once

#include <cstddef>

#include "device/ptx.cuh"
#include "kernels/work_split.hpp"

namespace epx::kernels {

// Each 16-byte word as it is (warp_copy's default transform).
struct SameWords {
  __device__ int4 operator()(const int4& v) const { return v; }
};

// Copies `bytes` (a multiple of 16) with 16-byte accesses by one warp: kUnroll loads per lane are issued
// before the first store, the last partial round included, so a remote row never waits on serial round trips.
// kSourceMayChange: the source is written by others while the kernel runs (peer memory, queues), so it is
// read coherently (L1 bypassed, no read-only path). `transform` maps each word on its way (register work
// only).
template <bool kSourceMayChange, int kUnroll = 8, typename Transform = SameWords>
__device__ __forceinline__ void warp_copy(void* dst, const void* src, size_t bytes, int lane,
                                          Transform transform = {}) {
  auto* d = static_cast<int4*>(dst);
  const auto* s = static_cast<const int4*>(src);
  const int n = static_cast<int>(bytes / 16);
  for (int base = lane; base < n; base += kUnroll * 32) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * 32 < n)
        v[u] = kSourceMayChange ? device::ld_v4(s + base + u * 32) : device::ld_nc_v4(s + base + u * 32);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * 32 < n) device::st_na_v4(d + base + u * 32, transform(v[u]));
    }
  }
}

// Piece `piece` of `num_pieces` (row_pieces(bytes)) of a row copy, by one warp.
template <bool kSourceMayChange>
__device__ __forceinline__ void warp_copy_piece(void* dst, const void* src, size_t bytes, int piece,
                                                int num_pieces, int lane) {
  const WordRange range = piece_words(static_cast<int>(bytes / 16), piece, num_pieces);
  warp_copy<kSourceMayChange, kRowPieceUnroll>(static_cast<int4*>(dst) + range.begin,
                                               static_cast<const int4*>(src) + range.begin,
                                               size_t(range.end - range.begin) * 16, lane);
}

}  // namespace epx::kernels
