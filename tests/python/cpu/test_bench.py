"""python -m epx_tools.bench without a GPU: its flags (those of the C++ epx-bench: the same names, defaults, rules and
messages, checked against the epx-bench built beside the binding), the byte formulas of docs/BENCHMARKS.md, the
report's format (bench/bench_report.cpp's printf formats), the host barrier, the exit status 1 without GPUs,
and (with torch on the CPU) the inputs and the correctness checks against a simulated dispatch/combine."""

import multiprocessing
import os
import subprocess
import sys

import pytest

import epx_tools.bench as bench

# ---- Flags: epx-bench's (bench/epx_bench.cpp), with its defaults, rules and messages ----


def test_defaults_match_epx_bench():
    o = bench.parse_args([])
    assert o.mode == "all" and o.ranks == 0
    assert (o.tokens, o.hidden, o.topk, o.experts) == (4096, 7168, 8, 256)
    assert o.num_sms == [24]
    assert (o.ranks_per_node, o.nvl_chunk, o.nvl_queue, o.rdma_chunk, o.rdma_queue) == (0, 0, 0, 0, 0)
    assert not o.tune and o.ranks_per_gpu == 1
    assert (o.ll_tokens, o.ll_experts, o.ll_ranks_per_node) == (128, 288, 0)
    assert (o.warmup, o.iters) == (5, 30)
    assert not o.json and o.json_file == ""
    assert o.seed == 1 and o.launch_ahead_us == 200.0


def test_every_flag():
    o = bench.parse_args(["--mode", "normal", "--ranks", "2", "--tokens", "512", "--hidden", "2048", "--topk", "4",
                          "--experts", "64", "--num-sms", "12,24,48", "--ll-tokens", "64", "--ll-experts", "32",
                          "--warmup", "0", "--iters", "3", "--json", "--json-file", "out.jsonl", "--seed", "9",
                          "--launch-ahead-us", "0", "--ranks-per-gpu", "1",
                          "--nvl-chunk", "0", "--nvl-queue", "0", "--rdma-chunk", "0", "--rdma-queue", "0",
                          "--ll-ranks-per-node", "1"])
    assert o.mode == "normal" and o.ranks == 2
    assert (o.tokens, o.hidden, o.topk, o.experts) == (512, 2048, 4, 64)
    assert o.num_sms == [12, 24, 48]
    assert (o.ll_tokens, o.ll_experts, o.warmup, o.iters, o.ll_ranks_per_node) == (64, 32, 0, 3, 1)
    assert o.json and o.json_file == "out.jsonl" and o.seed == 9 and o.launch_ahead_us == 0
    # --flag=value as well; zero tokens (a rank with nothing to send) as epx-bench allows.
    o = bench.parse_args(["--tokens=0", "--num-sms=8,16,", "--launch-ahead-us=12.5"])
    assert o.tokens == 0 and o.num_sms == [8, 16] and o.launch_ahead_us == 12.5


