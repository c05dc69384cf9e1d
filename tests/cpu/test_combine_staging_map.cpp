#include "buffer_map/combine_staging_map.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace {

using epx::CombineStagingMap;
using epx::kStagingChunks;

CombineStagingMap map_of(size_t bytes, int num_ranks, int hidden, int num_topk) {
  CombineStagingMap map;
  map.offset = 4096;
  map.bytes = bytes;
  map.num_ranks = num_ranks;
  map.row_bytes = hidden * 2;
  map.num_topk = num_topk;
  return map;
}

TEST(CombineStagingMap, OffWithoutBytesOrPeersOrRows) {
  EXPECT_FALSE(map_of(0, 2, 7168, 8).enabled());
  EXPECT_FALSE(map_of(CombineStagingMap::kFlagBytes, 2, 7168, 8).enabled());
  EXPECT_FALSE(map_of(size_t(1) << 30, 1, 7168, 8).enabled());
  EXPECT_FALSE(map_of(size_t(1) << 30, 2, 0, 8).enabled());
  // Room for less than one row.
  EXPECT_FALSE(map_of(CombineStagingMap::kFlagBytes + 7168 * 2, 2, 7168, 8).enabled());
  EXPECT_FALSE(map_of(0, 2, 7168, 8).fits(0));
}

TEST(CombineStagingMap, SlotRowsAndFits) {
  // 4,096 rows of hidden 7168 with 8 weights from one peer: what epx-bench --staging gives at 2 ranks.
  const size_t row = 7168 * 2 + 8 * 4;
  const CombineStagingMap two = map_of(CombineStagingMap::kFlagBytes + 4096 * row + 128, 2, 7168, 8);
  EXPECT_EQ(two.slot_rows(), 4096);
  EXPECT_TRUE(two.fits(0));
  EXPECT_TRUE(two.fits(4096));
  EXPECT_FALSE(two.fits(4097));
  // The same bytes shared by 7 peers: a seventh of the rows each (slots rounded down to 128 bytes).
  const CombineStagingMap eight = map_of(two.bytes, 8, 7168, 8);
  EXPECT_EQ(eight.slot_rows(),
            static_cast<int>((two.bytes - CombineStagingMap::kFlagBytes) / 7 / 128 * 128 / row));
}

TEST(CombineStagingMap, SlotsDoNotOverlapAndStayInTheArea) {
  for (const int num_ranks : {2, 3, 4, 8}) {
    for (const int num_topk : {0, 1, 8}) {
      const CombineStagingMap map = map_of(size_t(3) << 20, num_ranks, 2048, num_topk);
      ASSERT_TRUE(map.enabled());
      char* base = reinterpret_cast<char*>(uintptr_t(1) << 40);
      const char* area_end = base + map.offset + map.bytes;
      for (int owner = 0; owner < num_ranks; ++owner) {
        const char* previous_end = base + map.offset + CombineStagingMap::kFlagBytes;  // after the flags
        EXPECT_LE(
            reinterpret_cast<const char*>(map.flag(base, epx::kMaxNvlRanks - 1, kStagingChunks - 1) + 1),
            previous_end);
        for (int src = 0; src < num_ranks; ++src) {
          if (src == owner) continue;
          const char* rows = map.rows(base, src, owner);
          const char* weights = reinterpret_cast<const char*>(map.weights(base, src, owner));
          const char* end = weights + sizeof(float) * num_topk * map.slot_rows();
          EXPECT_GE(rows, previous_end) << num_ranks << " ranks, owner " << owner << ", src " << src;
          EXPECT_EQ(weights, rows + size_t(map.slot_rows()) * map.row_bytes);
          EXPECT_LE(end, rows + map.slot_bytes());
          EXPECT_LE(end, area_end);
          EXPECT_EQ(reinterpret_cast<uintptr_t>(rows) % 128, 0u);
          previous_end = end;
        }
      }
    }
  }
}

TEST(CombineStagingMap, ChunksCoverEveryRowOnce) {
  for (const int n : {0, 1, 2, 3, 4, 5, 7, 8, 9, 333, 4096, 4097}) {
    const int per_chunk = CombineStagingMap::chunk_rows(n);
    const int chunks = CombineStagingMap::num_chunks(n);
    EXPECT_LE(chunks, kStagingChunks) << n;
    std::vector<int> seen(n, 0);
    for (int k = 0; k < chunks; ++k) {
      for (int row = k * per_chunk; row < n && row < (k + 1) * per_chunk; ++row) ++seen[row];
    }
    for (int row = 0; row < n; ++row) EXPECT_EQ(seen[row], 1) << n << " rows, row " << row;
    // Every row's chunk (row / per_chunk, as the reducer finds it) is one the host raises a flag for.
    if (n > 0) {
      EXPECT_LT((n - 1) / per_chunk, chunks) << n;
    }
  }
}

}  // namespace
