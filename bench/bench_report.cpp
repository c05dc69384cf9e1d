#include "bench_report.hpp"

#include <algorithm>
#include <cstdio>

namespace epx::bench {

std::vector<RowSummary> summarize_rows(const std::vector<std::vector<BenchRow>>& rank_rows) {
  std::vector<RowSummary> out;
  if (rank_rows.empty()) return out;
  const double num_ranks = static_cast<double>(rank_rows.size());
  for (size_t i = 0; i < rank_rows[0].size(); ++i) {
    const BenchRow& row = rank_rows[0][i];
    RowSummary s;
    s.op = row.op;
    s.num_sms = row.num_sms;
    double sum_time = 0, sum_gbps = 0, sum_net = 0;
    s.gbps_min = s.net_gbps_min = 1e30;
    for (const auto& rows : rank_rows) {
      sum_time += rows[i].time_us;
      s.slowest_us = std::max(s.slowest_us, rows[i].time_us);
      sum_gbps += rows[i].gbps();
      s.gbps_min = std::min(s.gbps_min, rows[i].gbps());
      sum_net += rows[i].network_gbps();
      s.net_gbps_min = std::min(s.net_gbps_min, rows[i].network_gbps());
    }
    s.mean_us = sum_time / num_ranks;
    s.gbps_mean = sum_gbps / num_ranks;
    s.net_gbps_mean = sum_net / num_ranks;
    s.has_bytes = row.bytes > 0;
    out.push_back(s);
  }
  return out;
}

void print_rows(const std::vector<std::vector<BenchRow>>& rank_rows, std::FILE* out, bool json,
                const std::string& header, const std::string& mode) {
  if (rank_rows.empty()) return;
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
  for (const RowSummary& s : summarize_rows(rank_rows)) {
    if (json) {
      // The table's header (shape, tokens) rides along, so a plot of several runs can tell them apart.
      std::fprintf(out,
                   "{\"mode\":\"%s\",\"op\":\"%s\",\"num_sms\":%d,\"num_ranks\":%d,\"mean_us\":%.2f,"
                   "\"slowest_us\":%.2f,\"gbps_mean\":%.2f,\"gbps_min\":%.2f,",
                   mode.c_str(), s.op.c_str(), s.num_sms, num_ranks, s.mean_us, s.slowest_us, s.gbps_mean,
                   s.gbps_min);
      if (across_nodes)
        std::fprintf(out, "\"net_gbps_mean\":%.2f,\"net_gbps_min\":%.2f,", s.net_gbps_mean, s.net_gbps_min);
      std::fprintf(out, "\"header\":\"%s\"}\n", header.c_str());
    } else {
      // Rows that only break another row's time down carry no bytes: no bandwidth to show.
      if (s.has_bytes) {
        std::fprintf(out, "%-34s %5d %12.1f %12.1f %12.1f %12.1f", s.op.c_str(), s.num_sms, s.mean_us,
                     s.slowest_us, s.gbps_mean, s.gbps_min);
      } else {
        std::fprintf(out, "%-34s %5d %12.1f %12.1f %12s %12s", s.op.c_str(), s.num_sms, s.mean_us,
                     s.slowest_us, "-", "-");
      }
      if (across_nodes && s.has_bytes) {
        std::fprintf(out, " %12.1f %12.1f", s.net_gbps_mean, s.net_gbps_min);
      } else if (across_nodes) {
        std::fprintf(out, " %12s %12s", "-", "-");
      }
      std::fprintf(out, "\n");
    }
  }
  std::fflush(out);
}

std::string tuned_row_name(const std::string& op, int send_chunk, int queue_tokens) {
  return op + ", chunk " + std::to_string(send_chunk) + ", queue " + std::to_string(queue_tokens);
}

std::vector<TunedConfig> fastest_tuned_configs(const std::vector<RowSummary>& rows) {
  std::vector<TunedConfig> best;
  for (const RowSummary& row : rows) {
    const size_t at = row.op.rfind(", chunk ");
    if (at == std::string::npos) continue;
    TunedConfig config{row.op.substr(0, at), row.num_sms, 0, 0, row.mean_us};
    if (std::sscanf(row.op.c_str() + at, ", chunk %d, queue %d", &config.send_chunk, &config.queue_tokens) !=
        2)
      continue;
    auto same = std::find_if(best.begin(), best.end(), [&](const TunedConfig& b) {
      return b.op == config.op && b.num_sms == config.num_sms;
    });
    if (same == best.end()) {
      best.push_back(config);
    } else if (config.mean_us < same->mean_us) {
      *same = config;
    }
  }
  return best;
}

double tuned_row_us(const std::vector<RowSummary>& rows, const std::string& op, int num_sms, int send_chunk,
                    int queue_tokens) {
  const std::string name = tuned_row_name(op, send_chunk, queue_tokens);
  for (const RowSummary& row : rows) {
    if (row.op == name && row.num_sms == num_sms) return row.mean_us;
  }
  return -1.0;
}

}  // namespace epx::bench