# The same mistakes, the same messages as epx-bench's (tests/cpu/test_bench_options.cpp, bench/CMakeLists.txt);
# test_both_benches_reject_the_same_values runs each through epx-bench too.
SHARED_REJECTIONS = [
    (["--mode", "fast"], "invalid --mode = fast: must be normal, low-latency or all"),
    (["--ranks", "0"], "invalid --ranks = 0: must be >= 1"),
    (["--ranks", "9"], "invalid --ranks = 9: must be <= 8 (one NVLink domain)"),
    (["--tokens", "x"], "invalid --tokens = x: must be an integer"),
    (["--tokens", "5_0"], "invalid --tokens = 5_0: must be an integer"),
    (["--tokens", "4294967296"], "invalid --tokens = 4294967296: must be an integer"),
    (["--tokens", "-1"], "invalid --tokens = -1: must be >= 0"),
    (["--hidden", "0"], "invalid --hidden = 0: must be > 0"),
    (["--hidden", "7000"], "invalid --hidden = 7000: must be a multiple of 128 (FP8 is benchmarked)"),
    (["--mode", "low-latency", "--hidden", "7000"], "must be a multiple of 128"),
    (["--topk", "0"], "invalid --topk = 0: must be >= 1"),
    (["--topk", "40"], "invalid --topk = 40: must be <= 16"),
    (["--experts", "4"], "invalid --experts = 4: must be >= --topk"),
    (["--num-sms", "24,0"], "invalid --num-sms = 0: must be >= 1"),
    (["--num-sms", "12,x"], "invalid --num-sms = x: must be an integer"),
    (["--num-sms", ""], "invalid --num-sms = : must list at least one value"),
    (["--ranks-per-node", "-1"], "invalid --ranks-per-node = -1: must be >= 0 (0: one node)"),
    (["--ranks", "4", "--ranks-per-node", "3"],
     "invalid --ranks-per-node = 3: must divide --ranks (4): nodes are equal blocks of ranks"),
    (["--ranks", "4", "--ll-ranks-per-node", "3"],
     "invalid --ll-ranks-per-node = 3: must divide --ranks (4): nodes are equal blocks of ranks"),
    (["--ll-ranks-per-node", "-1"], "invalid --ll-ranks-per-node = -1: must be >= 0 (0: one node)"),
    (["--nvl-chunk", "-1"], "invalid --nvl-chunk = -1: must be >= 0 (0: recommended)"),
    (["--nvl-queue", "-1"], "invalid --nvl-queue = -1: must be >= 0 (0: recommended)"),
    (["--rdma-chunk", "-1"], "invalid --rdma-chunk = -1: must be >= 0 (0: the default)"),
    (["--rdma-queue", "-1"], "invalid --rdma-queue = -1: must be >= 0 (0: the default)"),
    (["--ll-tokens", "0"], "invalid --ll-tokens = 0: must be >= 1"),
    (["--ll-experts", "7"], "invalid --ll-experts = 7: must be >= --topk"),
    (["--ranks-per-gpu", "0"], "invalid --ranks-per-gpu = 0: must be >= 1"),
    (["--warmup", "-1"], "invalid --warmup = -1: must be >= 0"),
    (["--iters", "0"], "invalid --iters = 0: must be >= 1"),
    (["--seed", "-1"], "invalid --seed = -1: must be >= 0"),
    (["--launch-ahead-us", "-1"], "invalid --launch-ahead-us = -1: must be >= 0"),
    (["--launch-ahead-us", "x"], "invalid --launch-ahead-us = x: must be a number"),
    (["--launch-ahead-us", "inf"], "invalid --launch-ahead-us = inf: must be a number"),
    (["--unknown"], "unknown flag --unknown (see --help)"),
    (["--tok", "5"], "unknown flag --tok (see --help)"),  # no abbreviations
    (["--tokens"], "--tokens needs a value (see --help)"),
    (["--json=1"], "--json takes no value (see --help)"),
]

# Features only epx-bench has: it takes these, this bench refuses them (rather than ignoring them).
EPX_BENCH_ONLY = [
    (["--tune"], "--tune is epx-bench's (a sweep of NVLink configs through the C++ API): run epx-bench --tune"),
    (["--ranks-per-gpu", "2"], "invalid --ranks-per-gpu = 2: must be 1 in python -m epx_tools.bench"),
    (["--nvl-chunk", "8"], "invalid --nvl-chunk = 8: must be 0 in python -m epx_tools.bench (it times the Buffer's"),
    (["--nvl-queue", "512"], "invalid --nvl-queue = 512: must be 0 in python -m epx_tools.bench"),
    (["--rdma-chunk", "16"], "invalid --rdma-chunk = 16: must be 0 in python -m epx_tools.bench"),
    (["--rdma-queue", "128"], "invalid --rdma-queue = 128: must be 0 in python -m epx_tools.bench"),
]


def _python_error(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"{bench.PROG}: ") and err.endswith("\n")
    return err[len(bench.PROG) + 2:-1]


@pytest.mark.parametrize("argv, message", SHARED_REJECTIONS + EPX_BENCH_ONLY)
def test_bad_flags_exit_2_with_epx_bench_s_message(argv, message, capsys):
    assert message in _python_error(argv, capsys)


def test_help_exits_0(capsys):
    for flag in ("--help", "-h"):
        with pytest.raises(SystemExit) as exit_info:
            bench.parse_args(["--tokens", "-1", flag])  # as epx-bench: help before the range rules
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: python -m epx_tools.bench") and "--launch-ahead-us" in out


# ---- The two parsers side by side: epx-bench (built beside the binding) and this one ----


