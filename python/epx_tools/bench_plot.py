"""``python -m epx_tools.bench_plot RESULTS.json [MORE.json ...] --out FILE.svg``: a bar chart of benchmark runs.

Reads the JSON lines of ``epx-bench --json-file F`` or ``python -m epx_tools.bench --json-file F`` (through
epx_tools.plot's reader) and writes one self-contained SVG, written as text so it needs no matplotlib: per mode
of each run a section under the run's header, per op a group of two horizontal bars, the EPX median time and
that of the NCCL all-to-all of the same run moving the same format's bytes, each labelled with microseconds and
GB/s (means over ranks). Rows are drawn as ops when they count bytes and are neither an NCCL row (drawn beside
the ops of its format) nor the copy-engine read (a link ceiling, not an all-to-all). Needs nothing from epx.
Exit status: 0 written; 1 nothing to plot (e.g. the JSON of epx-bench's CPU reference run); 2 a bad option
or an unreadable input.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any, List, Optional, Sequence, Tuple
from xml.sax.saxutils import escape

from epx_tools import plot

PROG = "python -m epx_tools.bench_plot"

# Layout in SVG user units (pixels): op labels right-aligned left of the bars, value labels right of them.
WIDTH = 960
BAR_LEFT = 330
BAR_MAX_WIDTH = 420
BAR_HEIGHT = 14
BAR_GAP = 2  # between the EPX and the NCCL bar of one op
GROUP_GAP = 12  # between ops
LINE_HEIGHT = 18
TITLE_CHARS = 125  # a header longer than this wraps (about 7 px per character at 12 px)
EPX_COLOR = "#1f77b4"
NCCL_COLOR = "#9a9a9a"

# A section: (title, rows); a row has op, num_sms, mean_us and gbps_mean (epx_tools.plot.Row).
Section = Tuple[str, Sequence[Any]]


def _is_nccl(row: Any) -> bool:
    return row.op.startswith("NCCL")


def _format_of(op: str) -> str:
    """The token format an op moves, as its name says it ("" when it names none)."""
    return "FP8" if "FP8" in op else "BF16" if "BF16" in op else ""


def is_plotted_op(row: Any) -> bool:
    """Rows with bytes, except NCCL (drawn beside the ops of its format) and the copy-engine read."""
    return row.gbps_mean > 0 and not _is_nccl(row) and not row.op.startswith("copy engine")


def nccl_baseline_of(rows: Sequence[Any], i: int) -> Optional[int]:
    """Index of the NCCL row of rows[i]'s format (BF16 or FP8, named in both ops); None when there is none."""
    fmt = _format_of(rows[i].op)
    if not fmt or _is_nccl(rows[i]):
        return None
    return next((j for j, row in enumerate(rows) if _is_nccl(row) and _format_of(row.op) == fmt), None)


def _text(x: float, y: float, content: str, extra: str = "") -> str:
    return f'<text x="{x:g}" y="{y:g}"{extra}>{escape(content, {chr(34): "&quot;"})}</text>'


def _wrap(text: str, width: int) -> List[str]:
    lines: List[str] = []
    for word in text.split():
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines


def _tick_step(max_value: float) -> float:
    """The smallest 1, 2 or 5 x 10^k at or above max / 5, so about five round ticks cover max."""
    rough = max_value / 5 if max_value > 0 else 1.0
    power = 10.0 ** math.floor(math.log10(rough))
    return next((m * power for m in (1.0, 2.0, 5.0) if m * power >= rough), 10 * power)


def _group_height(with_baseline: bool) -> int:
    return 2 * BAR_HEIGHT + BAR_GAP if with_baseline else BAR_HEIGHT


def _bar(out: List[str], css_class: str, color: str, y: int, width: float, row: Any) -> None:
    out.append(f'<rect class="{css_class}" x="{BAR_LEFT}" y="{y}" width="{max(width, 1.0):.1f}" '
               f'height="{BAR_HEIGHT}" fill="{color}"/>')
    label = f"{row.mean_us:.1f} \u00b5s, {row.gbps_mean:.0f} GB/s"
    out.append(_text(BAR_LEFT + int(width) + 6, y + BAR_HEIGHT - 3, label, ' font-size="11"'))


