#pragma once

#include "common/host_device.hpp"

// DeepEP's intranode handle matrices, derived from a dispatch's recv_channel_offset by its count exchange
// (the notify kernel writes them next to the offsets: DispatchHandle::deep_ep_matrices_device), so that the
// deep_ep layer builds its handle tuple from views. Plain arithmetic shared by the kernel and the CPU tests
// (tests/cpu/test_deep_ep_matrices.cpp). The block, int32, R ranks, C channels:
//   [R, R] rank_prefix_matrix: [i][j] = rows rank j receives from ranks 0..i; EPX knows the column of this
//   rank
//          only (its own receive counts), -1 elsewhere;
//   [R, C] channel_prefix_matrix: -1 (the senders' side, which EPX does not keep: send_head serves it);
//   [R, C] recv_channel_prefix_matrix: [r][c] = first row of source r's channel c, counted from r's first
//   row.
namespace epx::kernels {

EPX_HD int deep_ep_matrices_size(int num_ranks, int num_channels) {
  return num_ranks * num_ranks + 2 * num_ranks * num_channels;
}

// Entry `index` of the block, from `offsets` ([R * C + 1]: first received row of each (source, channel),
// source-major, then the row count).
EPX_HD int deep_ep_matrices_entry(int index, const int* offsets, int num_ranks, int num_channels, int rank) {
  const int rank_cells = num_ranks * num_ranks;
  if (index < rank_cells) {
    // Rows from sources 0..i end where source i + 1 begins.
    return index % num_ranks == rank ? offsets[(index / num_ranks + 1) * num_channels] : -1;
  }
  index -= rank_cells;
  const int channel_cells = num_ranks * num_channels;
  if (index < channel_cells) return -1;
  index -= channel_cells;
  return offsets[index] - offsets[index - index % num_channels];
}

}  // namespace epx::kernels