def _epx_bench():
    """The epx-bench built with this binding (<build>/bench/epx-bench), or $EPX_BENCH; None when neither."""
    path = os.environ.get("EPX_BENCH")
    if not path:
        import epx

        build = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(epx._epx.__file__))))
        path = os.path.join(build, "bench", "epx-bench")
    return path if os.access(path, os.X_OK) else None


@pytest.fixture(scope="module")
def epx_bench():
    path = _epx_bench()
    if path is None:
        pytest.skip("no epx-bench next to the binding (set EPX_BENCH to its path)")
    return path


def _run_epx_bench(path, argv):
    # A tiny shape in front (the later flags win), so an accepted command line's CPU reference run is quick.
    tiny = ["--ranks", "1", "--tokens", "4", "--hidden", "128", "--ll-tokens", "1", "--json"]
    return subprocess.run([path, *tiny, *argv], capture_output=True, text=True, timeout=120)


def test_both_benches_have_one_set_of_flags(epx_bench):
    import re

    help_text = subprocess.run([epx_bench, "--help"], capture_output=True, text=True, timeout=60, check=True).stdout

    def flags_in(text):  # the flags the help names, below its usage line
        return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text.split("\n", 1)[1].split("Bytes")[0]))

    assert flags_in(help_text) == set(bench.FLAGS), flags_in(help_text) ^ set(bench.FLAGS)
    assert flags_in(bench.HELP) == set(bench.FLAGS), flags_in(bench.HELP) ^ set(bench.FLAGS)


@pytest.mark.parametrize("argv, message", SHARED_REJECTIONS)
def test_both_benches_reject_the_same_values(epx_bench, argv, message, capsys):
    result = _run_epx_bench(epx_bench, argv)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("epx-bench: ")
    assert result.stderr[len("epx-bench: "):-1] == _python_error(argv, capsys)
    assert message in result.stderr


@pytest.mark.parametrize("argv", [["--tokens", "0"], ["--seed", "7"], ["--launch-ahead-us", "0"],
                                  ["--num-sms", "8,16,"], ["--tokens=2", "--mode=normal"], ["--ranks-per-gpu", "1"],
                                  ["--nvl-chunk", "0", "--rdma-queue", "0"], ["--topk", "16", "--experts", "16"]])
def test_both_benches_accept_the_same_values(epx_bench, argv):
    result = _run_epx_bench(epx_bench, argv)
    assert result.returncode == 0, result.stderr
    bench.parse_args(argv)


def test_what_only_one_bench_takes(epx_bench, capsys):
    for argv, message in EPX_BENCH_ONLY:  # epx-bench's features: it takes them, this bench refuses them
        assert _run_epx_bench(epx_bench, argv).returncode == 0, argv
        assert message in _python_error(argv, capsys)
    # This bench's launch-ahead spin: epx-bench has no Python host time to hide and takes only 0.
    assert bench.parse_args(["--launch-ahead-us", "50"]).launch_ahead_us == 50
    result = _run_epx_bench(epx_bench, ["--launch-ahead-us", "50"])
    assert result.returncode == 2
    assert "invalid --launch-ahead-us = 50: must be 0 in epx-bench" in result.stderr


def test_max_topk_is_the_binding_s():
    import epx

    assert bench.MAX_TOPK == epx.MAX_TOPK


def test_max_nvl_ranks_is_the_binding_s():
    import epx

    assert bench.MAX_NVL_RANKS == epx._epx.MAX_NVL_RANKS


# ---- Bytes (docs/BENCHMARKS.md) ----


def test_normal_bytes():
    assert bench.normal_row_bytes(7168, fp8=False) == 14336
    assert bench.normal_row_bytes(7168, fp8=True) == 7168 + 4 * 7168 / 128 == 7392
    assert bench.normal_bytes(1000, 7168, False) == 14_336_000
    assert bench.normal_bytes(1000, 7168, True) == 7_392_000
    # What NCCL moves per row: the same sizes, as integers.
    assert bench.nccl_row_bytes(7168, fp8=False, low_latency=False) == 14336
    assert bench.nccl_row_bytes(7168, fp8=True, low_latency=False) == 7392


