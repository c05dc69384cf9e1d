"""python -m epx_tools.bench_plot: the SVG bar chart drawn from the benchmark JSON (epx-bench --json-file,
python -m epx_tools.bench --json-file): which rows become bars, which NCCL row each op is drawn beside, one
section per mode of each run, text escaped, a document that stands alone and is well-formed, and the command
line. Needs neither the compiled epx nor matplotlib."""

import os
import subprocess
import sys
import xml.etree.ElementTree as ET

from epx_tools import bench_plot, plot

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SVG = "{http://www.w3.org/2000/svg}"


def line(mode, op, sms, us, gbps, header):
    """One JSON line as bench_report.cpp / epx_tools.bench.format_rows write it (two ranks)."""
    return (f'{{"mode":"{mode}","op":"{op}","num_sms":{sms},"num_ranks":2,"mean_us":{us:.2f},"slowest_us":{us:.2f},'
            f'"gbps_mean":{gbps:.2f},"gbps_min":{gbps:.2f},"header":"{header}"}}\n')


# Rows as normal_bench.cpp and low_latency_bench.cpp name them: a breakdown without bytes, the copy-engine
# ceiling, an op of no NCCL format (LogFMT), text that needs escaping.
NORMAL = "normal mode: 2 ranks, 4096 tokens/rank"
LOW_LATENCY = "low-latency mode: 2 ranks & more, 128 tokens/rank"
RUN = "".join([
    line("normal", "dispatch BF16", 24, 87.7, 654.0, NORMAL),
    line("normal", "  of which notify (BF16)", 24, 18.8, 0.0, NORMAL),
    line("normal", "dispatch FP8 cached", 24, 71.6, 420.0, NORMAL),
    line("normal", "combine BF16", 24, 69.6, 800.0, NORMAL),
    line("normal", "copy engine: read next rank", 0, 90.0, 370.0, NORMAL),
    line("normal", "NCCL all-to-all BF16 rows", 0, 44.4, 1290.0, NORMAL),
    line("normal", "NCCL all-to-all FP8 rows", 0, 30.1, 990.0, NORMAL),
    line("low-latency", "LL dispatch FP8", 0, 26.4, 280.0, LOW_LATENCY),
    line("low-latency", "LL combine LogFMT <&>", 0, 59.8, 150.0, LOW_LATENCY),
    line("low-latency", "NCCL all-to-all FP8 selections", 0, 39.4, 190.0, LOW_LATENCY),
    line("low-latency", "NCCL all-to-all BF16 selections", 0, 53.8, 270.0, LOW_LATENCY),
])


def _sections(text=RUN):
    return bench_plot.sections_of(plot.parse_texts([("bench.json", text)]))


def test_one_section_per_mode_of_each_run():
    sections = _sections()
    assert [title for title, _ in sections] == [NORMAL, LOW_LATENCY]
    # The reader leaves out the breakdown (no bytes) and the copy-engine ceiling.
    assert [row.op for row in sections[0][1]] == ["dispatch BF16", "dispatch FP8 cached", "combine BF16",
                                                  "NCCL all-to-all BF16 rows", "NCCL all-to-all FP8 rows"]
    # Two runs in one file (an op comes again): two normal sections.
    assert [title for title, _ in _sections(RUN + RUN)] == [NORMAL, LOW_LATENCY, NORMAL, LOW_LATENCY]
    assert _sections("") == []


def test_ops_are_drawn_beside_the_nccl_row_of_their_format():
    rows = _sections()[0][1]
    assert [bench_plot.nccl_baseline_of(rows, i) for i in range(len(rows))] == [3, 4, 3, None, None]
    assert [bench_plot.is_plotted_op(row) for row in rows] == [True, True, True, False, False]
    assert bench_plot.nccl_baseline_of(_sections()[1][1], 1) is None  # LogFMT: no NCCL of its format
    # A run without NCCL (built without it): no baselines.
    assert bench_plot.nccl_baseline_of(_sections(line("normal", "dispatch BF16", 24, 1, 1, NORMAL))[0][1], 0) is None


def test_svg_shows_every_op_with_its_nccl_bar_and_labels():
    svg = bench_plot.render_svg(_sections())
    assert svg.startswith("<svg ") and svg.endswith("</svg>\n")
    root = ET.fromstring(svg)  # raises on anything not well-formed
    assert root.tag == SVG + "svg"
    texts = [t.text for t in root.iter(SVG + "text")]
    for label in ("dispatch BF16, 24 SMs", "dispatch FP8 cached, 24 SMs", "combine BF16, 24 SMs", "LL dispatch FP8",
                  "LL combine LogFMT <&>", NORMAL, LOW_LATENCY, "87.7 \u00b5s, 654 GB/s", "44.4 \u00b5s, 1290 GB/s"):
        assert label in texts, label
    assert not any("notify" in t or "copy engine" in t for t in texts)
    classes = [r.get("class") for r in root.iter(SVG + "rect")]
    assert classes.count("epx") == 5 and classes.count("nccl") == 4  # LogFMT has no NCCL bar
    assert "LL combine LogFMT &lt;&amp;&gt;" in svg and "2 ranks &amp; more" in svg


def test_svg_is_well_formed_without_results():
    for sections in ([], [("only breakdowns", [])]):
        assert ET.fromstring(bench_plot.render_svg(sections)).tag == SVG + "svg"


def _run(args):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))  # python/ only: no compiled epx
    return subprocess.run([sys.executable, "-m", "epx_tools.bench_plot"] + args, env=env, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def test_command_line(tmp_path):
    results = tmp_path / "bench.json"
    results.write_text(RUN, encoding="utf-8")
    out = tmp_path / "bench.svg"
    done = _run([str(results), "--out", str(out)])
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"wrote {out}\n"
    assert ET.parse(out).getroot().tag == SVG + "svg"

    refused = _run([str(results), "--out", str(tmp_path / "bench.png")])
    assert refused.returncode == 2 and not (tmp_path / "bench.png").exists()
    assert refused.stderr.endswith("invalid --out = " + str(tmp_path / "bench.png") + ": must end in .svg (the plot "
                                   "is an SVG file)\n")
    missing = _run([str(tmp_path / "missing.json"), "--out", str(out)])
    assert missing.returncode == 2 and missing.stderr.startswith("python -m epx_tools.bench_plot: cannot read ")

    # epx-bench's CPU reference run (no GPU): CPU times, nothing to plot; no file written.
    cpu = tmp_path / "cpu.json"
    cpu.write_text('{"mode":"cpu-reference","gpu":false,"num_ranks":2,"results":[]}\n', encoding="utf-8")
    nothing = _run([str(cpu), "--out", str(tmp_path / "cpu.svg")])
    assert nothing.returncode == 1 and not (tmp_path / "cpu.svg").exists()
    assert nothing.stderr.startswith(f"python -m epx_tools.bench_plot: nothing to plot in {cpu} (CPU times")
