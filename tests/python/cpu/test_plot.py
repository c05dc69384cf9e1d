"""python -m epx_tools.plot: the benchmark JSON (epx-bench --json-file, python -m epx_tools.bench --json-file) read into
series, what it skips, where token counts come from, the figures it plans; drawing PNG and SVG when matplotlib
is importable; the one-line error without it. plot.py is loaded from its file: it needs neither the compiled
epx nor matplotlib to read the JSON."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PLOT_PY = os.path.join(ROOT, "python", "epx_tools", "plot.py")


def _load():
    spec = importlib.util.spec_from_file_location("epx_plot_under_test", PLOT_PY)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


plot = _load()

# epx-bench --json-file on one H200 (1 rank) at --tokens 4096 and 16384, as written (bench_report.cpp).
BENCH_4096 = """\
{"mode":"normal","op":"dispatch BF16","num_sms":24,"num_ranks":1,"mean_us":97.34,"slowest_us":97.34,"gbps_mean":603.22,"gbps_min":603.22}
{"mode":"normal","op":"  of which notify (BF16)","num_sms":24,"num_ranks":1,"mean_us":20.96,"slowest_us":20.96,"gbps_mean":0.00,"gbps_min":0.00}
{"mode":"normal","op":"dispatch BF16 cached","num_sms":24,"num_ranks":1,"mean_us":90.34,"slowest_us":90.34,"gbps_mean":650.02,"gbps_min":650.02}
{"mode":"normal","op":"dispatch FP8","num_sms":24,"num_ranks":1,"mean_us":89.92,"slowest_us":89.92,"gbps_mean":336.72,"gbps_min":336.72}
{"mode":"normal","op":"  of which notify (FP8)","num_sms":24,"num_ranks":1,"mean_us":20.67,"slowest_us":20.67,"gbps_mean":0.00,"gbps_min":0.00}
{"mode":"normal","op":"dispatch FP8 cached","num_sms":24,"num_ranks":1,"mean_us":82.75,"slowest_us":82.75,"gbps_mean":365.88,"gbps_min":365.88}
{"mode":"normal","op":"combine BF16","num_sms":24,"num_ranks":1,"mean_us":147.17,"slowest_us":147.17,"gbps_mean":399.00,"gbps_min":399.00}
{"mode":"normal","op":"NCCL all-to-all BF16 rows","num_sms":0,"num_ranks":1,"mean_us":45.98,"slowest_us":45.98,"gbps_mean":1276.97,"gbps_min":1276.97}
{"mode":"normal","op":"NCCL all-to-all FP8 rows","num_sms":0,"num_ranks":1,"mean_us":30.88,"slowest_us":30.88,"gbps_mean":980.49,"gbps_min":980.49}
"""  # noqa: E501
BENCH_16384 = """\
{"mode":"normal","op":"dispatch BF16","num_sms":24,"num_ranks":1,"mean_us":272.13,"slowest_us":272.13,"gbps_mean":863.13,"gbps_min":863.13}
{"mode":"normal","op":"  of which notify (BF16)","num_sms":24,"num_ranks":1,"mean_us":21.70,"slowest_us":21.70,"gbps_mean":0.00,"gbps_min":0.00}
{"mode":"normal","op":"dispatch BF16 cached","num_sms":24,"num_ranks":1,"mean_us":297.60,"slowest_us":297.60,"gbps_mean":789.25,"gbps_min":789.25}
{"mode":"normal","op":"dispatch FP8","num_sms":24,"num_ranks":1,"mean_us":253.41,"slowest_us":253.41,"gbps_mean":477.93,"gbps_min":477.93}
{"mode":"normal","op":"  of which notify (FP8)","num_sms":24,"num_ranks":1,"mean_us":21.54,"slowest_us":21.54,"gbps_mean":0.00,"gbps_min":0.00}
{"mode":"normal","op":"dispatch FP8 cached","num_sms":24,"num_ranks":1,"mean_us":274.53,"slowest_us":274.53,"gbps_mean":441.16,"gbps_min":441.16}
{"mode":"normal","op":"combine BF16","num_sms":24,"num_ranks":1,"mean_us":549.57,"slowest_us":549.57,"gbps_mean":427.39,"gbps_min":427.39}
{"mode":"normal","op":"NCCL all-to-all BF16 rows","num_sms":0,"num_ranks":1,"mean_us":137.79,"slowest_us":137.79,"gbps_mean":1704.61,"gbps_min":1704.61}
{"mode":"normal","op":"NCCL all-to-all FP8 rows","num_sms":0,"num_ranks":1,"mean_us":77.18,"slowest_us":77.18,"gbps_mean":1569.11,"gbps_min":1569.11}
"""  # noqa: E501
EPX_NORMAL_OPS = ["dispatch BF16", "dispatch BF16 cached", "dispatch FP8", "dispatch FP8 cached", "combine BF16"]
NCCL_NORMAL_OPS = ["NCCL all-to-all BF16 rows", "NCCL all-to-all FP8 rows"]
LL_OPS = ["LL dispatch FP8", "LL dispatch BF16", "LL combine BF16", "LL combine LogFMT", "LL dispatch FP8 send (hook)",
          "LL dispatch FP8 recv (hook)", "LL combine BF16 send (hook)", "LL combine BF16 recv (hook)",
          "NCCL all-to-all FP8 selections", "NCCL all-to-all BF16 selections"]


def line(mode, op, sms, us, gbps, ranks=8, slowest=None, gbps_min=None):
    """One JSON line as bench_report.cpp / epx_tools.bench.format_rows write it."""
    return (f'{{"mode":"{mode}","op":"{op}","num_sms":{sms},"num_ranks":{ranks},"mean_us":{us:.2f},'
            f'"slowest_us":{(slowest or us):.2f},"gbps_mean":{gbps:.2f},"gbps_min":{(gbps_min or gbps):.2f}}}')


def normal_run(scale=1.0, budgets=(12, 24, 48), copy_engine=True):
    lines = []
    for sms in budgets:
        k = sms / 24
        for i, op in enumerate(EPX_NORMAL_OPS):
            lines.append(line("normal", op, sms, 100.0 / k + i, (300 + 50 * i) * k * scale, gbps_min=250 * k * scale))
            if op in ("dispatch BF16", "dispatch FP8"):
                lines.append(line("normal", f"  of which notify ({op[-4:].strip()})", sms, 20.0, 0.0))
    if copy_engine:
        lines.append(line("normal", "copy engine: read next rank", 0, 50.0, 700.0))
    lines.append(line("normal", "NCCL all-to-all BF16 rows", 0, 46.0, 1200.0 * scale))
    lines.append(line("normal", "NCCL all-to-all FP8 rows", 0, 31.0, 900.0 * scale))
    return "\n".join(lines) + "\n"


def ll_run(scale=1.0):
    lines = [line("low-latency", op, 0, (10.0 + i) * scale, 100.0 * (i + 1)) for i, op in enumerate(LL_OPS)]
    return "\n".join(lines) + "\n"


def series_of(figure):
    return {s.label: s for s in figure.series}


# ---- Reading the JSON ----


def test_real_epx_bench_files_become_figures():
    results = plot.parse_texts([("bench-4096.json", BENCH_4096), ("bench-16384.json", BENCH_16384)])
    assert len(results.rows) == 14 and {r.mode for r in results.rows} == {"normal"}
    assert [r.tokens for r in results.rows] == [4096] * 7 + [16384] * 7
    assert [str(s) for s in results.skipped] == [
        f"{name}:{n}: of which notify ({fmt}): no bytes counted (it breaks another row's time down)"
        for name in ("bench-4096.json", "bench-16384.json") for n, fmt in ((2, "BF16"), (5, "FP8"))]
    assert any("4096 tokens/rank (from the file name)" in n for n in results.notes)

    figures = plot.plan_figures(results)
    assert [(f.name, f.kind) for f in figures] == [("normal-sms-t4096", "sms"), ("normal-sms-t16384", "sms"),
                                                   ("normal-tokens", "tokens-normal")]
    sms = series_of(figures[0])
    assert list(sms) == EPX_NORMAL_OPS + NCCL_NORMAL_OPS
    assert sms["dispatch BF16"].x == [24.0] and sms["dispatch BF16"].gbps == [603.22]
    assert sms["dispatch BF16"].us == [97.34] and not sms["dispatch BF16"].baseline
    assert sms["NCCL all-to-all BF16 rows"].baseline and sms["NCCL all-to-all BF16 rows"].gbps == [1276.97]
    assert figures[0].context == "normal mode, 1 rank, 4096 tokens/rank"
    assert "2H BF16" in figures[0].bytes_note and figures[0].sources == ["bench-4096.json"]

    tokens = series_of(figures[2])
    assert tokens["dispatch FP8"].x == [4096.0, 16384.0] and tokens["dispatch FP8"].gbps == [336.72, 477.93]
    assert tokens["NCCL all-to-all FP8 rows"].baseline and tokens["NCCL all-to-all FP8 rows"].gbps == [980.49, 1569.11]
    assert "(24 SMs)" in figures[2].title and figures[2].sources == ["bench-4096.json", "bench-16384.json"]


def test_sm_budgets_are_the_x_axis_and_nccl_the_baseline():
    results = plot.parse_texts([("sweep.json", normal_run())], tokens=[4096])
    (figure,) = plot.plan_figures(results)
    assert figure.name == "normal-sms-t4096" and figure.context == "normal mode, 8 ranks, 4096 tokens/rank"
    s = series_of(figure)
    assert s["dispatch BF16"].x == [12.0, 24.0, 48.0]
    assert s["dispatch BF16"].gbps == pytest.approx([150.0, 300.0, 600.0])
    assert s["dispatch BF16"].us == pytest.approx([200.0, 100.0, 50.0])
    assert [label for label, x in s.items() if x.baseline] == NCCL_NORMAL_OPS
    # The slowest rank instead of the mean.
    (slowest,) = plot.plan_figures(results, stat="min")
    assert series_of(slowest)["dispatch BF16"].gbps == pytest.approx([125.0, 250.0, 500.0])
    assert [str(k) for k in results.skipped if "copy" in str(k)] == [
        "sweep.json:22: copy engine: read next rank: copy-engine row (a link ceiling, not an all-to-all)"]


def test_concatenated_runs_split_where_an_op_comes_again():
    text = normal_run(1.0) + normal_run(2.0)
    results = plot.parse_texts([("all.json", text)], tokens=[1024, 8192])
    assert sorted({r.run for r in results.rows}) == [0, 1]
    names = [f.name for f in plot.plan_figures(results)]
    assert names == ["normal-sms-t1024", "normal-sms-t8192", "normal-tokens"]
    tokens = series_of(plot.plan_figures(results)[-1])
    assert tokens["dispatch BF16, 48 SMs"].x == [1024.0, 8192.0]
    assert tokens["dispatch BF16, 48 SMs"].gbps == pytest.approx([600.0, 1200.0])
    assert tokens["NCCL all-to-all BF16 rows"].gbps == pytest.approx([1200.0, 2400.0])

    # Without token counts: one figure per run, and a note saying how to give them.
    bare = plot.parse_texts([("all.json", text)])
    assert [f.name for f in plot.plan_figures(bare)] == ["normal-sms-run1", "normal-sms-run2"]
    assert any("carry no token count" in n and "--tokens" in n for n in bare.notes)
    with pytest.raises(plot.PlotError, match="--tokens lists 1 token count"):
        plot.parse_texts([("all.json", text)], tokens=[4096])


def test_repeated_runs_at_the_same_token_count_are_averaged():
    results = plot.parse_texts([("a-4096.json", normal_run(1.0)), ("b-4096.json", normal_run(3.0))])
    figures = plot.plan_figures(results)
    assert [f.name for f in figures] == ["normal-sms-t4096"]
    assert series_of(figures[0])["dispatch BF16"].gbps == pytest.approx([300.0, 600.0, 1200.0])
    assert any("mean of 2 runs" in n for n in results.notes)


def test_low_latency_tables():
    # A low-latency-only file: its name's number is the low-latency token count.
    results = plot.parse_texts([("ll-128.json", ll_run(1.0)), ("ll-256.json", ll_run(2.0))])
    figures = plot.plan_figures(results)
    assert [(f.name, f.kind) for f in figures] == [("low-latency-t128", "ll-ops"), ("low-latency-t256", "ll-ops"),
                                                   ("low-latency-tokens", "tokens-ll")]
    ops = series_of(figures[0])
    assert list(ops) == LL_OPS and ops["LL dispatch FP8"].gbps == [100.0] and ops["LL dispatch FP8"].us == [10.0]
    assert [label for label, s in ops.items() if s.baseline] == LL_OPS[-2:]
    assert "H + H/32 + 16 FP8" in figures[0].bytes_note and "low-latency mode" in figures[0].context
    latency = series_of(figures[2])
    assert latency["LL combine BF16"].x == [128.0, 256.0] and latency["LL combine BF16"].us == [12.0, 24.0]


def test_mixed_file_name_counts_only_the_normal_rows():
    # epx-bench --mode all: the file name's number is --tokens, not --ll-tokens.
    results = plot.parse_texts([("bench-4096.json", normal_run() + ll_run())])
    assert {r.tokens for r in results.rows if r.mode == "normal"} == {4096}
    assert {r.tokens for r in results.rows if r.mode == "low-latency"} == {None}
    assert [f.name for f in plot.plan_figures(results)] == ["normal-sms-t4096", "low-latency"]
    given = plot.parse_texts([("bench-4096.json", normal_run() + ll_run())], ll_tokens=[128])
    assert [f.name for f in plot.plan_figures(given)] == ["normal-sms-t4096", "low-latency-t128"]


def test_what_cannot_be_plotted_is_listed():
    cpu_reference = ('{"mode":"cpu-reference","gpu":false,"num_ranks":4,"shape":{"num_tokens":64},"note":"CPU '
                     'times","results":[{"op":"normal dispatch","format":"fp8","cpu_ms":0.087,"verified":true}],'
                     '"verified":true}')
    text = "\n".join([cpu_reference, "epx-bench on 1 x NVIDIA H100 80GB HBM3", "[1, 2]", '{"mode":"normal"}',
                      line("normal", "dispatch BF16", 24, 0.0, 10.0), line("other", "dispatch BF16", 24, 1.0, 1.0),
                      line("normal", "combine BF16", 24, 10.0, 100.0)])
    results = plot.parse_texts([("mixed.json", text)])
    assert [r.op for r in results.rows] == ["combine BF16"]
    assert [str(s) for s in results.skipped] == [
        "mixed.json:1: CPU reference run: CPU times of the reference, no GPU numbers to plot",
        "mixed.json:2: not JSON ('epx-bench on 1 x NVIDIA H100 80GB HBM3')",
        "mixed.json:3: a JSON value that is not an object",
        "mixed.json:4: a JSON object without \"op\"",
        "mixed.json:5: dispatch BF16: no positive time",
        "mixed.json:6: dispatch BF16: mode 'other' is neither normal nor low-latency",
    ]
    lines = plot.summary(results)
    assert lines[0] == "skipped 6 row(s) that cannot be plotted:"


def test_header_and_table_objects():
    """A header object before the rows, and a table object with per-rank times and bytes (GB/s computed as
    bench_report.cpp does: bytes / (us * 1e3) per rank, mean and min over ranks)."""
    header = ("normal mode: 2 ranks, 2048 tokens/rank, hidden 7168, top-8 of 256 experts (GB/s = rows received x "
              "row bytes / time; verified before timing)")
    text = json.dumps({"mode": "normal", "header": header, "machine": "2 x NVIDIA H200"}) + "\n" + \
        line("normal", "dispatch BF16", 24, 10.0, 500.0, ranks=2) + "\n"
    table = {"mode": "low-latency", "num_ranks": 2,
             "header": "low-latency mode: 2 ranks, 64 tokens/rank, hidden 7168, top-8 of 288 experts (GB/s = "
                       "selections x bytes per selection / time; verified before timing)",
             "rows": [{"op": "LL dispatch FP8", "num_sms": 0, "time_us": [10.0, 20.0], "bytes": [4e6, 4e6]},
                      {"op": "LL combine BF16", "num_sms": 0, "time_us": [10.0, 10.0], "bytes": [0, 0]}]}
    results = plot.parse_texts([("h.json", text), ("t.json", json.dumps(table, indent=1))])
    assert results.machine == "2 x NVIDIA H200"
    normal, ll = results.rows
    assert (normal.tokens, normal.num_ranks) == (2048, 2)
    assert (ll.tokens, ll.num_ranks, ll.mean_us, ll.slowest_us) == (64, 2, 15.0, 20.0)
    assert (ll.gbps_mean, ll.gbps_min) == pytest.approx((300.0, 200.0))
    assert [str(s) for s in results.skipped] == [
        "t.json row 1: LL combine BF16: no bytes counted (it breaks another row's time down)"]
    figures = plot.plan_figures(results)
    assert figures[0].context == ("2 x NVIDIA H200; normal mode: 2 ranks, 2048 tokens/rank, hidden 7168, top-8 of "
                                  "256 experts")
    assert figures[0].bytes_note == "GB/s = rows received x row bytes / time"
    assert figures[1].name == "low-latency-t64" and figures[1].bytes_note.startswith("GB/s = selections")


@pytest.mark.parametrize("name, tokens", [("bench-4096.json", 4096), ("run_t16384.json", 16384),
                                          ("bench-4096-h200.json", 4096), ("8gpus-2048.json", 2048),
                                          ("tokens512", 512), ("results.json", None), ("a-1-2.json", None),
                                          ("/x/y-7/bench.json", None)])
def test_token_count_from_the_file_name(name, tokens):
    assert plot._name_tokens(name) == tokens


# ---- Command line ----


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_list_prints_series_and_skips(tmp_path, capsys):
    a, b = write(tmp_path, "bench-4096.json", BENCH_4096), write(tmp_path, "bench-16384.json", BENCH_16384)
    assert plot.main([a, b, "--list"]) == 0
    out = capsys.readouterr().out
    assert "normal-sms-t4096: EPX normal mode: GB/s against SM budget" in out
    assert "  dispatch BF16: SMs [24] GB/s [603.2] us [97.3]" in out
    assert "  NCCL all-to-all BF16 rows (baseline): tokens [4096, 16384] GB/s [1277.0, 1704.6]" in out
    assert "skipped 4 row(s) that cannot be plotted:" in out and "of which notify (FP8)" in out
    assert not list(tmp_path.glob("*.png"))


def test_cli_errors(tmp_path, capsys):
    assert plot.main([str(tmp_path / "missing.json")]) == 2
    assert capsys.readouterr().err.startswith("python -m epx_tools.plot: cannot read ")
    empty = write(tmp_path, "notify-only.json", line("normal", "  of which notify (BF16)", 24, 20.0, 0.0) + "\n")
    assert plot.main([empty, "--out", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "nothing to plot" in captured.err and "of which notify (BF16)" in captured.out
    assert plot.main([empty, "--tokens", "x"]) == 2
    assert "--tokens 'x': must be a comma-separated list of integers" in capsys.readouterr().err


def _run(args, env_extra=None, code=None):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(env_extra or {})
    cmd = [sys.executable, "-c", code] if code else [sys.executable] + args
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_runs_as_a_file_without_epx_or_matplotlib(tmp_path):
    """The JSON is read with the standard library only; without matplotlib, drawing fails with one line and
    exit code 2 (matplotlib blocked here whether or not it is installed)."""
    path = write(tmp_path, "bench-4096.json", BENCH_4096)
    out_dir = str(tmp_path / "out")
    code = f"""