def test_network_rows_count_each_token_once_per_other_node():
    # Tokens per node (get_dispatch_layout's num_tokens_per_rdma_rank): the own node's never cross.
    assert bench.network_rows([5, 7, 0, 2], own_node=1) == 7.0
    assert bench.network_rows([5, 7, 0, 2], own_node=0) == 9.0
    assert bench.network_rows([4], own_node=0) == 0.0
    assert bench.normal_bytes(bench.network_rows([5, 7], 0), 7168, False) == 7 * 14336


def test_ranks_per_node_flag():
    assert bench.parse_args([]).ranks_per_node == 0
    o = bench.parse_args(["--ranks", "4", "--ranks-per-node", "2"])
    assert o.ranks_per_node == 2 and bench.normal_ranks_per_node(o, 4) == 2
    assert bench.normal_ranks_per_node(bench.parse_args(["--ranks-per-node", "4"]), 4) == 4
    assert bench.normal_ranks_per_node(bench.parse_args([]), 4) == 4


def test_low_latency_bytes():
    assert bench.ll_selection_bytes(7168, "fp8") == 7168 + 7168 / 32 + 16 == 7408
    assert bench.ll_selection_bytes(7168, "bf16") == 14336
    assert bench.ll_selection_bytes(7168, "logfmt") == 1.25 * 7168 + 7168 / 32 == 9184
    assert bench.ll_bytes(128 * 8, 7168, "fp8") == 1024 * 7408
    assert bench.nccl_row_bytes(7168, fp8=True, low_latency=True) == 7408
    assert bench.nccl_row_bytes(7168, fp8=False, low_latency=True) == 14336
    with pytest.raises(ValueError, match="unknown low-latency format"):
        bench.ll_selection_bytes(7168, "fp4")


# ---- The report ----


def test_gbps():
    assert bench.BenchRow("x", 0, 500.0, 1e9).gbps() == 2000.0  # bytes / (us * 1e3)
    assert bench.BenchRow("x", 0, 0.0, 1e9).gbps() == 0.0


def _rank_rows():
    return [
        [bench.BenchRow("dispatch BF16", 24, 800.0, 4e8), bench.BenchRow("  of which notify (BF16)", 24, 50.0, 0.0)],
        [bench.BenchRow("dispatch BF16", 24, 1000.0, 5e8), bench.BenchRow("  of which notify (BF16)", 24, 70.0, 0.0)],
    ]


def test_table_has_epx_bench_format():
    lines = bench.format_rows(_rank_rows(), False, "normal mode: header", "normal")
    # bench_report.cpp: "\n%s\n", then "%-34s %5s %12s %12s %12s %12s\n", then "%-34s %5d %12.1f ...\n" per op.
    assert lines[0] == "" and lines[1] == "normal mode: header"
    assert lines[2] == "%-34s %5s %12s %12s %12s %12s" % ("op", "SMs", "mean us", "slowest us", "GB/s (mean)",
                                                        "GB/s (min)")
    # Mean time over ranks, slowest rank, mean of the ranks' GB/s, the smallest GB/s.
    assert lines[3] == "%-34s %5d %12.1f %12.1f %12.1f %12.1f" % ("dispatch BF16", 24, 900.0, 1000.0, 500.0, 500.0)
    assert lines[4] == "%-34s %5d %12.1f %12.1f %12.1f %12.1f" % ("  of which notify (BF16)", 24, 60.0, 70.0, 0, 0)
    assert len(lines) == 5


def test_json_has_epx_bench_format():
    rows = _rank_rows()
    rows[1][0] = bench.BenchRow("dispatch BF16", 24, 1000.0, 6e8)
    lines = bench.format_rows(rows, True, "normal mode: 2 ranks, 4096 tokens/rank", "normal")
    assert lines[0] == ('{"mode":"normal","op":"dispatch BF16","num_sms":24,"num_ranks":2,"mean_us":900.00,'
                        '"slowest_us":1000.00,"gbps_mean":550.00,"gbps_min":500.00,'
                        '"header":"normal mode: 2 ranks, 4096 tokens/rank"}')
    import json

    assert json.loads(lines[1])["op"] == "  of which notify (BF16)"
    assert bench.format_rows([], True, "h", "normal") == []


