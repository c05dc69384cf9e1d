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
  double bytes = 0;  // counted as docs/BENCHMARKS.md says for the op (epx/bench_bytes.hpp)
  double gbps() const { return time_us > 0 ? bytes / (time_us * 1e3) : 0; }
};

// Writes rows averaged over ranks (rank_rows[r] = rank r's rows, same order on every rank) to `out` as a
// table under `header`, or as JSON lines tagged with `mode`.
void print_rows(const std::vector<std::vector<BenchRow>>& rank_rows, std::FILE* out, bool json,
                const std::string& header, const std::string& mode);

}  // namespace epx::bench
