// The low-latency kernels' work splits (src/kernels/work_split.hpp): every row piece, chunk range and
// publishing block, enumerated as the kernels walk them, covers its work exactly once.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/counter.hpp"
#include "kernels/work_split.hpp"

namespace {

using epx::kernels::WordRange;

// The ranges of `parts` pieces of `words` tile [0, words) in order.
void expect_tiling(int words, int parts) {
  int next = 0;
  for (int p = 0; p < parts; ++p) {
    const WordRange range = epx::kernels::piece_words(words, p, parts);
    EXPECT_EQ(range.begin, next) << words << " words, piece " << p << " of " << parts;
    EXPECT_LE(range.begin, range.end);
    next = range.end;
  }
  EXPECT_EQ(next, words) << words << " words in " << parts << " pieces";
}

TEST(WorkSplit, RowPiecesTileTheRowAndFitOneRound) {
  for (size_t bytes : {size_t(16), size_t(256), size_t(7168), size_t(7168 + 56 * 4 + 16), size_t(8192),
                       size_t(8208), size_t(14336), size_t(32768), size_t(65536 + 16)}) {
    const int words = static_cast<int>(bytes / 16);
    const int pieces = epx::kernels::row_pieces(bytes);
    EXPECT_GE(pieces, 1);
    expect_tiling(words, pieces);
    // Every piece is one round of the copy: at most kRowPieceWords words.
    for (int p = 0; p < pieces; ++p) {
      const WordRange range = epx::kernels::piece_words(words, p, pieces);
      EXPECT_LE(range.end - range.begin, epx::kernels::kRowPieceWords) << bytes;
    }
  }
  EXPECT_EQ(epx::kernels::row_pieces(7168), 1);   // an FP8 row of hidden 7168
  EXPECT_EQ(epx::kernels::row_pieces(14336), 2);  // its BF16 row
  EXPECT_EQ(epx::kernels::row_pieces(8192), 1);   // exactly one round
  EXPECT_EQ(epx::kernels::row_pieces(8192 + 16), 2);
}

TEST(WorkSplit, LogfmtPiecesTileTheGroups) {
  for (int groups = 1; groups <= 128; ++groups) {
    const int pieces = epx::kernels::logfmt_row_pieces(groups);
    expect_tiling(groups, pieces);
    for (int p = 0; p < pieces; ++p) {
      const WordRange range = epx::kernels::piece_words(groups, p, pieces);
      EXPECT_LE(range.end - range.begin, epx::kernels::kLogfmtPieceGroups) << groups;
      EXPECT_GT(range.end - range.begin, 0) << groups << " groups, piece " << p;
    }
  }
  EXPECT_EQ(epx::kernels::logfmt_row_pieces(56), 7);  // hidden 7168
  EXPECT_EQ(epx::kernels::logfmt_row_pieces(8), 1);
}

// Every (piece, share) range of a spread send (shares: a pre-reduced send's rows of one token) covers each
// unit of the row once, whatever the share count.
TEST(WorkSplit, SpreadPiecesAndSharesTileTheRow) {
  using epx::kernels::spread_row_pieces;
  for (const int units : {1, 4, 21, 28, 56, 896}) {
    for (const int rows : {0, 1, 8, 100, 1024, 100000}) {
      const int base = units >= 2 ? 2 : 1;
      const int pieces = spread_row_pieces(base, rows, 132 * 16, units);
      EXPECT_GE(pieces, base);
      EXPECT_LE(pieces, std::max(base, units));
      if (rows > 0 && pieces > base) {
        EXPECT_LE(int64_t(rows) * pieces, 132 * 16);
      }
      for (int shares = 1; shares <= 16; ++shares) {
        std::vector<int> covered(units, 0);
        for (int piece = 0; piece < pieces; ++piece) {
          const WordRange p = epx::kernels::piece_words(units, piece, pieces);
          for (int share = 0; share < shares; ++share) {
            const WordRange part = epx::kernels::piece_words(p.end - p.begin, share, shares);
            for (int u = p.begin + part.begin; u < p.begin + part.end; ++u) ++covered[u];
          }
        }
        for (int u = 0; u < units; ++u) EXPECT_EQ(covered[u], 1) << units << " units, unit " << u;
      }
    }
  }
  EXPECT_EQ(spread_row_pieces(2, 8, 132 * 16, 28), 28);    // 1 token, top-8, BF16 hidden 7168
  EXPECT_EQ(spread_row_pieces(2, 1024, 132 * 16, 28), 2);  // 128 tokens: the plain split
  EXPECT_EQ(spread_row_pieces(7, 8, 132 * 16, 56), 56);    // 1 token, LogFMT: a group per warp
  EXPECT_EQ(spread_row_pieces(7, 1024, 132 * 16, 56), 7);  // 128 tokens: 8 groups per piece
}

TEST(WorkSplit, DispatchPublishersAreTheSendersAndTheRouter) {
  for (int blocks : {1, 2, 3, 132}) {
    for (int tokens : {0, 1, 2, blocks - 2, blocks - 1, blocks, blocks + 5, 4 * blocks}) {
      if (tokens < 0) continue;
      int publishing = 0;
      for (int b = 0; b < blocks; ++b) {
        const epx::kernels::Publishers p = epx::kernels::dispatch_publishers(tokens, blocks, b);
        // Block b sends tokens b, b + blocks, ...; the last block routes; block 0 posts the shapes.
        const bool writes = b < tokens || b == blocks - 1 || b == 0;
        EXPECT_EQ(p.this_block, writes) << tokens << " tokens, block " << b << " of " << blocks;
        publishing += p.this_block;
        EXPECT_EQ(p.count, epx::kernels::dispatch_publishers(tokens, blocks, 0).count);
      }
      EXPECT_EQ(epx::kernels::dispatch_publishers(tokens, blocks, 0).count, publishing)
          << tokens << " tokens, " << blocks << " blocks";
    }
  }
}

TEST(WorkSplit, PublishSharesMakeTheFlagReachEachTargetOnlyWhenAllLanded) {
  using epx::kernels::flag_target;
  using epx::kernels::Publishers;
  // Dispatch's publishers by tokens, combine's by row pieces: both kernels publish with these shares.
  const auto publishers_of = [](bool dispatch, int work, int blocks, int block) -> Publishers {
    return dispatch ? epx::kernels::dispatch_publishers(work, blocks, block)
                    : epx::kernels::combine_publishers(work, blocks, block);
  };
  for (const bool dispatch : {true, false}) {
    for (int blocks : {1, 2, 132}) {
      for (int work : {0, 1, 7, 500}) {
        const Publishers p = publishers_of(dispatch, work, blocks, 0);
        // Operations from near the start and across the 2^32 wrap of the flag.
        for (const int first_op : {1, (1 << 20) - 3}) {
          int flag = flag_target(first_op - 1);
          for (int op = first_op; op < first_op + 6; ++op) {
            int landed = 0;
            for (int b = 0; b < blocks; ++b) {
              if (!publishers_of(dispatch, work, blocks, b).this_block) continue;
              EXPECT_FALSE(epx::counter_reached(flag, flag_target(op))) << "op " << op << " after " << landed;
              EXPECT_TRUE(epx::counter_reached(flag, flag_target(op - 1))) << "op " << op;
              flag = static_cast<int>(static_cast<uint32_t>(flag) +
                                      static_cast<uint32_t>(epx::kernels::publish_share(b, p)));
              ++landed;
            }
            EXPECT_EQ(landed, p.count);
            EXPECT_EQ(flag, flag_target(op)) << (dispatch ? "dispatch" : "combine") << ", op " << op << ", "
                                             << blocks << " blocks, " << work << " tokens or pieces";
            EXPECT_TRUE(epx::counter_reached(flag, flag_target(op)));
            EXPECT_FALSE(epx::counter_reached(flag, flag_target(op + 1)));
          }
        }
      }
    }
  }
}

TEST(WorkSplit, ItemsGoToBlocksFirstAndEachOnce) {
  constexpr int kWarps = 16;
  for (int blocks : {1, 2, 132}) {
    for (int items : {0, 1, 15, 131, 132, 133, blocks * kWarps, blocks * kWarps + 1, 5 * blocks * kWarps}) {
      std::vector<int> seen(items, 0);
      std::vector<int> per_block(blocks, 0);
      for (int b = 0; b < blocks; ++b) {
        for (int w = 0; w < kWarps; ++w) {
          // The kernels' walk.
          for (int item = epx::kernels::first_item(b, w, blocks); item < items; item += blocks * kWarps) {
            ++seen[item];
            ++per_block[b];
          }
        }
      }
      for (int item = 0; item < items; ++item) EXPECT_EQ(seen[item], 1) << item << " of " << items;
      // Spread: no block holds two more items than another.
      const auto [lo, hi] = std::minmax_element(per_block.begin(), per_block.end());
      EXPECT_LE(*hi - *lo, 1) << items << " items over " << blocks << " blocks";
    }
  }
}

TEST(WorkSplit, CombinePublishersAreTheBlocksHoldingPieces) {
  constexpr int kWarps = 16;
  for (int blocks : {1, 2, 132}) {
    for (int items : {0, 1, 15, 16, 17, 100, blocks * kWarps, blocks * kWarps + 1, 5 * blocks * kWarps}) {
      std::vector<bool> holds(blocks, false);
      for (int b = 0; b < blocks; ++b) {
        for (int w = 0; w < kWarps; ++w)
          holds[b] = holds[b] || epx::kernels::first_item(b, w, blocks) < items;
      }
      holds[0] = true;  // posts the shapes
      int publishing = 0;
      for (int b = 0; b < blocks; ++b) {
        const epx::kernels::Publishers p = epx::kernels::combine_publishers(items, blocks, b);
        EXPECT_EQ(p.this_block, holds[b]) << items << " items, block " << b << " of " << blocks;
        publishing += p.this_block;
      }
      EXPECT_EQ(epx::kernels::combine_publishers(items, blocks, 0).count, publishing);
    }
  }
}

TEST(WorkSplit, ReducePartsCoverEveryChunkOnce) {
  for (int chunks : {16, 896, 1024, 2048}) {
    for (int tokens : {1, 2, 66, 67, 128, 1000}) {
      const int parts = epx::kernels::reduce_parts(tokens, 132, chunks);
      EXPECT_GE(parts, 1);
      EXPECT_LE(parts * tokens, tokens > 132 ? parts * tokens : 132) << "more parts than blocks";
      expect_tiling(chunks, parts);
    }
  }
  // hidden 7168: one token over 28 blocks of a warp's 32 chunks; a full grid's worth of tokens unsplit.
  EXPECT_EQ(epx::kernels::reduce_parts(1, 132, 896), 28);
  EXPECT_EQ(epx::kernels::reduce_parts(8, 132, 896), 16);
  EXPECT_EQ(epx::kernels::reduce_parts(128, 132, 896), 1);
  EXPECT_EQ(epx::kernels::reduce_parts(0, 132, 896), 1);
}

}  // namespace
