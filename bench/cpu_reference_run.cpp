#include "cpu_reference_run.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "bench_bytes.hpp"
#include "bench_options.hpp"
#include "formats/bf16.hpp"
#include "formats/fp8.hpp"
#include "reference/layout.hpp"
#include "reference/low_latency.hpp"
#include "reference/normal.hpp"
#include "reference/test_data.hpp"

namespace epx::reference {

namespace {

using Clock = std::chrono::steady_clock;

double elapsed_ms(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// One row of the report. Bytes as the GPU benchmark counts them: normal mode counts the tokens each rank
// receives (one copy per destination rank); low-latency mode counts valid (token, expert) selections.
struct BenchRow {
  std::string op;
  std::string format;
  long long units = 0;  // received rows (normal) or selections (low-latency), all ranks together
  double bytes_per_unit = 0;
  double cpu_ms = 0;
  bool verified = false;
  double total_bytes() const { return static_cast<double>(units) * bytes_per_unit; }
};

struct Routing {
  std::vector<std::vector<int64_t>> topk_idx;  // [R][T * K]
  std::vector<std::vector<float>> topk_weights;
  std::vector<DispatchLayout> layouts;
};

Routing make_routing(int num_ranks, int num_tokens, int num_topk, int num_experts, uint64_t seed) {
  Routing routing;
  for (int r = 0; r < num_ranks; ++r) {
    routing.topk_idx.push_back(random_topk_idx(seed + r, num_tokens, num_topk, num_experts));
    routing.topk_weights.push_back(random_topk_weights(seed + 100 + r, num_tokens, num_topk));
    routing.layouts.push_back(
        get_dispatch_layout(routing.topk_idx[r].data(), num_tokens, num_topk, num_experts, num_ranks));
  }
  return routing;
}

// Every rank got the rows the layouts promise, each one stamped with the (rank, token) it claims to be.
bool check_normal_rows(const NormalDispatchResult& result, const Routing& routing, int hidden, bool bf16) {
  const int num_ranks = static_cast<int>(result.ranks.size());
  for (int d = 0; d < num_ranks; ++d) {
    const NormalDispatchRankOutput& out = result.ranks[d];
    int expected = 0;
    for (int s = 0; s < num_ranks; ++s) expected += routing.layouts[s].num_tokens_per_rank[d];
    if (out.num_recv_tokens != expected) return false;
    int prev_key = -1;
    for (int row = 0; row < out.num_recv_tokens; ++row) {
      const int key = out.recv_src_rank[row] * (1 << 20) + out.recv_src_token_idx[row];
      if (key <= prev_key) return false;  // order by (source rank, token index)
      prev_key = key;
      if (!bf16) continue;
      const Stamp stamp = read_stamp(&out.recv_x[static_cast<size_t>(row) * hidden], hidden);
      if (stamp.src_rank != out.recv_src_rank[row] || stamp.token_idx != out.recv_src_token_idx[row])
        return false;
    }
  }
  return true;
}

long long count_rows(const NormalDispatchResult& result) {
  long long rows = 0;
  for (const NormalDispatchRankOutput& out : result.ranks) rows += out.num_recv_tokens;
  return rows;
}

std::vector<BenchRow> run_normal(const CpuReferenceBenchShape& shape) {
  const int num_ranks = shape.num_ranks;
  const int num_tokens = shape.num_tokens;
  const int hidden = shape.hidden;
  const Routing routing = make_routing(num_ranks, num_tokens, shape.num_topk, shape.num_experts, 1000);
  std::vector<NormalDispatchRankInput> inputs(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    inputs[r].num_tokens = num_tokens;
    inputs[r].x = random_bf16_tokens(2000 + r, num_tokens, hidden, r);  // small integers: exact sums
    inputs[r].topk_idx = routing.topk_idx[r];
    inputs[r].topk_weights = routing.topk_weights[r];
  }
  NormalDispatchParams params;
  params.num_ranks = num_ranks;
  params.num_experts = shape.num_experts;
  params.hidden = hidden;
  params.num_topk = shape.num_topk;

  std::vector<BenchRow> rows;
  // FP8 first, so its buffers are gone before the BF16 ones are allocated.
  {
    std::vector<NormalDispatchRankInput> fp8_inputs(num_ranks);
    for (int r = 0; r < num_ranks; ++r) {
      const Fp8Tokens tokens = random_fp8_tokens(3000 + r, num_tokens, hidden, r);
      fp8_inputs[r].num_tokens = num_tokens;
      fp8_inputs[r].x_fp8 = tokens.x;
      fp8_inputs[r].x_scales = tokens.scales;
      fp8_inputs[r].topk_idx = routing.topk_idx[r];
      fp8_inputs[r].topk_weights = routing.topk_weights[r];
    }
    NormalDispatchParams fp8_params = params;
    fp8_params.format = PayloadFormat::kFp8;
    const Clock::time_point start = Clock::now();
    const NormalDispatchResult result = normal_dispatch(fp8_params, fp8_inputs);
    BenchRow row{"normal dispatch", "fp8", count_rows(result), normal_row_bytes(hidden, true),
                 elapsed_ms(start), false};
    row.verified = check_normal_rows(result, routing, hidden, false);
    for (int d = 0; d < num_ranks && row.verified; ++d) {
      const NormalDispatchRankOutput& out = result.ranks[d];
      for (int i = 0; i < out.num_recv_tokens && row.verified; ++i) {
        const std::vector<uint8_t>& src = fp8_inputs[out.recv_src_rank[i]].x_fp8;
        const size_t offset = static_cast<size_t>(out.recv_src_token_idx[i]) * hidden;
        row.verified = std::equal(src.begin() + offset, src.begin() + offset + hidden,
                                  out.recv_x_fp8.begin() + static_cast<size_t>(i) * hidden);
      }
    }
    rows.push_back(row);
  }

  Clock::time_point start = Clock::now();
  NormalDispatchResult result = normal_dispatch(params, inputs);
  BenchRow dispatch_row{"normal dispatch", "bf16", count_rows(result), normal_row_bytes(hidden, false),
                        elapsed_ms(start), false};
  dispatch_row.verified = check_normal_rows(result, routing, hidden, true);
  rows.push_back(dispatch_row);

  std::vector<NormalCombineRankInput> combine(num_ranks);
  for (int d = 0; d < num_ranks; ++d) {
    combine[d].x = std::move(result.ranks[d].recv_x);  // identity experts
    combine[d].topk_weights = std::move(result.ranks[d].recv_topk_weights);
  }
  start = Clock::now();
  const std::vector<NormalCombineRankOutput> combined =
      normal_combine(result.handle, NormalCombineParams{shape.num_topk, 0}, combine);
  BenchRow combine_row{"normal combine",  "bf16", dispatch_row.units, normal_row_bytes(hidden, false),
                       elapsed_ms(start), true};
  // Identity experts: each token comes back times the ranks it went to, exactly (small integers).
  for (int s = 0; s < num_ranks && combine_row.verified; ++s) {
    for (int t = 0; t < num_tokens && combine_row.verified; ++t) {
      float copies = 0;
      for (int d = 0; d < num_ranks; ++d)
        copies += routing.layouts[s].is_token_in_rank[static_cast<size_t>(t) * num_ranks + d];
      for (int c = 0; c < hidden; ++c) {
        const size_t i = static_cast<size_t>(t) * hidden + c;
        if (bf16_to_float(combined[s].combined_x[i]) != bf16_to_float(inputs[s].x[i]) * copies) {
          combine_row.verified = false;
          break;
        }
      }
    }
  }
  rows.push_back(combine_row);
  return rows;
}

std::vector<BenchRow> run_low_latency(const CpuReferenceBenchShape& shape) {
  const int num_ranks = shape.num_ranks;
  const int num_tokens = shape.ll_num_tokens;
  const int hidden = shape.hidden;
  const int num_topk = shape.num_topk;
  LowLatencyParams params;
  params.num_ranks = num_ranks;
  params.num_experts = shape.ll_num_experts;
  params.hidden = hidden;
  params.num_topk = num_topk;
  params.num_max_dispatch_tokens_per_rank = num_tokens;
  const int num_local = params.num_experts / num_ranks;
  const int rows_per_expert = ll_num_rows_per_expert(params);
  const int num_groups = hidden / kFp8GroupSize;

  const Routing routing = make_routing(num_ranks, num_tokens, num_topk, params.num_experts, 4000);
  std::vector<LowLatencyDispatchRankInput> inputs(num_ranks);
  long long selections = 0;
  for (int r = 0; r < num_ranks; ++r) {
    inputs[r].num_tokens = num_tokens;
    inputs[r].x = random_bf16_tokens(5000 + r, num_tokens, hidden, r, TokenValues::kUniform);
    inputs[r].topk_idx = routing.topk_idx[r];
    for (int e : routing.layouts[r].num_tokens_per_expert) selections += e;
  }

  LowLatencyDispatchOptions options;  // FP8, float scales
  Clock::time_point start = Clock::now();
  std::vector<LowLatencyDispatchRankOutput> dispatched = low_latency_dispatch(params, options, inputs);
  BenchRow dispatch_row{
      "low-latency dispatch", "fp8", selections, low_latency_selection_bytes(hidden, WireFormat::kFp8),
      elapsed_ms(start),      true};
  long long received = 0;
  for (const LowLatencyDispatchRankOutput& out : dispatched) {
    for (int count : out.recv_count) received += count;
  }
  dispatch_row.verified = received == selections;
  // Each row holds the FP8 cast of the token it names.
  std::vector<uint8_t> want_x(hidden);
  std::vector<float> want_scales(num_groups);
  for (int d = 0; d < num_ranks && dispatch_row.verified; ++d) {
    const LowLatencyDispatchRankOutput& out = dispatched[d];
    for (int le = 0; le < num_local && dispatch_row.verified; ++le) {
      for (int row = 0; row < out.recv_count[le] && dispatch_row.verified; ++row) {
        const size_t flat = static_cast<size_t>(le) * rows_per_expert + row;
        const LowLatencyDispatchRankInput& src = inputs[out.recv_src_rank[flat]];
        quantize_fp8_row(&src.x[static_cast<size_t>(out.recv_src_token_idx[flat]) * hidden], hidden, false,
                         want_x.data(), want_scales.data());
        dispatch_row.verified =
            std::equal(want_x.begin(), want_x.end(), out.recv_x_fp8.begin() + flat * hidden);
        for (int g = 0; g < num_groups; ++g) {
          const float scale = out.recv_x_scales[ll_scale_index(le, row, g, rows_per_expert, num_groups)];
          dispatch_row.verified = dispatch_row.verified && scale == want_scales[g];
        }
      }
    }
  }

  // Identity experts see the dequantized tokens, as BF16.
  std::vector<LowLatencyCombineRankInput> combine(num_ranks);
  for (int d = 0; d < num_ranks; ++d) {
    const LowLatencyDispatchRankOutput& out = dispatched[d];
    combine[d].num_tokens = num_tokens;
    combine[d].topk_idx = routing.topk_idx[d];
    combine[d].topk_weights = routing.topk_weights[d];
    combine[d].x.assign(out.recv_x_fp8.size(), 0);
    for (int le = 0; le < num_local; ++le) {
      for (int row = 0; row < out.recv_count[le]; ++row) {
        const size_t flat = static_cast<size_t>(le) * rows_per_expert + row;
        for (int c = 0; c < hidden; ++c) {
          const float scale =
              out.recv_x_scales[ll_scale_index(le, row, c / kFp8GroupSize, rows_per_expert, num_groups)];
          combine[d].x[flat * hidden + c] =
              float_to_bf16(e4m3_to_float(out.recv_x_fp8[flat * hidden + c]) * scale);
        }
      }
    }
    dispatched[d] = LowLatencyDispatchRankOutput{};  // [L, R*M, H] per rank is large: free it early
  }
  start = Clock::now();
  const std::vector<LowLatencyCombineRankOutput> combined =
      low_latency_combine(params, LowLatencyCombineOptions{}, combine);
  BenchRow combine_row{
      "low-latency combine", "bf16", selections, low_latency_selection_bytes(hidden, WireFormat::kBf16),
      elapsed_ms(start),     true};
  // sum_k w_k x within the FP8 cast error (1/16 relative + scale/1024) and the BF16 roundings.
  for (int s = 0; s < num_ranks && combine_row.verified; ++s) {
    for (int t = 0; t < num_tokens && combine_row.verified; ++t) {
      for (int c = 0; c < hidden; ++c) {
        double want = 0;
        double magnitude = 0;
        for (int k = 0; k < num_topk; ++k) {
          const size_t i = static_cast<size_t>(t) * num_topk + k;
          if (routing.topk_idx[s][i] < 0) continue;
          const double x = bf16_to_float(inputs[s].x[static_cast<size_t>(t) * hidden + c]);
          want += routing.topk_weights[s][i] * x;
          magnitude += routing.topk_weights[s][i] * std::fabs(x);
        }
        const double got = bf16_to_float(combined[s].combined_x[static_cast<size_t>(t) * hidden + c]);
        if (std::fabs(got - want) > magnitude * 0.08 + 1e-3) {
          combine_row.verified = false;
          break;
        }
      }
    }
  }
  return {dispatch_row, combine_row};
}

void print_table(const CpuReferenceBenchShape& shape, const std::vector<BenchRow>& rows, std::ostream& out) {
  char line[256];
  // The shape of each mode that ran (not the other's), each count in the number it takes ("1 token/rank").
  auto mode_shape = [&](const char* mode, int num_tokens, int num_experts) {
    return std::string(mode) + ": " + bench::count_of(shape.num_ranks, "rank", "ranks") + " x " +
           bench::count_of(num_tokens, "token/rank", "tokens/rank") + ", hidden " +
           std::to_string(shape.hidden) + ", top-" + std::to_string(shape.num_topk) + " of " +
           bench::count_of(num_experts, "expert", "experts");
  };
  std::string header;
  if (shape.with_normal) header = mode_shape("normal", shape.num_tokens, shape.num_experts);
  if (shape.with_low_latency) {
    header +=
        (header.empty() ? "" : " | ") + mode_shape("low-latency", shape.ll_num_tokens, shape.ll_num_experts);
  }
  out << header << "\n";
  // Every count column is per rank (the mean over ranks), as in the GPU report; the JSON adds the totals.
  std::snprintf(line, sizeof(line), "%-22s %-6s %14s %14s %16s %12s %9s\n", "op", "format", "rows per rank",
                "bytes/unit", "MB per rank", "CPU ms", "verified");
  out << line;
  for (const BenchRow& row : rows) {
    std::snprintf(line, sizeof(line), "%-22s %-6s %14.1f %14.1f %16.2f %12.1f %9s\n", row.op.c_str(),
                  row.format.c_str(), static_cast<double>(row.units) / shape.num_ranks, row.bytes_per_unit,
                  row.total_bytes() / shape.num_ranks / 1e6, row.cpu_ms, row.verified ? "yes" : "NO");
    out << line;
  }
  out << "bytes: normal = rows each rank receives (one copy per destination rank) x (2H bf16 | H + 4H/128 "
         "fp8); low-latency = valid (token, expert) selections x (H + H/32 + 16 fp8 | 2H bf16) "
         "(docs/BENCHMARKS.md)\n";
}

void print_json(const CpuReferenceBenchShape& shape, const std::vector<BenchRow>& rows, bool all_verified,
                std::ostream& out) {
  out << "{\"mode\":\"cpu-reference\",\"gpu\":false,\"num_ranks\":" << shape.num_ranks
      << ",\"shape\":{\"num_tokens\":" << shape.num_tokens << ",\"hidden\":" << shape.hidden
      << ",\"num_topk\":" << shape.num_topk << ",\"num_experts\":" << shape.num_experts
      << ",\"ll_num_tokens\":" << shape.ll_num_tokens << ",\"ll_num_experts\":" << shape.ll_num_experts
      << "},\"note\":\"CPU times of the reference; they mean nothing for GPU performance\",\"results\":[";
  for (size_t i = 0; i < rows.size(); ++i) {
    const BenchRow& row = rows[i];
    char buffer[512];
    std::snprintf(buffer, sizeof(buffer),
                  "%s{\"op\":\"%s\",\"format\":\"%s\",\"units\":%lld,\"bytes_per_unit\":%.1f,"
                  "\"bytes_per_rank\":%.0f,\"total_bytes\":%.0f,\"cpu_ms\":%.3f,\"verified\":%s}",
                  i == 0 ? "" : ",", row.op.c_str(), row.format.c_str(), row.units, row.bytes_per_unit,
                  row.total_bytes() / shape.num_ranks, row.total_bytes(), row.cpu_ms,
                  row.verified ? "true" : "false");
    out << buffer;
  }
  out << "],\"verified\":" << (all_verified ? "true" : "false") << "}\n";
}

}  // namespace

int run_cpu_reference_bench(const CpuReferenceBenchShape& shape, bool json, std::ostream& out,
                            std::ostream& err, std::ostream* json_copy) {
  if (!json) {
    out << "epx-bench: NO GPU found — ran the CPU reference on " << shape.num_ranks
        << (shape.num_ranks == 1 ? " simulated rank" : " simulated ranks")
        << "; timings below are CPU times of the reference and mean nothing for GPU "
           "performance (--num-sms, --warmup, --iters, --ranks-per-node and --ll-ranks-per-node apply to GPU "
           "runs only)\n";
  }
  std::vector<BenchRow> rows;
  try {
    if (shape.with_normal) rows = run_normal(shape);
    if (shape.with_low_latency) {
      for (const BenchRow& row : run_low_latency(shape)) rows.push_back(row);
    }
  } catch (const std::exception& error) {
    err << "epx-bench: the CPU reference run failed: " << error.what() << "\n";
    return 2;
  }
  bool all_verified = true;
  for (const BenchRow& row : rows) all_verified = all_verified && row.verified;
  if (!json) print_table(shape, rows, out);
  if (!all_verified) err << "epx-bench: a CPU reference check FAILED\n";
  if (json) print_json(shape, rows, all_verified, out);
  if (json_copy != nullptr) print_json(shape, rows, all_verified, *json_copy);
  return all_verified ? 0 : 1;
}

}  // namespace epx::reference
