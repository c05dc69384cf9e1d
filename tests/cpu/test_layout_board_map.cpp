#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "buffer_map/layout_board_map.hpp"
#include "common/tagged_word.hpp"

namespace {

using epx::LayoutBoardMap;
using epx::Posted;
using epx::PostedCounts;

// Every (destination, parity, source, word) has its own word, inside the board, and a destination's row
// (both halves) is one contiguous range.
TEST(LayoutBoardMap, SlotsAreDisjointAndRowsContiguous) {
  for (int ranks : {1, 2, 3, 4, 8}) {
    const LayoutBoardMap map{ranks};
    const int words = map.words_per_source();
    EXPECT_GE(words, 2 + epx::kMaxExperts / ranks);  // the counts of any expert count, and the mark
    EXPECT_EQ(map.mark_word(), words - 1);
    std::set<size_t> seen;
    for (int dest = 0; dest < ranks; ++dest) {
      for (uint32_t sequence : {1u, 2u}) {
        for (int src = 0; src < ranks; ++src) {
          for (int w = 0; w < words; ++w) {
            const size_t word = map.slot(dest, sequence, src) + w;
            EXPECT_LT(word, map.num_words());
            EXPECT_GE(word, map.row(dest, 0));
            EXPECT_LT(word, map.row(dest, 0) + map.row_words());
            EXPECT_TRUE(seen.insert(word).second) << "ranks " << ranks << " dest " << dest << " src " << src;
          }
        }
      }
    }
    EXPECT_EQ(seen.size(), map.num_words());
    EXPECT_EQ(map.num_bytes(), map.num_words() * sizeof(uint64_t));
    // Sequences of one parity share a half; the next sequence uses the other.
    EXPECT_EQ(map.row(ranks - 1, 3), map.row(ranks - 1, 5));
    EXPECT_NE(map.row(ranks - 1, 3), map.row(ranks - 1, 4));
  }
}

// What the layouts of R ranks post for random counts, read back by each destination: the rows per source,
// their sum and the aligned per-expert sums, as notify computes them; nothing until every source posted
// every word under the sequence.
TEST(LayoutBoardMap, ReadsBackWhatEverySourcePosted) {
  std::mt19937 rng(7);
  for (int ranks : {1, 2, 4, 8}) {
    for (int experts_per_rank : {1, 3, 32}) {
      for (int alignment : {1, 4, 128}) {
        const LayoutBoardMap map{ranks};
        const int num_experts = ranks * experts_per_rank;
        const uint32_t sequence = 1 + rng() % 1000;
        std::vector<uint64_t> board(map.num_words(), epx::pack_tagged(sequence - 1, 99));
        // per_rank[s][d], per_expert[s][e]: what source s's layout counted.
        std::vector<std::vector<int>> per_rank(ranks, std::vector<int>(ranks));
        std::vector<std::vector<int>> per_expert(ranks, std::vector<int>(num_experts));
        for (int s = 0; s < ranks; ++s) {
          for (int& v : per_rank[s]) v = static_cast<int>(rng() % 5000);
          for (int& v : per_expert[s]) v = rng() % 4 == 0 ? 0 : static_cast<int>(rng() % 300);
        }
        // Posts as the layout kernel does, with each source host's mark that its counts hold; the
        // destinations read only complete halves.
        for (int s = 0; s < ranks; ++s) {
          for (int d = 0; d < ranks; ++d) {
            uint64_t* slot = board.data() + map.slot(d, sequence, s);
            slot[map.mark_word()] = epx::pack_tagged(sequence, epx::kPostedCountsHold);
            slot[0] = epx::pack_tagged(sequence, per_rank[s][d]);
            for (int le = 0; le < experts_per_rank; ++le)
              slot[1 + le] = epx::pack_tagged(sequence, per_expert[s][d * experts_per_rank + le]);
          }
        }
        for (int d = 0; d < ranks; ++d) {
          PostedCounts counts{};
          std::vector<int> experts(experts_per_rank, -1);
          const uint64_t* half = board.data() + map.row(d, sequence);
          ASSERT_EQ(epx::read_posted_counts(half, map, sequence, experts_per_rank, alignment, counts,
                                            experts.data()),
                    Posted::kAll);
          int rows = 0;
          for (int s = 0; s < ranks; ++s) {
            EXPECT_EQ(counts.rows_from[s], per_rank[s][d]);
            rows += per_rank[s][d];
          }
          EXPECT_EQ(counts.rows, rows);
          for (int le = 0; le < experts_per_rank; ++le) {
            int sum = 0;
            for (int s = 0; s < ranks; ++s) sum += per_expert[s][d * experts_per_rank + le];
            EXPECT_EQ(experts[le], (sum + alignment - 1) / alignment * alignment);
          }
          // Without the per-expert counts only the rows are read.
          EXPECT_EQ(
              epx::read_posted_counts(half, map, sequence, experts_per_rank, alignment, counts, nullptr),
              Posted::kAll);
          // A half of another sequence is not this call's.
          EXPECT_EQ(epx::read_posted_counts(half, map, sequence + 2, experts_per_rank, alignment, counts,
                                            experts.data()),
                    Posted::kPending);
        }
        // One word of the last source missing (an expert count, a row count, its mark): nothing is read.
        for (int word : {experts_per_rank, 0, map.mark_word()}) {
          uint64_t& last = board[map.slot(0, sequence, ranks - 1) + word];
          const uint64_t kept = last;
          last = epx::pack_tagged(sequence - 1, 0);
          PostedCounts counts{};
          std::vector<int> experts(experts_per_rank);
          EXPECT_EQ(epx::read_posted_counts(board.data() + map.row(0, sequence), map, sequence,
                                            experts_per_rank, alignment, counts, experts.data()),
                    Posted::kPending);
          last = kept;
        }
        // A source whose mark says its counts do not hold: the counts never come from the board, even with
        // its words there (a mark of another sequence holds nothing either way).
        uint64_t& mark = board[map.slot(ranks - 1, sequence, ranks - 1) + map.mark_word()];
        mark = epx::pack_tagged(sequence + 2, epx::kNothingPosted);
        PostedCounts counts{};
        EXPECT_EQ(epx::read_posted_counts(board.data() + map.row(ranks - 1, sequence), map, sequence,
                                          experts_per_rank, alignment, counts, nullptr),
                  Posted::kPending);
        mark = epx::pack_tagged(sequence, epx::kNothingPosted);
        EXPECT_EQ(epx::read_posted_counts(board.data() + map.row(ranks - 1, sequence), map, sequence,
                                          experts_per_rank, alignment, counts, nullptr),
                  Posted::kNone);
      }
    }
  }
}

}  // namespace
