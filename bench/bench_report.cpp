#include "bench_report.hpp"

#include <algorithm>
#include <cstdio>

namespace epx::bench {

void print_rows(const std::vector<std::vector<BenchRow>>& rank_rows, std::FILE* out, bool json,
                const std::string& header, const std::string& mode) {
  if (rank_rows.empty()) return;
  const size_t num_rows = rank_rows[0].size();
  const int num_ranks = static_cast<int>(rank_rows.size());
  if (!json) {
    std::fprintf(out, "\n%s\n", header.c_str());
    std::fprintf(out, "%-34s %5s %12s %12s %12s %12s\n", "op", "SMs", "mean us", "slowest us", "GB/s (mean)",
                 "GB/s (min)");
  }
  for (size_t i = 0; i < num_rows; ++i) {
    double sum_time = 0, max_time = 0, sum_gbps = 0, min_gbps = 1e30;
    for (const auto& rows : rank_rows) {
      sum_time += rows[i].time_us;
      max_time = std::max(max_time, rows[i].time_us);
      sum_gbps += rows[i].gbps();
      min_gbps = std::min(min_gbps, rows[i].gbps());
    }
    const BenchRow& row = rank_rows[0][i];
    if (json) {
      // The table's header (shape, tokens) rides along, so a plot of several runs can tell them apart.
      std::fprintf(out,
                   "{\"mode\":\"%s\",\"op\":\"%s\",\"num_sms\":%d,\"num_ranks\":%d,\"mean_us\":%.2f,"
                   "\"slowest_us\":%.2f,\"gbps_mean\":%.2f,"
                   "\"gbps_min\":%.2f,\"header\":\"%s\"}\n",
                   mode.c_str(), row.op.c_str(), row.num_sms, num_ranks, sum_time / num_ranks, max_time,
                   sum_gbps / num_ranks, min_gbps, header.c_str());
    } else {
      // Rows that only break another row's time down carry no bytes: no bandwidth to show.
      if (row.bytes > 0) {
        std::fprintf(out, "%-34s %5d %12.1f %12.1f %12.1f %12.1f\n", row.op.c_str(), row.num_sms,
                     sum_time / num_ranks, max_time, sum_gbps / num_ranks, min_gbps);
      } else {
        std::fprintf(out, "%-34s %5d %12.1f %12.1f %12s %12s\n", row.op.c_str(), row.num_sms,
                     sum_time / num_ranks, max_time, "-", "-");
      }
    }
  }
  std::fflush(out);
}

}  // namespace epx::bench