import runpy, sys
sys.modules["matplotlib"] = None  # import matplotlib raises ImportError
sys.argv = ["plot.py", {path!r}, "--out", {out_dir!r}]
try:
    runpy.run_path({PLOT_PY!r}, run_name="__main__")
except SystemExit as e:
    assert "epx" not in sys.modules and "epx._epx" not in sys.modules, sorted(sys.modules)
    sys.exit(e.code)
"""
    done = _run(None, code=code)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith("python -m epx_tools.plot: drawing needs matplotlib, which is not installed")
    assert not os.path.exists(out_dir)
    listed = _run([PLOT_PY, path, "--list"])
    assert listed.returncode == 0, listed.stderr
    assert "normal-sms-t4096" in listed.stdout


# ---- Drawing (with matplotlib) ----


def _check_images(paths):
    for path in paths:
        assert os.path.getsize(path) > 1000, path
        with open(path, "rb") as f:
            head = f.read(200)
        if path.endswith(".png"):
            assert head.startswith(b"\x89PNG\r\n\x1a\n"), path
        else:
            assert path.endswith(".svg") and b"<svg" in head, path


def test_draws_png_and_svg(tmp_path):
    pytest.importorskip("matplotlib")
    results = plot.parse_texts([("bench-4096.json", normal_run(1.0) + ll_run(1.0)),
                                ("bench-16384.json", normal_run(1.5) + ll_run(2.0)),
                                ("bench-1024.json", BENCH_4096)], ll_tokens=[128, 256, 64])
    results.machine = "8 x NVIDIA H200"
    figures = plot.plan_figures(results)
    # Runs of different rank counts are not drawn on one line: the normal figures split by ranks.
    assert [(f.name, f.kind) for f in figures] == [
        ("normal-sms-t1024-1ranks", "sms"), ("normal-sms-t4096-8ranks", "sms"), ("normal-sms-t16384-8ranks", "sms"),
        ("normal-tokens-8ranks", "tokens-normal"), ("low-latency-t128", "ll-ops"), ("low-latency-t256", "ll-ops"),
        ("low-latency-tokens", "tokens-ll")]
    written = plot.draw(figures, str(tmp_path / "plots"))
    assert sorted(written) == sorted(str(tmp_path / "plots" / f"{f.name}.{ext}") for f in figures
                                     for ext in ("png", "svg"))
    _check_images(written)
    # The SVG holds the titles' text.
    svg = (tmp_path / "plots" / "normal-sms-t4096-8ranks.svg").read_text(encoding="utf-8")
    assert "SM budget" in svg and "8 x NVIDIA H200" in svg


def test_cli_draws_into_out(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    a, b = write(tmp_path, "bench-4096.json", BENCH_4096), write(tmp_path, "bench-16384.json", BENCH_16384)
    out_dir = tmp_path / "out"
    assert plot.main([a, b, "--out", str(out_dir), "--machine", "1 x H100", "--stat", "min"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out_dir / 'normal-tokens'}.{{png,svg}}" in printed and "skipped 4 row(s)" in printed
    names = sorted(p.name for p in out_dir.iterdir())
    assert names == sorted(f"{stem}.{ext}" for stem in ("normal-sms-t4096", "normal-sms-t16384", "normal-tokens")
                           for ext in ("png", "svg"))
    _check_images([str(out_dir / n) for n in names])


def test_python_dash_m_epx_tools_plot(tmp_path):
    """python -m epx_tools.plot with only python/ on PYTHONPATH: no compiled epx needed."""
    pytest.importorskip("matplotlib")
    path = write(tmp_path, "bench-4096.json", BENCH_4096)
    done = _run(["-m", "epx_tools.plot", path, "--out", str(tmp_path / "m")],
                env_extra={"PYTHONPATH": os.path.join(ROOT, "python")})
    assert done.returncode == 0, done.stderr
    _check_images([str(tmp_path / "m" / "normal-sms-t4096.png"), str(tmp_path / "m" / "normal-sms-t4096.svg")])