def _section(out: List[str], title: str, rows: Sequence[Any], y: int) -> int:
    """Draws one section from y on; returns the y below it."""
    for line in _wrap(title, TITLE_CHARS):
        y += LINE_HEIGHT
        out.append(_text(10, y, line, ' font-size="12" font-weight="bold"'))
    y += 8
    ops = [(i, nccl_baseline_of(rows, i)) for i, row in enumerate(rows) if is_plotted_op(row)]
    if not ops:
        out.append(_text(BAR_LEFT, y + LINE_HEIGHT, "no op with bytes to plot", ' font-size="11"'))
        return y + 2 * LINE_HEIGHT
    max_us = max(max(rows[i].mean_us, rows[b].mean_us if b is not None else 0.0) for i, b in ops)
    step = _tick_step(max_us)
    num_ticks = math.ceil(max_us / step)
    axis_us = num_ticks * step

    def width_of(us: float) -> float:
        return BAR_MAX_WIDTH * us / axis_us

    # Grid lines first, so the bars cover them; round tick labels below.
    bottom = y + sum(_group_height(b is not None) + GROUP_GAP for _, b in ops) - GROUP_GAP
    for k in range(num_ticks + 1):
        x = BAR_LEFT + math.floor(width_of(k * step) + 0.5)  # as C++'s lround, not round-half-even
        out.append(f'<line x1="{x}" y1="{y - 4}" x2="{x}" y2="{bottom + 4}" stroke="#000" '
                   f'stroke-opacity="{"0.6" if k == 0 else "0.12"}"/>')
        out.append(_text(x, bottom + 18, f"{k * step:g}", ' font-size="10" text-anchor="middle"'))
    out.append(_text(BAR_LEFT + BAR_MAX_WIDTH // 2, bottom + 34, "median time per call (\u00b5s, mean over ranks)",
                     ' font-size="11" text-anchor="middle"'))
    for i, baseline in ops:
        row = rows[i]
        label = row.op + (f", {row.num_sms} SMs" if row.num_sms > 0 else "")
        height = _group_height(baseline is not None)
        out.append(_text(BAR_LEFT - 8, y + height // 2 + 4, label, ' font-size="12" text-anchor="end"'))
        _bar(out, "epx", EPX_COLOR, y, width_of(row.mean_us), row)
        if baseline is not None:
            _bar(out, "nccl", NCCL_COLOR, y + BAR_HEIGHT + BAR_GAP, width_of(rows[baseline].mean_us), rows[baseline])
        y += height + GROUP_GAP
    return bottom + 44


def render_svg(sections: Sequence[Section]) -> str:
    """A self-contained SVG document (no scripts, no external fonts or styles) of every (title, rows) section."""
    body: List[str] = []
    y = 28
    body.append(_text(10, y, "epx-bench: EPX beside the NCCL all-to-all of the same run, moving the same bytes",
                      ' font-size="16" font-weight="bold"'))
    y += 20
    body.append(f'<rect x="10" y="{y - 11}" width="14" height="14" fill="{EPX_COLOR}"/>')
    body.append(_text(30, y, "EPX", ' font-size="12"'))
    body.append(f'<rect x="70" y="{y - 11}" width="14" height="14" fill="{NCCL_COLOR}"/>')
    body.append(_text(90, y, "NCCL all-to-all (same format). Shorter is faster; GB/s as docs/BENCHMARKS.md counts "
                      "bytes.", ' font-size="12"'))
    if not sections:
        y += 2 * LINE_HEIGHT
        body.append(_text(10, y, "no results", ' font-size="12"'))
    for title, rows in sections:
        y = _section(body, title, rows, y + 10)
    height = y + 10
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif">')
    return "\n".join([head, '<rect width="100%" height="100%" fill="#fff"/>'] + body + ["</svg>"]) + "\n"


def write_svg(path: str, sections: Sequence[Section]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_svg(sections))


def sections_of(results: plot.Results) -> List[Section]:
    """One section per mode of each run, in the order the JSON lists them, titled by the run's header."""
    sections: List[Section] = []
    keys: List[Tuple[int, str]] = []
    for row in results.rows:
        key = (row.run, row.mode)
        if key not in keys:
            keys.append(key)
            sections.append((row.header or f"{row.mode} mode", []))
        sections[keys.index(key)][1].append(row)
    return sections


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="An SVG bar chart of epx-bench / python -m epx_tools.bench "
                                "JSON results: per op the EPX time beside the NCCL all-to-all of the same run.")
    p.add_argument("paths", nargs="+", metavar="RESULTS.json", help="JSON lines of --json-file ('-': stdin)")
    p.add_argument("--out", required=True, metavar="FILE.svg", help="the SVG file to write")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    o = build_parser().parse_args(argv)
    try:
        if len(o.out) <= 4 or not o.out.endswith(".svg"):
            raise plot.PlotError(f"invalid --out = {o.out}: must end in .svg (the plot is an SVG file)")
        results = plot.read_files(o.paths)
        sections = sections_of(results)
        if not sections:
            reasons = "; ".join(sorted({skipped.reason for skipped in results.skipped})) or "no rows"
            print(f"{PROG}: nothing to plot in {', '.join(o.paths)} ({reasons}): {o.out} not written",
                  file=sys.stderr)
            return 1
        write_svg(o.out, sections)
    except plot.PlotError as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"{PROG}: cannot write {o.out}: {error.strerror}", file=sys.stderr)
        return 2
    print(f"wrote {o.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
