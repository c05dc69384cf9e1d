#pragma once

#include <vector>

#include "bench_options.hpp"
#include "bench_report.hpp"
#include "epx/bootstrap.hpp"

namespace epx::bench {

// Normal mode on this rank's GPU (device = rank): checks dispatch+combine, then times dispatch BF16,
// dispatch FP8 and combine for each SM budget, and NCCL all-to-all moving the same bytes. Collective.
std::vector<BenchRow> run_normal_bench(Bootstrap& bootstrap, const BenchOptions& options);

}  // namespace epx::bench
