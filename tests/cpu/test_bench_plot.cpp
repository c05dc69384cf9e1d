// epx-bench --plot (bench/bench_plot.hpp): which rows become bars, which NCCL row each op is drawn beside,
// and an SVG document that stands alone and is well-formed.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "bench/bench_plot.hpp"

namespace {

using epx::bench::PlotSection;
using epx::bench::RowSummary;

RowSummary row(const std::string& op, int num_sms, double mean_us, double gbps, bool has_bytes = true) {
  RowSummary r;
  r.op = op;
  r.num_sms = num_sms;
  r.mean_us = r.slowest_us = mean_us;
  r.gbps_mean = r.gbps_min = gbps;
  r.has_bytes = has_bytes;
  return r;
}

// Rows as normal_bench.cpp and low_latency_bench.cpp name them.
std::vector<PlotSection> small_run() {
  PlotSection normal{
      "normal mode: 2 ranks, 4096 tokens/rank",
      {row("dispatch BF16", 24, 87.7, 654.0), row("  of which notify (BF16)", 24, 18.8, 0, false),
       row("dispatch FP8 cached", 24, 71.6, 420.0), row("combine BF16", 24, 69.6, 800.0),
       row("copy engine: read next rank", 0, 90.0, 370.0), row("NCCL all-to-all BF16 rows", 0, 44.4, 1290.0),
       row("NCCL all-to-all FP8 rows", 0, 30.1, 990.0)}};
  PlotSection low_latency{"low-latency mode: 2 ranks, 128 tokens/rank",
                          {row("LL dispatch FP8", 0, 26.4, 280.0), row("LL combine LogFMT", 0, 59.8, 150.0),
                           row("NCCL all-to-all FP8 selections", 0, 39.4, 190.0),
                           row("NCCL all-to-all BF16 selections", 0, 53.8, 270.0)}};
  return {normal, low_latency};
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + what.size())) ++n;
  return n;
}

// Well-formed enough for any XML reader: every element closed in order, every '&' an entity, one root.
std::string xml_problem(const std::string& svg) {
  std::vector<std::string> open;
  for (size_t at = 0; at < svg.size(); ++at) {
    if (svg[at] == '&') {
      const size_t end = svg.find(';', at);
      const std::string entity = svg.substr(at, end == std::string::npos ? 8 : end - at + 1);
      if (entity != "&amp;" && entity != "&lt;" && entity != "&gt;" && entity != "&quot;")
        return "bare & at " + std::to_string(at);
    }
    if (svg[at] != '<') continue;
    const size_t end = svg.find('>', at);
    if (end == std::string::npos) return "unclosed tag at " + std::to_string(at);
    const std::string tag = svg.substr(at + 1, end - at - 1);
    if (tag.find('<') != std::string::npos) return "'<' inside tag at " + std::to_string(at);
    if (tag.empty()) return "empty tag";
    if (tag[0] == '/') {
      if (open.empty() || open.back() != tag.substr(1)) return "</" + tag.substr(1) + "> closes nothing open";
      open.pop_back();
      if (open.empty() && svg.find('<', end) != std::string::npos) return "content after the root";
    } else if (tag.back() != '/') {
      open.push_back(tag.substr(0, tag.find(' ')));
    }
    at = end;
  }
  return open.empty() ? "" : "<" + open.back() + "> not closed";
}

TEST(BenchPlot, OpsAreDrawnBesideTheNcclRowOfTheirFormat) {
  const std::vector<RowSummary> rows = small_run()[0].rows;
  EXPECT_EQ(epx::bench::nccl_baseline_of(rows, 0), 5);                  // dispatch BF16
  EXPECT_EQ(epx::bench::nccl_baseline_of(rows, 2), 6);                  // dispatch FP8 cached
  EXPECT_EQ(epx::bench::nccl_baseline_of(rows, 3), 5);                  // combine BF16
  EXPECT_EQ(epx::bench::nccl_baseline_of(rows, 4), -1);                 // copy engine: no format
  EXPECT_EQ(epx::bench::nccl_baseline_of(rows, 5), -1);                 // an NCCL row compares with nothing
  EXPECT_EQ(epx::bench::nccl_baseline_of(small_run()[1].rows, 1), -1);  // LogFMT: no NCCL of that format
  // A run without NCCL (built without it): no baselines.
  EXPECT_EQ(epx::bench::nccl_baseline_of({row("dispatch BF16", 24, 1, 1)}, 0), -1);

  EXPECT_TRUE(epx::bench::is_plotted_op(rows[0]));
  EXPECT_FALSE(epx::bench::is_plotted_op(rows[1]));  // a breakdown without bytes
  EXPECT_FALSE(epx::bench::is_plotted_op(rows[4]));  // the copy-engine ceiling
  EXPECT_FALSE(epx::bench::is_plotted_op(rows[5]));  // NCCL: drawn beside the ops
}

TEST(BenchPlot, SvgShowsEveryOpWithItsNcclBarAndLabels) {
  const std::string svg = epx::bench::render_plot_svg(small_run());
  ASSERT_EQ(svg.rfind("<svg ", 0), 0u) << svg.substr(0, 80);
  ASSERT_GE(svg.size(), 7u);
  EXPECT_EQ(svg.substr(svg.size() - 7), "</svg>\n");
  EXPECT_EQ(xml_problem(svg), "");
  EXPECT_NE(svg.find("xmlns=\"http://www.w3.org/2000/svg\""), std::string::npos);  // opens on its own

  for (const char* op :
       {">dispatch BF16, 24 SMs<", ">dispatch FP8 cached, 24 SMs<", ">combine BF16, 24 SMs<",
        ">LL dispatch FP8<", ">LL combine LogFMT<", "normal mode: 2 ranks", "low-latency mode: 2 ranks"})
    EXPECT_NE(svg.find(op), std::string::npos) << op;
  EXPECT_EQ(svg.find("of which notify"), std::string::npos);
  EXPECT_EQ(svg.find("copy engine"), std::string::npos);
  // Five ops; four have an NCCL baseline (LogFMT has none).
  EXPECT_EQ(count(svg, "class=\"epx\""), 5u);
  EXPECT_EQ(count(svg, "class=\"nccl\""), 4u);
  // Time and GB/s beside each bar: dispatch BF16 and its NCCL BF16 baseline.
  EXPECT_NE(svg.find("87.7 \xc2\xb5s, 654 GB/s"), std::string::npos);
  EXPECT_NE(svg.find("44.4 \xc2\xb5s, 1290 GB/s"), std::string::npos);
}

TEST(BenchPlot, SvgEscapesTextAndStaysWellFormedWhenEmpty) {
  PlotSection odd{"a <header> & more", {row("op <1> & \"two\" BF16", 8, 5.0, 10.0)}};
  const std::string svg = epx::bench::render_plot_svg({odd});
  EXPECT_EQ(xml_problem(svg), "");
  EXPECT_NE(svg.find("a &lt;header&gt; &amp; more"), std::string::npos);
  EXPECT_NE(svg.find("op &lt;1&gt; &amp; &quot;two&quot; BF16, 8 SMs"), std::string::npos);

  for (const std::vector<PlotSection>& sections :
       {std::vector<PlotSection>{}, std::vector<PlotSection>{PlotSection{"only breakdowns", {}}}}) {
    const std::string empty = epx::bench::render_plot_svg(sections);
    EXPECT_EQ(empty.rfind("<svg ", 0), 0u);
    EXPECT_EQ(xml_problem(empty), "");
  }
}

}  // namespace
