#include "bench_report.hpp"

#include <algorithm>
#include <cstdio>

namespace epx::bench {

void print_rows(const std::vector<std::vector<BenchRow>>& rank_rows, std::FILE* out, bool json,
                const std::string& header, const std::string& mode) {
  if (rank_rows.empty()) return;
  const size_t num_rows = rank_rows[0].size();
  const int num_ranks = static_cast<int>(rank_rows.size());
  // Network columns only for a run across nodes (some row crossed between nodes on some rank).
  bool across_nodes = false;
  for (const auto& rows : rank_rows) {
    for (const auto& row : rows) across_nodes |= row.network_bytes > 0;
  }
  if (!json) {
    std::fprintf(out, "\n%s\n", header.c_str());
    std::fprintf(out, "%-34s %5s %12s %12s %12s %12s", "op", "SMs", "mean us", "slowest us", "GB/s (mean)",
                 "GB/s (min)");
    if (across_nodes) std::fprintf(out, " %12s %12s", "net GB/s", "net (min)");
    std::fprintf(out, "\n");
  }
  for (size_t i = 0; i < num_rows; ++i) {
    double sum_time = 0, max_time = 0, sum_gbps = 0, min_gbps = 1e30, sum_net = 0, min_net = 1e30;
    for (const auto& rows : rank_rows) {
      sum_time += rows[i].time_us;
      max_time = std::max(max_time, rows[i].time_us);
      sum_gbps += rows[i].gbps();
      min_gbps = std::min(min_gbps, rows[i].gbps());
      sum_net += rows[i].network_gbps();
      min_net = std::min(min_net, rows[i].network_gbps());
    }
    const BenchRow& row = rank_rows[0][i];
    if (json) {
      // The table's header (shape, tokens) rides along, so a plot of several runs can tell them apart.
      std::fprintf(out,
                   "{\"mode\":\"%s\",\"op\":\"%s\",\"num_sms\":%d,\"num_ranks\":%d,\"mean_us\":%.2f,"
                   "\"slowest_us\":%.2f,\"gbps_mean\":%.2f,\"gbps_min\":%.2f,",
                   mode.c_str(), row.op.c_str(), row.num_sms, num_ranks, sum_time / num_ranks, max_time,
                   sum_gbps / num_ranks, min_gbps);
      if (across_nodes)
        std::fprintf(out, "\"net_gbps_mean\":%.2f,\"net_gbps_min\":%.2f,", sum_net / num_ranks, min_net);
      std::fprintf(out, "\"header\":\"%s\"}\n", header.c_str());
    } else {
      // Rows that only break another row's time down carry no bytes: no bandwidth to show.
      if (row.bytes > 0) {
        std::fprintf(out, "%-34s %5d %12.1f %12.1f %12.1f %12.1f", row.op.c_str(), row.num_sms,
                     sum_time / num_ranks, max_time, sum_gbps / num_ranks, min_gbps);
      } else {
        std::fprintf(out, "%-34s %5d %12.1f %12.1f %12s %12s", row.op.c_str(), row.num_sms,
                     sum_time / num_ranks, max_time, "-", "-");
      }
      if (across_nodes && row.bytes > 0) {
        std::fprintf(out, " %12.1f %12.1f", sum_net / num_ranks, min_net);
      } else if (across_nodes) {
        std::fprintf(out, " %12s %12s", "-", "-");
      }
      std::fprintf(out, "\n");
    }
  }
  std::fflush(out);
}

}  // namespace epx::bench
