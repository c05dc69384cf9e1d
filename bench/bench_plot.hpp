#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "bench_report.hpp"

namespace epx::bench {

// One mode's results (print_rows' rows, averaged over ranks) under the report's header.
struct PlotSection {
  std::string title;
  std::vector<RowSummary> rows;
};

// Whether the plot draws `row` as an op: rows with bytes, except the NCCL rows (drawn beside the ops they
// compare with) and the copy-engine read (a link ceiling, not an all-to-all; python -m epx.plot leaves it
// out too).
bool is_plotted_op(const RowSummary& row);

// The index of the NCCL row that rows[i] compares with: the NCCL all-to-all of the same run moving the same
// format's bytes, the format (BF16 or FP8) named in both ops ("dispatch FP8 cached" and "NCCL all-to-all FP8
// rows"). -1 when the op names neither format (LogFMT) or the run had no NCCL.
int nccl_baseline_of(const std::vector<RowSummary>& rows, size_t i);

// A self-contained SVG document (no scripts, no external fonts or styles) of every section: per op a group of
// two horizontal bars, the EPX median time and the NCCL baseline's, each labelled with µs and GB/s (means
// over ranks). Bars are <rect class="epx"> and <rect class="nccl">, so a page can restyle them.
std::string render_plot_svg(const std::vector<PlotSection>& sections);

// Writes render_plot_svg(sections) to `path`; throws epx::Error naming --plot when the file cannot be
// written.
void write_plot_svg(const std::string& path, const std::vector<PlotSection>& sections);

}  // namespace epx::bench
