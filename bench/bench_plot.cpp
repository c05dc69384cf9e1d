#include "bench_plot.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <utility>

#include "epx/error.hpp"

namespace epx::bench {
namespace {

// Layout in SVG user units (pixels): op labels right-aligned left of the bars, value labels right of them.
constexpr int kWidth = 960;
constexpr int kBarLeft = 330;
constexpr int kBarMaxWidth = 420;
constexpr int kBarHeight = 14;
constexpr int kBarGap = 2;     // between the EPX and the NCCL bar of one op
constexpr int kGroupGap = 12;  // between ops
constexpr int kLineHeight = 18;
constexpr size_t kTitleChars = 125;  // a header longer than this wraps (about 7 px per character at 12 px)
constexpr const char* kEpxColor = "#1f77b4";
constexpr const char* kNcclColor = "#9a9a9a";
constexpr const char* kMicro = "\xc2\xb5";  // µ in UTF-8, SVG's default encoding

bool starts_with(const std::string& text, const char* prefix) {
  return text.rfind(prefix, 0) == 0;
}

bool is_nccl(const RowSummary& row) {
  return starts_with(row.op, "NCCL");
}

// The token format an op moves, as its name says it ("" when it names none).
std::string format_of(const std::string& op) {
  if (op.find("FP8") != std::string::npos) return "FP8";
  if (op.find("BF16") != std::string::npos) return "BF16";
  return "";
}

std::string escape_xml(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string fixed(double value, int decimals) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.*f", decimals, value);
  return text;
}

// Words of `text` in lines of at most `width` characters (a longer word gets a line of its own).
std::vector<std::string> wrap(const std::string& text, size_t width) {
  std::vector<std::string> lines;
  std::istringstream words(text);
  std::string word, line;
  while (words >> word) {
    if (!line.empty() && line.size() + 1 + word.size() > width) {
      lines.push_back(line);
      line.clear();
    }
    line += (line.empty() ? "" : " ") + word;
  }
  if (!line.empty()) lines.push_back(line);
  return lines;
}

// The axis step: the smallest 1, 2 or 5 x 10^k at or above max / 5, so about five round ticks cover `max`.
double tick_step(double max) {
  const double rough = max > 0 ? max / 5 : 1;
  const double power = std::pow(10.0, std::floor(std::log10(rough)));
  for (double m : {1.0, 2.0, 5.0}) {
    if (m * power >= rough) return m * power;
  }
  return 10 * power;
}

void text(std::ostringstream& svg, int x, int y, const std::string& content, const char* extra = "") {
  svg << "<text x=\"" << x << "\" y=\"" << y << "\"" << extra << ">" << escape_xml(content) << "</text>\n";
}

// An op's bars: EPX, and below it NCCL when the op has a baseline.
int group_height(bool with_baseline) {
  return with_baseline ? 2 * kBarHeight + kBarGap : kBarHeight;
}

// One bar with its "µs, GB/s" label; `y` is the bar's top.
void bar(std::ostringstream& svg, const char* css_class, const char* color, int y, double width,
         const RowSummary& row) {
  svg << "<rect class=\"" << css_class << "\" x=\"" << kBarLeft << "\" y=\"" << y << "\" width=\""
      << fixed(std::max(width, 1.0), 1) << "\" height=\"" << kBarHeight << "\" fill=\"" << color << "\"/>\n";
  const std::string label = fixed(row.mean_us, 1) + " " + kMicro + "s, " + fixed(row.gbps_mean, 0) + " GB/s";
  text(svg, kBarLeft + static_cast<int>(width) + 6, y + kBarHeight - 3, label, " font-size=\"11\"");
}

// Draws one section from `y` on; returns the y below it.
int draw_section(std::ostringstream& svg, const PlotSection& section, int y) {
  for (const std::string& line : wrap(section.title, kTitleChars)) {
    y += kLineHeight;
    text(svg, 10, y, line, " font-size=\"12\" font-weight=\"bold\"");
  }
  y += 8;
  // The ops drawn, each with its baseline (-1: none); the axis spans the longest bar of the section.
  std::vector<std::pair<size_t, int>> ops;
  double max_us = 0;
  int bars_height = 0;
  for (size_t i = 0; i < section.rows.size(); ++i) {
    if (!is_plotted_op(section.rows[i])) continue;
    const int baseline = nccl_baseline_of(section.rows, i);
    ops.emplace_back(i, baseline);
    max_us = std::max(max_us, section.rows[i].mean_us);
    if (baseline >= 0) max_us = std::max(max_us, section.rows[baseline].mean_us);
    bars_height += group_height(baseline >= 0) + kGroupGap;
  }
  if (ops.empty()) {
    text(svg, kBarLeft, y + kLineHeight, "no op with bytes to plot", " font-size=\"11\"");
    return y + 2 * kLineHeight;
  }
  const double step = tick_step(max_us);
  const int num_ticks = static_cast<int>(std::ceil(max_us / step));
  const double axis_us = num_ticks * step;
  const auto width_of = [&](double us) { return kBarMaxWidth * us / axis_us; };

  // Grid lines first, so the bars cover them; round tick labels below.
  const int bottom = y + bars_height - kGroupGap;
  for (int k = 0; k <= num_ticks; ++k) {
    const int x = kBarLeft + static_cast<int>(std::lround(width_of(k * step)));
    svg << "<line x1=\"" << x << "\" y1=\"" << y - 4 << "\" x2=\"" << x << "\" y2=\"" << bottom + 4
        << "\" stroke=\"#000\" stroke-opacity=\"" << (k == 0 ? "0.6" : "0.12") << "\"/>\n";
    char value[32];
    std::snprintf(value, sizeof(value), "%g", k * step);
    text(svg, x, bottom + 18, value, " font-size=\"10\" text-anchor=\"middle\"");
  }
  text(svg, kBarLeft + kBarMaxWidth / 2, bottom + 34,
       std::string("median time per call (") + kMicro + "s, mean over ranks)",
       " font-size=\"11\" text-anchor=\"middle\"");

  for (const auto& [i, baseline] : ops) {
    const RowSummary& row = section.rows[i];
    std::string label = row.op;
    if (row.num_sms > 0) label += ", " + std::to_string(row.num_sms) + " SMs";
    text(svg, kBarLeft - 8, y + group_height(baseline >= 0) / 2 + 4, label,
         " font-size=\"12\" text-anchor=\"end\"");
    bar(svg, "epx", kEpxColor, y, width_of(row.mean_us), row);
    if (baseline >= 0) {
      const RowSummary& nccl = section.rows[baseline];
      bar(svg, "nccl", kNcclColor, y + kBarHeight + kBarGap, width_of(nccl.mean_us), nccl);
    }
    y += group_height(baseline >= 0) + kGroupGap;
  }
  return bottom + 44;
}

}  // namespace

bool is_plotted_op(const RowSummary& row) {
  return row.has_bytes && !is_nccl(row) && !starts_with(row.op, "copy engine");
}

int nccl_baseline_of(const std::vector<RowSummary>& rows, size_t i) {
  const std::string format = format_of(rows[i].op);
  if (format.empty() || is_nccl(rows[i])) return -1;
  for (size_t j = 0; j < rows.size(); ++j) {
    if (is_nccl(rows[j]) && format_of(rows[j].op) == format) return static_cast<int>(j);
  }
  return -1;
}

std::string render_plot_svg(const std::vector<PlotSection>& sections) {
  std::ostringstream body;
  int y = 28;
  text(body, 10, y, "epx-bench: EPX beside the NCCL all-to-all of the same run, moving the same bytes",
       " font-size=\"16\" font-weight=\"bold\"");
  // Legend.
  y += 20;
  body << "<rect x=\"10\" y=\"" << y - 11 << "\" width=\"14\" height=\"14\" fill=\"" << kEpxColor << "\"/>\n";
  text(body, 30, y, "EPX", " font-size=\"12\"");
  body << "<rect x=\"70\" y=\"" << y - 11 << "\" width=\"14\" height=\"14\" fill=\"" << kNcclColor
       << "\"/>\n";
  text(body, 90, y,
       "NCCL all-to-all (same format). Shorter is faster; GB/s as docs/BENCHMARKS.md counts bytes.",
       " font-size=\"12\"");
  if (sections.empty()) {
    y += 2 * kLineHeight;
    text(body, 10, y, "no results", " font-size=\"12\"");
  }
  for (const PlotSection& section : sections) y = draw_section(body, section, y + 10);
  const int height = y + 10;

  std::ostringstream svg;
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << kWidth << "\" height=\"" << height
      << "\" viewBox=\"0 0 " << kWidth << " " << height << "\" font-family=\"sans-serif\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"#fff\"/>\n"
      << body.str() << "</svg>\n";
  return svg.str();
}

void write_plot_svg(const std::string& path, const std::vector<PlotSection>& sections) {
  std::ofstream file(path);
  EPX_CHECK(file.good(), "--plot", path, "must be a writable path");
  file << render_plot_svg(sections);
  file.close();
  EPX_CHECK(!file.fail(), "--plot", path, "could not be written in full");
}

}  // namespace epx::bench
