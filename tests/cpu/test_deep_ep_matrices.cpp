// DeepEP's intranode handle matrices as the notify kernel derives them from recv_channel_offset
// (src/kernels/deep_ep_matrices.hpp): worked examples, and every entry against its definition on random
// counts.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "kernels/deep_ep_matrices.hpp"

namespace {

using epx::kernels::deep_ep_matrices_entry;
using epx::kernels::deep_ep_matrices_size;

std::vector<int> matrices(const std::vector<int>& offsets, int num_ranks, int num_channels, int rank) {
  std::vector<int> out(deep_ep_matrices_size(num_ranks, num_channels));
  for (int i = 0; i < static_cast<int>(out.size()); ++i) {
    out[i] = deep_ep_matrices_entry(i, offsets.data(), num_ranks, num_channels, rank);
  }
  return out;
}

TEST(DeepEpMatrices, RankOneOfTwoWithThreeChannels) {
  // Source 0 sends 2, 0, 3 rows on its channels; source 1 sends 1, 3, 2.
  const std::vector<int> offsets = {0, 2, 2, 5, 6, 9, 11};
  const std::vector<int> expected = {
      -1, 5,  -1, 11,          // rank_prefix_matrix: column 1 holds rows from sources 0..i
      -1, -1, -1, -1, -1, -1,  // channel_prefix_matrix: not kept
      0,  2,  2,  0,  1,  4};  // recv_channel_prefix_matrix: from each source's first row
  EXPECT_EQ(matrices(offsets, 2, 3, 1), expected);
}

TEST(DeepEpMatrices, OneRankOneChannelNoRows) {
  EXPECT_EQ(matrices({0, 0}, 1, 1, 0), (std::vector<int>{0, -1, 0}));
}

TEST(DeepEpMatrices, RandomCountsMatchTheirDefinition) {
  std::mt19937 random(7);
  for (int num_ranks : {1, 2, 3, 8}) {
    for (int num_channels : {1, 5, 12}) {
      // Counts per (source, channel), a few zero; offsets are their exclusive scan, source-major.
      std::vector<int> offsets(num_ranks * num_channels + 1, 0);
      for (int cell = 0; cell < num_ranks * num_channels; ++cell) {
        offsets[cell + 1] = offsets[cell] + static_cast<int>(random() % 4 == 0 ? 0 : random() % 50);
      }
      for (int rank = 0; rank < num_ranks; ++rank) {
        const std::vector<int> got = matrices(offsets, num_ranks, num_channels, rank);
        int index = 0;
        for (int i = 0; i < num_ranks; ++i) {
          int rows_through_i = 0;
          for (int cell = 0; cell < (i + 1) * num_channels; ++cell)
            rows_through_i += offsets[cell + 1] - offsets[cell];
          for (int j = 0; j < num_ranks; ++j) EXPECT_EQ(got[index++], j == rank ? rows_through_i : -1);
        }
        for (int cell = 0; cell < num_ranks * num_channels; ++cell) EXPECT_EQ(got[index++], -1);
        for (int r = 0; r < num_ranks; ++r) {
          int rows_before = 0;
          for (int c = 0; c < num_channels; ++c) {
            EXPECT_EQ(got[index++], rows_before);
            rows_before += offsets[r * num_channels + c + 1] - offsets[r * num_channels + c];
          }
        }
      }
    }
  }
}

}  // namespace
