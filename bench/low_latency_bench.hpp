#pragma once

#include <vector>

#include "bench_options.hpp"
#include "bench_report.hpp"
#include "epx/bootstrap.hpp"

namespace epx::bench {

// Low-latency mode on this rank's GPU (device = rank): checks a BF16 dispatch + weighted combine round trip,
// then times dispatch (FP8, BF16) and combine (BF16, LogFMT), whole calls and, in hook mode, the send and the
// receive phase separately, and NCCL all-to-all moving the same bytes. Collective.
std::vector<BenchRow> run_low_latency_bench(Bootstrap& bootstrap, const BenchOptions& options);

}  // namespace epx::bench
