#pragma once

#include <cstdint>
#include <vector>

#include "formats/scale_format.hpp"

// Low-latency mode reference: dispatch into the fixed per-expert layout [L, R*M, H] and the weighted combine.
//
// Rows: a token that chose local expert le (of rank d) occupies one row of le's block on rank d. A token that
// lists the same expert twice in its top-k is still ONE row (its first listing's), like the normal mode's
// counts; combine then applies each listing's weight to that row. So no (source, expert) pair holds more than
// T <= M rows and recv_count[le] <= R*M.
// Block order: rows of expert le are packed from row 0: source rank 0's tokens in ascending token index,
// then source rank 1's, ... recv_src_begin/recv_src_count give each source's range.
namespace epx::reference {

struct LowLatencyParams {
  int num_ranks = 0;
  int num_experts = 0;                       // E, a multiple of num_ranks; L = E / R
  int hidden = 0;                            // H; a multiple of 128 for FP8 and LogFMT
  int num_topk = 0;                          // K >= 1
  int num_max_dispatch_tokens_per_rank = 0;  // M >= 1; every rank needs T <= M
  // Rank masks: ranks that every other rank has masked (Buffer low-latency masks). A masked rank's traffic is
  // left out: its tokens reach nobody, its experts receive nothing, and a top-k entry naming one of its
  // experts counts as -1 in dispatch and combine. A masked rank's own outputs are all empty (it takes no
  // part in the call). Empty: no rank is masked.
  std::vector<int> masked_ranks;
};

// Whether `rank` is in params.masked_ranks.
bool ll_is_masked(const LowLatencyParams& params, int rank);

// The scale format, named by the API's flags (use_fp8, round_scale, use_ue8m0).
using LowLatencyDispatchOptions = LowLatencyFormatFlags;

struct LowLatencyDispatchRankInput {
  int num_tokens = 0;             // T <= M
  std::vector<uint16_t> x;        // [T, H] BF16
  std::vector<int64_t> topk_idx;  // [T, K] global ids, -1 = none
};

// Words of packed UE8M0 scales per row: ceil((H / 128) / 4). When H / 128 is not a multiple of 4 the unused
// bytes of the last word are 0.
int ll_num_ue8m0_words(int hidden);

// Rows per expert block: num_ranks * M.
inline int ll_num_rows_per_expert(const LowLatencyParams& params) {
  return params.num_ranks * params.num_max_dispatch_tokens_per_rank;
}

// What one rank receives. Unused rows (row >= recv_count[le]) have zero payload and zero scales here (the
// GPU leaves them unspecified) and recv_src_rank / recv_src_token_idx -1.
struct LowLatencyDispatchRankOutput {
  std::vector<uint16_t> recv_x;     // !use_fp8: [L, R*M, H] BF16 (the input rows, unchanged)
  std::vector<uint8_t> recv_x_fp8;  // use_fp8: [L, R*M, H] e4m3 of quantize_fp8_row(x, round_scale)
  // use_fp8 && !use_ue8m0: [L * (H/128) * R*M] floats, scale of (le, row, group) at
  // ll_scale_index(le, row, group, R*M, H/128).
  std::vector<float> recv_x_scales;
  // use_ue8m0: [L * W * R*M] words (W = ll_num_ue8m0_words(H)), word w of (le, row) at
  // ll_scale_index(le, row, w, R*M, W); group 4w+j in byte j (pack_ue8m0x4).
  std::vector<uint32_t> recv_x_scales_ue8m0;
  std::vector<int> recv_count;          // [L] valid rows of each expert block
  std::vector<int> recv_src_begin;      // [L, R] first row from source s in expert le's block
  std::vector<int> recv_src_count;      // [L, R] rows from source s
  std::vector<int> recv_src_rank;       // [L, R*M] source rank of each row, -1 unused
  std::vector<int> recv_src_token_idx;  // [L, R*M] token index on the source rank, -1 unused
};

// cumulative_local_expert_recv_stats, when given, is [R][L] and each rank's recv_count is added to it.
// Throws epx::Error on inconsistent inputs (T > M, bad ids, use_ue8m0 without round_scale, ...).
std::vector<LowLatencyDispatchRankOutput> low_latency_dispatch(
    const LowLatencyParams& params, const LowLatencyDispatchOptions& options,
    const std::vector<LowLatencyDispatchRankInput>& inputs,
    std::vector<std::vector<int>>* cumulative_local_expert_recv_stats = nullptr);

// Where each (token, k) of every source rank sits in the receivers' layout, a pure function of the routing:
// recv_row[s][t * K + k] = row inside the block of local expert (id % L) on rank id / L, or -1 when the id
// is -1 or the source or destination rank is masked. Duplicate listings share the first listing's row.
std::vector<std::vector<int>> low_latency_recv_rows(const LowLatencyParams& params,
                                                    const std::vector<const int64_t*>& topk_idx_per_rank,
                                                    const std::vector<int>& num_tokens_per_rank);

struct LowLatencyCombineOptions {
  // Each expert output row that crosses nodes travels as LogFMT-10 per 128 channels: the value weighted is
  // logfmt_decode_group(logfmt_encode_group(row group)) as a float (not re-rounded to BF16). Rows between
  // ranks of one node travel as BF16 unless logfmt_within_node. Nodes are runs of `ranks_per_node`
  // consecutive ranks (0: every rank is on one node).
  bool use_logfmt = false;
  bool logfmt_within_node = false;
  int ranks_per_node = 0;
  // Pre-reduced combine (opt-in; the reference fixes its order, no kernel implements it yet): the rank that
  // holds a token's experts first sums the token's weighted rows over its own experts, in top-k order, in
  // float from 0.0f, and sends that partial row once, rounded to BF16 (then LogFMT-coded with use_logfmt);
  // the token's owner sums the partial rows of the ranks its experts lie on in ascending rank order, in float
  // from 0.0f, and rounds once to BF16. One row per (token, rank) crosses instead of one per (token, expert).
  // With several experts on one rank the roundings differ from the default's (one sum in top-k order over
  // every expert), so the two agree bit for bit only where every partial sum is exact in BF16.
  bool pre_reduce = false;
};

// One rank's combine input: it holds experts (x, in its own dispatch layout) and owns tokens (routing).
struct LowLatencyCombineRankInput {
  int num_tokens = 0;               // T, as in the dispatch
  std::vector<uint16_t> x;          // [L, R*M, H] BF16 expert outputs; unused rows are ignored
  std::vector<int64_t> topk_idx;    // [T, K] the same ids this rank dispatched with
  std::vector<float> topk_weights;  // [T, K]
};

struct LowLatencyCombineRankOutput {
  std::vector<uint16_t> combined_x;  // [T, H] BF16
};

// combined_x[t] = round_to_nearest_even_bf16(acc) with, in float32:
//   acc = +0.0f; for k = 0 .. K-1 with topk_idx[t][k] != -1 (and its rank unmasked):
//     acc += topk_weights[t][k] * v(row of (t, k))
// written as a plain multiply then add (the GPU may fuse them into an FMA: compare with a tolerance).
// Tokens with no expert get zeros.
std::vector<LowLatencyCombineRankOutput> low_latency_combine(
    const LowLatencyParams& params, const LowLatencyCombineOptions& options,
    const std::vector<LowLatencyCombineRankInput>& inputs);

}  // namespace epx::reference
