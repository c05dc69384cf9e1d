#pragma once

// The bytes the benchmarks count, so `epx-bench`, its CPU reference run and `python -m epx_tools.bench`
// report the same GB/s (= bytes / time) for the same run.
namespace epx {

enum class WireFormat { kBf16, kFp8, kLogFmt };

// One row a rank receives in a normal-mode dispatch: 2H for BF16, H + 4H/128 (the float32 scales) for FP8.
// Combine counts the bytes of the BF16 dispatch it returns.
constexpr double normal_row_bytes(int hidden, bool fp8) {
  return fp8 ? hidden + 4.0 * hidden / 128 : 2.0 * hidden;
}

// Normal mode across nodes: the rows a rank sends over the network in a dispatch, and receives back over it
// in the combine: each token once per node other than the rank's own that holds one of its experts, however
// many ranks of that node need it (its rail peer there forwards it over NVLink). `num_tokens_per_node[n]` is
// get_dispatch_layout's num_tokens_per_rdma_rank (a token counted once per node it goes to). The network
// bytes are these rows x normal_row_bytes; the network bandwidth is those bytes / time.
constexpr double internode_network_rows(const int* num_tokens_per_node, int num_nodes, int own_node) {
  double rows = 0;
  for (int n = 0; n < num_nodes; ++n) {
    if (n != own_node) rows += num_tokens_per_node[n];
  }
  return rows;
}

// One valid (token, expert) selection of low-latency mode: FP8 codes, their scales and 16 bytes of metadata;
// a BF16 row; or LogFMT-10 codes (1.25 H) with their per-group metadata (H/32).
constexpr double low_latency_selection_bytes(int hidden, WireFormat format) {
  switch (format) {
    case WireFormat::kFp8:
      return hidden + hidden / 32.0 + 16;
    case WireFormat::kBf16:
      return 2.0 * hidden;
    case WireFormat::kLogFmt:
      return 1.25 * hidden + hidden / 32.0;
  }
  return 0;
}

}  // namespace epx
