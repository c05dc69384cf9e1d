#pragma once

#include <cstdint>
#include <vector>

#include "formats/scale_format.hpp"

// Normal (high-throughput) mode reference: dispatch and combine over R simulated ranks.
namespace epx::reference {

// The rows' scale format. Normal mode carries rows already cast, so every format is moved unchanged: the
// BF16 rows in x, the others' row_bytes(H) bytes in x_fp8 and scale_words(H) words in x_scales.
using PayloadFormat = ScaleFormat;

struct NormalDispatchParams {
  int num_ranks = 0;
  int num_experts = 0;  // E, a multiple of num_ranks; L = E / R experts per rank
  int hidden = 0;       // H; a multiple of the format's group size
  PayloadFormat format = PayloadFormat::kBf16;
  // true: routing comes from topk_idx/topk_weights; false: from is_token_in_rank, and the recv top-k outputs
  // are empty.
  bool with_topk = true;
  int num_topk = 0;  // K (with_topk only)
  int expert_alignment = 1;
  int num_worst_tokens =
      0;  // > 0: every rank's output has exactly this many rows (see NormalDispatchRankOutput)
};

// One source rank's dispatch input.
struct NormalDispatchRankInput {
  int num_tokens = 0;                     // T (may differ per rank)
  std::vector<uint16_t> x;                // kBf16: [T, H]
  std::vector<uint8_t> x_fp8;             // cast formats: [T, row_bytes(H)] (e4m3 codes), carried unchanged
  std::vector<float> x_scales;            // cast formats: [T, scale_words(H)] words, carried unchanged
  std::vector<int64_t> topk_idx;          // with_topk: [T, K] global expert ids, -1 = none
  std::vector<float> topk_weights;        // with_topk: [T, K]
  std::vector<uint8_t> is_token_in_rank;  // without topk: [T, R] 0/1 (required); with topk: empty or equal to
                                          // what get_dispatch_layout derives
  // Without topk, optional [E] (from get_dispatch_layout): feeds num_recv_tokens_per_expert_list. Either
  // every rank gives it or none does.
  std::vector<int> num_tokens_per_expert;
};

// What one destination rank receives.
//
// Row order: by source rank, then source token index; a token appears once on every rank holding at least
// one of its experts (however many of them live there).
// Worst-case mode (num_worst_tokens > 0): num_rows = num_worst_tokens; rows >= num_recv_tokens are padding
// with recv_topk_idx -1, recv_topk_weights 0, recv_src_rank -1, recv_src_token_idx -1; their x / scales
// are unspecified (zeros here). It is an error (epx::Error) for a rank to receive more than num_worst_tokens.
struct NormalDispatchRankOutput {
  int num_recv_tokens = 0;               // N: real rows
  int num_rows = 0;                      // rows of every per-row output: N, or num_worst_tokens
  std::vector<uint16_t> recv_x;          // kBf16: [rows, H]
  std::vector<uint8_t> recv_x_fp8;       // cast formats: [rows, row_bytes(H)]
  std::vector<float> recv_x_scales;      // cast formats: [rows, scale_words(H)]
  std::vector<int64_t> recv_topk_idx;    // with_topk: [rows, K] local ids (global - rank * L), -1 elsewhere
  std::vector<float> recv_topk_weights;  // with_topk: [rows, K], 0 where recv_topk_idx is -1
  // [L] tokens received for each local expert (rows whose top-k lists it), each rounded up to
  // expert_alignment. Empty in worst-case mode, and without topk when no num_tokens_per_expert was given.
  std::vector<int> num_recv_tokens_per_expert_list;
  std::vector<int> recv_src_rank;             // [rows] source rank of each row, -1 for padding
  std::vector<int> recv_src_token_idx;        // [rows] token index on the source rank, -1 for padding
  std::vector<int> num_recv_tokens_per_rank;  // [R] rows from each source rank
  std::vector<int> recv_rank_prefix;          // [R + 1] rows from source s are [prefix[s], prefix[s + 1])
};

// The facts combine needs (the "handle").
struct NormalHandle {
  int num_ranks = 0;
  int hidden = 0;
  std::vector<int> num_tokens;  // [R] tokens each rank dispatched = rows of its combine output
  std::vector<int> num_rows;    // [R] rows of each rank's dispatch output (= combine input rows)
  // recv_row[s][t * R + d]: the row token t of source s occupies on destination d, -1 if not sent there.
  std::vector<std::vector<int>> recv_row;
};

struct NormalDispatchResult {
  std::vector<NormalDispatchRankOutput> ranks;  // [R], indexed by destination rank
  NormalHandle handle;
};

// Throws epx::Error (naming the argument) on any inconsistent input.
NormalDispatchResult normal_dispatch(const NormalDispatchParams& params,
                                     const std::vector<NormalDispatchRankInput>& inputs);

struct NormalCombineParams {
  int num_topk = 0;    // columns of topk_weights; 0: no weights to reduce
  int num_biases = 0;  // 0, 1 or 2
};

// One rank's combine input: it is both the expert-holding rank (x, topk_weights, in its dispatch output row
// order) and the original owner of its tokens (bias).
struct NormalCombineRankInput {
  std::vector<uint16_t> x;          // [rows, H] BF16; padding rows are ignored
  std::vector<float> topk_weights;  // [rows, K] when num_topk > 0; padding rows are ignored
  std::vector<uint16_t> bias0;      // [T, H] BF16 when num_biases >= 1
  std::vector<uint16_t> bias1;      // [T, H] BF16 when num_biases == 2
};

struct NormalCombineRankOutput {
  std::vector<uint16_t> combined_x;          // [T, H] BF16
  std::vector<float> combined_topk_weights;  // [T, K] when num_topk > 0
};

// For each original token, in float32:
//   acc = -0.0f; for each destination d ascending that received the token: acc += float(x_d[row]);
//   acc += float(bias0[t]); acc += float(bias1[t]); combined_x = round_to_nearest_even_bf16(acc)
// (no weights applied). -0.0f is the identity of float addition, so the sum is exactly its terms added left
// to right; a token with exactly one source (one copy, or no copy and one bias) is that source bit for bit
// (NaN payloads included), and a token with none (sent nowhere, no bias) is +0.0.
// combined_topk_weights[t][k] = +0.0f + the received weights of every such d, ascending; this gives back the
// original weight of each kept expert (0 where the id was -1).
std::vector<NormalCombineRankOutput> normal_combine(const NormalHandle& handle,
                                                    const NormalCombineParams& params,
                                                    const std::vector<NormalCombineRankInput>& inputs);

}  // namespace epx::reference