def test_headers():
    # bench_options.hpp's normal_header / low_latency_header word for word (tests/cpu/test_bench_options.cpp):
    # each mode's own shape, each count in the number it takes.
    o = bench.parse_args([])
    assert bench.normal_header(o, 4) == ("normal mode: 4 ranks, 4096 tokens/rank, hidden 7168, top-8 of 256 experts "
                                         "(GB/s = rows received x row bytes / time; verified before timing)")
    assert bench.low_latency_header(o, 4) == (
        "low-latency mode: 4 ranks, 128 tokens/rank, hidden 7168, top-8 of 288 experts (GB/s = selections x bytes "
        "per selection / time; verified before timing)")
    o = bench.parse_args(["--tokens", "1", "--ll-tokens", "1", "--experts", "8", "--ll-experts", "1", "--topk", "1"])
    assert bench.normal_header(o, 1) == ("normal mode: 1 rank, 1 token/rank, hidden 7168, top-1 of 8 experts (GB/s = "
                                         "rows received x row bytes / time; verified before timing)")
    assert bench.low_latency_header(o, 1) == (
        "low-latency mode: 1 rank, 1 token/rank, hidden 7168, top-1 of 1 expert (GB/s = selections x bytes per "
        "selection / time; verified before timing)")
    o = bench.parse_args(["--tokens", "1", "--experts", "8", "--topk", "1", "--ranks-per-node", "2",
                          "--ll-ranks-per-node", "4"])
    assert bench.normal_header(o, 4) == (
        "normal mode: 4 ranks (2 nodes of 2, NVSHMEM between them), 1 token/rank, hidden 7168, top-1 of 8 experts "
        "(GB/s = rows received x row bytes / time; net GB/s = rows crossing to other nodes, once per node, x row "
        "bytes / time; verified before timing)")
    assert bench.low_latency_header(o, 8).startswith(
        "low-latency mode: 8 ranks (2 nodes of 4, NVSHMEM between them), 128 tokens/rank, ")
    assert bench.count_of(0, "token", "tokens") == "0 tokens"


def test_report_across_nodes_adds_the_network_rates():
    rows = [[bench.BenchRow("dispatch BF16", 24, 800.0, 4e8, 1e8), bench.BenchRow("  of which notify (BF16)", 24,
                                                                                   50.0, 0.0)],
            [bench.BenchRow("dispatch BF16", 24, 1000.0, 5e8, 3e8), bench.BenchRow("  of which notify (BF16)", 24,
                                                                                    70.0, 0.0)]]
    assert rows[0][0].network_gbps() == 125.0
    lines = bench.format_rows(rows, False, "h", "normal")
    assert lines[2].endswith("%12s %12s" % ("net GB/s", "net (min)"))
    # Mean of the ranks' network GB/s (125 and 300), the smallest.
    assert lines[3] == "%-34s %5d %12.1f %12.1f %12.1f %12.1f %12.1f %12.1f" % (
        "dispatch BF16", 24, 900.0, 1000.0, 500.0, 500.0, 212.5, 125.0)
    import json

    line = json.loads(bench.format_rows(rows, True, "h", "normal")[0])
    assert (line["net_gbps_mean"], line["net_gbps_min"]) == (212.5, 125.0)
    # Within one node neither the columns nor the JSON fields appear.
    assert "net_gbps_mean" not in bench.format_rows(_rank_rows(), True, "h", "normal")[0]
    o = bench.parse_args(["--ranks-per-node", "2"])
    assert bench.normal_header(o, 4) == (
        "normal mode: 4 ranks (2 nodes of 2, NVSHMEM between them), 4096 tokens/rank, hidden 7168, top-8 of 256 "
        "experts (GB/s = rows received x row bytes / time; net GB/s = rows crossing to other nodes, once per node, x "
        "row bytes / time; verified before timing)")


def test_summaries_are_what_the_report_prints():
    rows = _rank_rows()
    summary = bench.summarize_rows(rows)
    assert [s.op for s in summary] == ["dispatch BF16", "  of which notify (BF16)"]
    assert (summary[0].mean_us, summary[0].slowest_us, summary[0].gbps_mean, summary[0].gbps_min) == (
        900.0, 1000.0, 500.0, 500.0)
    assert summary[0].has_bytes and not summary[1].has_bytes
    assert bench.summarize_rows([]) == []


# ---- Host barrier ----


