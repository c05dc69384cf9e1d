#pragma once

#include <cstdio>
#include <string>
#include <vector>

namespace epx::bench {

// One measured line: what ran, with how many SMs, and its median time and bytes on one rank.
struct BenchRow {
  std::string op;
  int num_sms = 0;
  double time_us = 0;
  double bytes = 0;  // counted as docs/BENCHMARKS.md says for the op (bench/bench_bytes.hpp)
  // Across nodes: the bytes that cross between nodes (internode_network_rows x row bytes); 0 within a node.
  double network_bytes = 0;
  double gbps() const { return time_us > 0 ? bytes / (time_us * 1e3) : 0; }
  double network_gbps() const { return time_us > 0 ? network_bytes / (time_us * 1e3) : 0; }
};

// One row averaged over ranks, as the table and the JSON lines report it (and the plot draws it).
struct RowSummary {
  std::string op;
  int num_sms = 0;
  double mean_us = 0, slowest_us = 0;
  double gbps_mean = 0, gbps_min = 0;          // mean over ranks, and of the slowest rank
  double net_gbps_mean = 0, net_gbps_min = 0;  // across nodes; 0 within a node
  bool has_bytes = false;                      // false: a row that breaks another row's time down
};

// rank_rows[r] = rank r's rows, same order on every rank; one summary per row.
std::vector<RowSummary> summarize_rows(const std::vector<std::vector<BenchRow>>& rank_rows);

// --tune's answer: the config of least mean time for one op and SM budget.
struct TunedConfig {
  std::string op;  // e.g. "dispatch BF16 cached"
  int num_sms = 0;
  int send_chunk = 0;
  int queue_tokens = 0;
  double mean_us = 0;
};

// The name of a --tune row: `op` at that NVLink send chunk and queue size.
std::string tuned_row_name(const std::string& op, int send_chunk, int queue_tokens);

// For each (op, SM budget) among rows named by tuned_row_name, the fastest; other rows are ignored. In the
// order each (op, SM budget) first appears.
std::vector<TunedConfig> fastest_tuned_configs(const std::vector<RowSummary>& rows);

// The mean time of the --tune row of `op` at `num_sms`, `send_chunk` and `queue_tokens`; negative when the
// sweep has none.
double tuned_row_us(const std::vector<RowSummary>& rows, const std::string& op, int num_sms, int send_chunk,
                    int queue_tokens);

// Writes rows averaged over ranks (rank_rows[r] = rank r's rows, same order on every rank) to `out` as a
// table under `header`, or as JSON lines tagged with `mode`. When a row carries network bytes (a run across
// nodes), the table adds the network GB/s (mean over ranks and of the slowest rank) and the JSON lines
// `net_gbps_mean` / `net_gbps_min`.
void print_rows(const std::vector<std::vector<BenchRow>>& rank_rows, std::FILE* out, bool json,
                const std::string& header, const std::string& mode);

}  // namespace epx::bench
