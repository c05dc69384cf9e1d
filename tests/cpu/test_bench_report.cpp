#include <gtest/gtest.h>

#include <vector>

#include "bench/bench_report.hpp"

namespace {

using epx::bench::RowSummary;

RowSummary row(const std::string& op, int num_sms, double mean_us) {
  RowSummary r;
  r.op = op;
  r.num_sms = num_sms;
  r.mean_us = mean_us;
  return r;
}

// --tune prints, per op and SM budget, the config of least time; rows of other names are not configs.
TEST(BenchReport, FastestTunedConfigPerOpAndSmBudget) {
  using epx::bench::tuned_row_name;
  const std::vector<RowSummary> rows{
      row(tuned_row_name("dispatch BF16 cached", 6, 256), 24, 460.0),
      row(tuned_row_name("dispatch BF16 cached", 24, 256), 24, 289.0),
      row(tuned_row_name("combine BF16", 10, 256), 24, 287.0),
      row(tuned_row_name("dispatch BF16 cached", 32, 512), 24, 295.0),
      row(tuned_row_name("dispatch BF16 cached", 6, 256), 8, 800.0),
      row("NCCL all-to-all BF16 rows", 0, 1.0),
  };
  const auto best = epx::bench::fastest_tuned_configs(rows);
  ASSERT_EQ(best.size(), 3u);
  EXPECT_EQ(best[0].op, "dispatch BF16 cached");
  EXPECT_EQ(best[0].num_sms, 24);
  EXPECT_EQ(best[0].send_chunk, 24);
  EXPECT_EQ(best[0].queue_tokens, 256);
  EXPECT_DOUBLE_EQ(best[0].mean_us, 289.0);
  EXPECT_EQ(best[1].op, "combine BF16");
  EXPECT_EQ(best[1].send_chunk, 10);
  EXPECT_EQ(best[2].num_sms, 8);
  EXPECT_EQ(best[2].send_chunk, 6);
}

}  // namespace