def _barrier_child(barrier, arrived, rank, rounds, failures):
    for k in range(1, rounds + 1):
        arrived[rank] = k
        barrier.wait()
        if min(arrived[:]) < k:  # someone had not arrived at round k yet
            failures.value += 1
        barrier.wait()  # nobody starts round k + 1 before everyone checked round k


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_host_barrier_holds_every_rank():
    ctx = multiprocessing.get_context("fork")
    num_ranks, rounds = 3, 20
    barrier = bench.HostBarrier(ctx, num_ranks, timeout_s=60)
    arrived = ctx.RawArray("q", num_ranks)
    failures = ctx.Value("q", 0)
    procs = [ctx.Process(target=_barrier_child, args=(barrier, arrived, r, rounds, failures))
             for r in range(num_ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * num_ranks
    assert failures.value == 0


def test_host_barrier_times_out():
    ctx = multiprocessing.get_context()
    barrier = bench.HostBarrier(ctx, 2, timeout_s=0.05)
    with pytest.raises(RuntimeError, match="host barrier timed out"):
        barrier.wait()


# ---- Without GPUs ----


@pytest.mark.parametrize("with_cuda, torch_cuda, why", [
    (False, "12.8", "epx was built without CUDA (EPX_WITH_CUDA=OFF)"),
    (True, None, "is a CPU build (no CUDA); install a CUDA build of torch"),
    (True, "12.8", "no CUDA GPU visible"),
])
def test_main_without_gpus_says_why_and_exits_1(with_cuda, torch_cuda, why, monkeypatch, capsys):
    # Nothing measured is not a success: the reason on stderr (stdout empty, with --json too), exit status 1.
    torch = pytest.importorskip("torch")
    import epx

    for name in bench.NVLINK_ENV:
        monkeypatch.setenv(name, "unset-by-test")  # restored after the test
    monkeypatch.setattr(epx, "WITH_CUDA", with_cuda)
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    monkeypatch.setattr(bench, "visible_gpus", lambda: 0)
    for argv in (["--iters", "3"], ["--json"]):
        assert bench.main(argv) == 1
        out, err = capsys.readouterr()
        assert out == ""
        assert err.startswith("python -m epx_tools.bench: ") and err.count("\n") == 1
        assert why in err and "nothing measured" in err and "epx-bench" in err
    assert {name: os.environ[name] for name in bench.NVLINK_ENV} == {
        "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    with pytest.raises(SystemExit) as exit_info:  # a bad flag is still status 2, before anything else
        bench.main(["--tokens", "x"])
    assert exit_info.value.code == 2


def test_main_checks_the_counts_against_the_visible_gpus(monkeypatch, capsys):
    # As epx-bench's run_gpus, once the GPUs are counted: the same rules and messages, exit status 2.
    monkeypatch.setattr(bench, "why_nothing_runs", lambda with_cuda: None)
    monkeypatch.setattr(bench, "visible_gpus", lambda: 2)
    for name in bench.NVLINK_ENV:
        monkeypatch.setenv(name, "unset-by-test")
    assert bench.main(["--ranks", "4"]) == 2
    assert capsys.readouterr().err == ("python -m epx_tools.bench: invalid --ranks = 4: must be <= the number of "
                                       "visible GPUs times --ranks-per-gpu\n")
    assert bench.main(["--ranks-per-node", "3"]) == 2
    assert "invalid --ranks-per-node = 3: must divide the visible GPUs (2): nodes are equal blocks of ranks" in (
        capsys.readouterr().err)
    assert bench.main(["--ll-ranks-per-node", "4"]) == 2
    assert "invalid --ll-ranks-per-node = 4: must divide the visible GPUs (2)" in capsys.readouterr().err


def test_import_needs_no_torch():
    code = "import sys, epx_tools.bench; assert 'torch' not in sys.modules, 'epx_tools.bench imported torch'"
    env = dict(os.environ, EPX_NO_TORCH_PRELOAD="1")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


# ---- Inputs and checks, with torch on the CPU ----


def _options():
    return bench.parse_args(["--tokens", "64", "--hidden", "256", "--topk", "4", "--experts", "16",
                             "--ll-tokens", "16", "--ll-experts", "12"])


def test_inputs_are_seeded_and_in_range():
    torch = pytest.importorskip("torch")
    o = _options()
    x = bench.normal_field(torch, o, 3, 1, "x_bf16", "cpu")
    assert x.dtype == torch.bfloat16 and x.shape == (64, 256)
    assert torch.equal(x.view(torch.int16), bench.normal_field(torch, o, 3, 1, "x_bf16", "cpu").view(torch.int16))
    assert not torch.equal(x, bench.normal_field(torch, o, 3, 2, "x_bf16", "cpu"))  # another rank
    assert not torch.equal(x, bench.normal_field(torch, o, 4, 1, "x_bf16", "cpu"))  # another salt
    magnitude = x.float().abs()
    assert bool((magnitude >= 1 / 128).all()) and bool((magnitude < 2).all())
    assert bool((x.float() < 0).any()) and bool((x.float() > 0).any())
    fp8 = bench.normal_field(torch, o, 3, 1, "x_fp8", "cpu")
    assert fp8.dtype == torch.float8_e4m3fn and not bool(fp8.float().isnan().any())
    scales = bench.normal_field(torch, o, 3, 1, "scales", "cpu")
    assert scales.shape == (64, 2) and bool((scales >= 0.5).all()) and bool((scales < 2).all())
    topk = bench.normal_field(torch, o, 3, 1, "topk", "cpu")
    assert topk.dtype == torch.int64 and topk.shape == (64, 4)
    assert bool((topk >= 0).all()) and bool((topk < 16).all())
    assert all(len(set(row)) == 4 for row in topk.tolist())  # distinct experts per token
    assert len(set(topk.flatten().tolist())) > 8  # random, not a fixed pattern
    ll = [bench.ll_field(torch, o, 1, 0, "ll_x", "cpu", i) for i in range(bench.LL_INPUT_SETS)]
    assert ll[0].shape == (16, 256) and not torch.equal(ll[0], ll[1])
    assert bench.ll_field(torch, o, 1, 0, "ll_topk", "cpu").shape == (16, 4)


def _simulated_dispatch(torch, o, salt, rank, num_ranks, fp8):
    """What a correct dispatch delivers to `rank`: rows by source rank, then source token index."""
    num_local = o.experts // num_ranks
    recv_x, scales, idx, weights, src_idx, per_rank = [], [], [], [], [], []
    for src in range(num_ranks):
        topk = bench.normal_field(torch, o, salt, src, "topk", "cpu")
        tokens = ((topk // num_local) == rank).any(1).nonzero().flatten()
        x = bench.normal_field(torch, o, salt, src, "x_fp8" if fp8 else "x_bf16", "cpu")
        recv_x.append(bench._bits(torch, x).index_select(0, tokens))
        scales.append(bench.normal_field(torch, o, salt, src, "scales", "cpu").index_select(0, tokens))
        routed = topk.index_select(0, tokens)
        here = (routed // num_local) == rank
        idx.append(torch.where(here, routed - rank * num_local, torch.full_like(routed, -1)))
        w = bench.normal_field(torch, o, salt, src, "weights", "cpu").index_select(0, tokens)
        weights.append(torch.where(here, w, torch.zeros_like(w)))
        src_idx.append(tokens.to(torch.int32))
        per_rank.append(tokens.numel())
    x = torch.cat(recv_x).view(torch.float8_e4m3fn if fp8 else torch.bfloat16)
    return x, torch.cat(scales), torch.cat(idx), torch.cat(weights), torch.cat(src_idx), per_rank


@pytest.mark.parametrize("fp8", [False, True])
def test_check_received_accepts_a_correct_dispatch_and_names_a_wrong_row(fp8):
    torch = pytest.importorskip("torch")
    o, num_ranks, rank, salt = _options(), 4, 2, 5
    x, scales, idx, weights, src_idx, per_rank = _simulated_dispatch(torch, o, salt, rank, num_ranks, fp8)
    args = (torch, o, salt, rank, num_ranks, fp8)
    bench.check_received(*args, x, scales if fp8 else None, idx, weights, src_idx, per_rank, "cpu")

    bad = x.clone()
    bench._bits(torch, bad)[per_rank[0] + 1, 7] += 1  # second row from source rank 1
    with pytest.raises(RuntimeError, match=r"source rank 1 .*received row %d .*channel 7" % (per_rank[0] + 1)):
        bench.check_received(*args, bad, scales if fp8 else None, idx, weights, src_idx, per_rank, "cpu")
    with pytest.raises(RuntimeError, match="must|the sum of rows"):
        bench.check_received(*args, x, scales, idx, weights, src_idx, [per_rank[0] + 1] + per_rank[1:], "cpu")
    swapped = src_idx.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    with pytest.raises(RuntimeError, match="ascending order"):
        bench.check_received(*args, x, scales, idx, weights, swapped, per_rank, "cpu")
    bad_weights = weights.clone()
    bad_weights[0, 0] += 1
    with pytest.raises(RuntimeError, match="recv_topk_weights"):
        bench.check_received(*args, x, scales, idx, bad_weights, src_idx, per_rank, "cpu")
    if fp8:
        bad_scales = scales.clone()
        bad_scales[-1, -1] = 3.0
        with pytest.raises(RuntimeError, match="scales"):
            bench.check_received(*args, x, bad_scales, idx, weights, src_idx, per_rank, "cpu")


def test_identity_combine_and_layout_checks():
    torch = pytest.importorskip("torch")
    o, num_ranks, rank, salt = _options(), 4, 1, 7
    mine_x = bench.normal_field(torch, o, salt, rank, "x_bf16", "cpu")
    mine_topk = bench.normal_field(torch, o, salt, rank, "topk", "cpu")
    # Combine as the ranks would: every rank that received token t sends its row back; float sum, one rounding.
    acc = torch.zeros(o.tokens, o.hidden)
    for dest in range(num_ranks):
        x, _, _, _, src_idx, per_rank = _simulated_dispatch(torch, o, salt, dest, num_ranks, False)
        begin = sum(per_rank[:rank])
        rows = x[begin:begin + per_rank[rank]].float()
        acc.index_add_(0, src_idx[begin:begin + per_rank[rank]].long(), rows)
    combined = acc.to(torch.bfloat16)
    bench.check_identity_combine(torch, rank, mine_x, mine_topk, num_ranks, o.experts, combined)
    combined.view(torch.int16)[3, 5] += 1
    with pytest.raises(RuntimeError, match="combined token 3 channel 5"):
        bench.check_identity_combine(torch, rank, mine_x, mine_topk, num_ranks, o.experts, combined)

    in_rank = bench.token_ranks(torch, mine_topk, num_ranks, o.experts)
    per_expert = torch.bincount(mine_topk.flatten(), minlength=o.experts).to(torch.int32)
    bench.check_layout(torch, rank, mine_topk, num_ranks, o.experts, in_rank.sum(0).to(torch.int32), per_expert,
                       in_rank)
    with pytest.raises(RuntimeError, match="num_tokens_per_rank"):
        bench.check_layout(torch, rank, mine_topk, num_ranks, o.experts, in_rank.sum(0) + 1, per_expert, in_rank)


def test_low_latency_checks():
    torch = pytest.importorskip("torch")
    o, num_ranks, rank = _options(), 3, 1
    x = bench.ll_field(torch, o, o.seed, rank, "ll_x", "cpu")
    ids = bench.ll_field(torch, o, o.seed, rank, "ll_topk", "cpu")
    weights = bench.ll_field(torch, o, o.seed, rank, "ll_weights", "cpu")
    acc = torch.zeros(o.ll_tokens, o.hidden)
    for k in range(o.topk):  # the kernel's order: products summed over k, one BF16 rounding
        acc += weights[:, k:k + 1] * x.float()
    combined = acc.to(torch.bfloat16)
    bench.check_ll_round_trip(torch, rank, x, ids, weights, combined)
    combined[2, 9] = combined[2, 9] * 1.1
    with pytest.raises(RuntimeError, match="token 2 channel 9"):
        bench.check_ll_round_trip(torch, rank, x, ids, weights, combined)

    num_local = o.ll_experts // num_ranks
    counts = torch.zeros(num_local, dtype=torch.int32)
    for src in range(num_ranks):
        theirs = bench.ll_field(torch, o, o.seed, src, "ll_topk", "cpu")
        for e in theirs.flatten().tolist():
            if e // num_local == rank:
                counts[e - rank * num_local] += 1
    bench.check_ll_counts(torch, o, rank, num_ranks, counts, "cpu")
    counts[0] += 1
    with pytest.raises(RuntimeError, match="recv_count"):
        bench.check_ll_counts(torch, o, rank, num_ranks, counts, "cpu")
