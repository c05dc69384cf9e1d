"""``python -m epx_tools.bench``: the C++ ``epx-bench`` through the Python layer (epx.Buffer), one process per GPU.

Normal mode (default 4096 tokens/rank, hidden 7168, top-8 of 256 experts, random routing): dispatch BF16 and
FP8 (with float32 scales [T, H/128]), the notify step alone, cached dispatch (``handle=``) and combine BF16
with top-k weights, for each ``--num-sms`` budget; a copy-engine read of the next rank's memory (the link
ceiling); NCCL ``all_to_all_single`` moving the same rows, pre-permuted, with split sizes from the layout.
Low-latency mode (default 128 tokens/rank, 288 experts): dispatch FP8 and BF16, combine BF16 and LogFMT, the
send and receive phases of hook mode, and NCCL moving every (token, expert) selection.

Method (as bench/timing.hpp): every number is checked before it is timed (each received row against the
sender's token, the identity combine against the token times the number of ranks it went to, the low-latency
round trip against sum_k w_k * x); then per run: (normal mode) an L2 flush by writing a 256 MiB tensor, a
stream sync, a host barrier of every rank (shared memory, as the C++ bootstrap's), CUDA events around the
call; ``--warmup`` untimed runs, the median of ``--iters`` timed ones. Low-latency calls rotate over four
input sets.

One difference, on purpose: a Python call spends tens of microseconds on the host before its kernel is
queued, which events around it would count. So each run first queues a GPU spin of ``--launch-ahead-us``
(torch.cuda._sleep), records the start event behind it and lets the host enqueue the call meanwhile: the time
is the GPU's, without the Python overhead and also without the few microseconds of launch latency that the
C++ numbers include. A warning names any op whose enqueueing outlasted the spin. ``--launch-ahead-us 0``
times exactly as the C++ bench does (host time included). A dispatch that is not cached waits on the host for
the counts (as in C++): the host time after that wait is always part of its time.

Bytes: normal = rows received x (2H BF16 | H + 4H/128 FP8), combine as BF16 dispatch;
low latency = valid (token, expert) selections x (H + H/32 + 16 FP8 | 2H BF16 | 1.25H + H/32 LogFMT).
The table (op, SMs, mean us over ranks, slowest us, GB/s mean over ranks, GB/s of the slowest rank) and the
``--json`` lines have epx-bench's format.

    python -m epx_tools.bench                      # every visible GPU, both modes
    python -m epx_tools.bench --mode normal --num-sms 12,24,48 --json
    python -m epx_tools.bench --json-file b.json   # then: python -m epx_tools.bench_plot b.json --out b.svg

Flags: epx-bench's, with its names, defaults, rules and error messages (one command line serves both; a CPU test
compares the two parsers). Those of features only epx-bench has pass its checks and are then refused rather than
ignored: ``--tune``, ``--ranks-per-gpu`` above 1, ``--nvl-chunk`` / ``--nvl-queue`` / ``--rdma-chunk`` /
``--rdma-queue`` other than 0 (this bench times the Buffer's config, Config(num_sms) with its default chunks).
``--launch-ahead-us`` is this bench's own; epx-bench takes only 0, its timing.

Without a GPU it measures nothing, and says so: where epx was built without CUDA, torch is missing or has no
CUDA, or no GPU is visible, it prints why on stderr (nothing on stdout, with ``--json`` too) and exits 1. It has
no CPU stand-in; epx-bench, the C++ bench, runs its CPU reference there instead (and says so).
Exit status: 0 measured and verified; 1 nothing measured, or a rank failed; 2 a bad flag or value.

torch is imported only when the benchmark runs (importing this module needs no torch).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

# Set in os.environ before the ranks are spawned: NVLink multicast (NVLS) stays off on the lent machines.
NVLINK_ENV = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
L2_FLUSH_BYTES = 256 << 20
COPY_ENGINE_BYTES = 32 << 20
LL_INPUT_SETS = 4  # timed low-latency calls rotate through these so no two consecutive calls see the same x
PROG = "python -m epx_tools.bench"
MAX_TOPK = 16  # epx.MAX_TOPK (kMaxTopk); a CPU test checks they agree, so parsing flags needs no binding

# ---- Byte counts (docs/BENCHMARKS.md) ----


def normal_row_bytes(hidden: int, fp8: bool) -> float:
    """Bytes of one received row in normal mode: 2H for BF16, H + 4H/128 (the float32 scales) for FP8 (the
    formula of bench/bench_bytes.hpp, which epx-bench uses too)."""
    from epx._ext import _epx

    return _epx.normal_row_bytes(hidden, fp8)


def normal_bytes(num_recv_rows: int, hidden: int, fp8: bool) -> float:
    """Bytes a rank receives in a normal-mode dispatch (combine counts the BF16 dispatch's bytes)."""
    return num_recv_rows * normal_row_bytes(hidden, fp8)


def network_rows(num_tokens_per_node: Sequence[int], own_node: int) -> float:
    """Normal mode across nodes: rows a rank sends over the network in a dispatch (and receives back in the
    combine): each token once per node other than its own that holds one of its experts, however many ranks of
    that node need it. num_tokens_per_node: get_dispatch_layout's num_tokens_per_rdma_rank (the formula of
    bench/bench_bytes.hpp, internode_network_rows)."""
    return float(sum(count for node, count in enumerate(num_tokens_per_node) if node != own_node))


def ll_selection_bytes(hidden: int, fmt: str) -> float:
    """Bytes of one valid (token, expert) selection in low-latency mode, fmt one of fp8, bf16, logfmt (the
    formula of bench/bench_bytes.hpp, which epx-bench uses too)."""
    from epx._ext import _epx

    return _epx.low_latency_selection_bytes(hidden, fmt)


def ll_bytes(num_selections: int, hidden: int, fmt: str) -> float:
    return num_selections * ll_selection_bytes(hidden, fmt)


def nccl_row_bytes(hidden: int, fp8: bool, low_latency: bool) -> int:
    """Bytes of one row the NCCL baseline moves (integers, as bench/*.cpp size them)."""
    if low_latency:
        return hidden + hidden // 32 + 16 if fp8 else 2 * hidden
    return hidden + 4 * (hidden // 128) if fp8 else 2 * hidden


# ---- Rows and the report (bench/bench_report.cpp) ----


@dataclass
class BenchRow:
    """One measured line on one rank: what ran, with how many SMs (0: not an SM-budgeted kernel), its median
    time and the bytes counted for it."""

    op: str
    num_sms: int
    time_us: float
    bytes: float
    network_bytes: float = 0.0  # across nodes: bytes that cross between nodes (network_rows x row bytes)

    def gbps(self) -> float:
        return self.bytes / (self.time_us * 1e3) if self.time_us > 0 else 0.0

    def network_gbps(self) -> float:
        return self.network_bytes / (self.time_us * 1e3) if self.time_us > 0 else 0.0


@dataclass
class RowSummary:
    """One row averaged over ranks, as the table and the JSON lines report it."""

    op: str
    num_sms: int
    mean_us: float
    slowest_us: float
    gbps_mean: float  # mean over ranks
    gbps_min: float  # the slowest rank's
    net_gbps_mean: float  # across nodes; 0 within a node
    net_gbps_min: float
    has_bytes: bool  # False: a row that breaks another row's time down


def summarize_rows(rank_rows: Sequence[Sequence[BenchRow]]) -> List[RowSummary]:
    """rank_rows[r] are rank r's rows (same ops in the same order on every rank); one summary per row."""
    out = []
    num_ranks = len(rank_rows)
    for i, row in enumerate(rank_rows[0] if rank_rows else []):
        times = [rows[i].time_us for rows in rank_rows]
        rates = [rows[i].gbps() for rows in rank_rows]
        net_rates = [rows[i].network_gbps() for rows in rank_rows]
        out.append(RowSummary(row.op, row.num_sms, sum(times) / num_ranks, max(times), sum(rates) / num_ranks,
                              min(rates), sum(net_rates) / num_ranks, min(net_rates), row.bytes > 0))
    return out


def format_rows(rank_rows: Sequence[Sequence[BenchRow]], as_json: bool, header: str, mode: str) -> List[str]:
    """Lines of epx-bench's report: rank_rows[r] are rank r's rows (same ops in the same order on every rank),
    averaged over ranks into a table under `header`, or one JSON object per op tagged with `mode`. A run across
    nodes (a row with network bytes) adds the network GB/s: two table columns, JSON net_gbps_mean / net_gbps_min."""
    if not rank_rows:
        return []
    num_ranks = len(rank_rows)
    across_nodes = any(row.network_bytes > 0 for rows in rank_rows for row in rows)
    lines = []
    if not as_json:
        lines.append("")
        lines.append(header)
        columns = f"{'op':<34} {'SMs':>5} {'mean us':>12} {'slowest us':>12} {'GB/s (mean)':>12} {'GB/s (min)':>12}"
        lines.append(columns + (f" {'net GB/s':>12} {'net (min)':>12}" if across_nodes else ""))
    for s in summarize_rows(rank_rows):
        if as_json:
            net = f'"net_gbps_mean":{s.net_gbps_mean:.2f},"net_gbps_min":{s.net_gbps_min:.2f},' if across_nodes else ""
            lines.append(
                f'{{"mode":{json.dumps(mode)},"op":{json.dumps(s.op)},"num_sms":{s.num_sms},'
                f'"num_ranks":{num_ranks},"mean_us":{s.mean_us:.2f},"slowest_us":{s.slowest_us:.2f},'
                f'"gbps_mean":{s.gbps_mean:.2f},"gbps_min":{s.gbps_min:.2f},{net}"header":{json.dumps(header)}}}')
        else:
            line = (f"{s.op:<34} {s.num_sms:5d} {s.mean_us:12.1f} {s.slowest_us:12.1f} {s.gbps_mean:12.1f} "
                    f"{s.gbps_min:12.1f}")
            if across_nodes:
                line += f" {s.net_gbps_mean:12.1f} {s.net_gbps_min:12.1f}"
            lines.append(line)
    return lines


def normal_ranks_per_node(o: argparse.Namespace, num_ranks: int) -> int:
    """Normal mode's node size: --ranks-per-node when it splits the ranks into several nodes, else num_ranks."""
    return o.ranks_per_node if 0 < o.ranks_per_node < num_ranks else num_ranks


def count_of(count: int, one: str, many: str) -> str:
    """"1 rank", "2 ranks": count with the noun in the number it takes (bench_options.hpp's count_of)."""
    return f"{count} {one if count == 1 else many}"


def _nodes_note(ranks_per_node: int, num_ranks: int) -> str:
    if ranks_per_node <= 0 or ranks_per_node >= num_ranks:
        return ""
    return f" ({count_of(num_ranks // ranks_per_node, 'node', 'nodes')} of {ranks_per_node}, NVSHMEM between them)"


def normal_header(o: argparse.Namespace, num_ranks: int) -> str:
    """The normal-mode table's header (bench_options.hpp's normal_header, word for word)."""
    ranks_per_node = normal_ranks_per_node(o, num_ranks)
    net = ""
    if ranks_per_node < num_ranks:
        net = "; net GB/s = rows crossing to other nodes, once per node, x row bytes / time"
    return (f"normal mode: {count_of(num_ranks, 'rank', 'ranks')}{_nodes_note(ranks_per_node, num_ranks)}, "
            f"{count_of(o.tokens, 'token/rank', 'tokens/rank')}, hidden {o.hidden}, top-{o.topk} of "
            f"{count_of(o.experts, 'expert', 'experts')} (GB/s = rows received x row bytes / time{net}; verified "
            "before timing)")


def low_latency_header(o: argparse.Namespace, num_ranks: int) -> str:
    """The low-latency table's header, with the low-latency shape (bench_options.hpp's low_latency_header)."""
    return (f"low-latency mode: {count_of(num_ranks, 'rank', 'ranks')}{_nodes_note(o.ll_ranks_per_node, num_ranks)}, "
            f"{count_of(o.ll_tokens, 'token/rank', 'tokens/rank')}, hidden {o.hidden}, top-{o.topk} of "
            f"{count_of(o.ll_experts, 'expert', 'experts')} (GB/s = selections x bytes per selection / time; "
            "verified before timing)")


# ---- Arguments: epx-bench's flags, defaults, rules and messages (bench/epx_bench.cpp, bench_options.hpp) ----
#
# One command line serves both benches. A flag of a feature this bench lacks (--tune, --ranks-per-gpu above 1,
# --nvl-chunk / --nvl-queue / --rdma-chunk / --rdma-queue other than 0) passes epx-bench's checks, then is
# refused here rather than ignored; --launch-ahead-us is this bench's own (epx-bench takes only 0).

MAX_NVL_RANKS = 8  # epx.MAX_NVL_RANKS (kMaxNvlRanks); a CPU test checks they agree

# flag -> (attribute, kind): int, ints (comma-separated), number, text, mode, switch
FLAGS = {
    "--mode": ("mode", "mode"),
    "--ranks": ("ranks", "int"),
    "--tokens": ("tokens", "int"),
    "--hidden": ("hidden", "int"),
    "--topk": ("topk", "int"),
    "--experts": ("experts", "int"),
    "--num-sms": ("num_sms", "ints"),
    "--ranks-per-node": ("ranks_per_node", "int"),
    "--nvl-chunk": ("nvl_chunk", "int"),
    "--nvl-queue": ("nvl_queue", "int"),
    "--staging": ("staging", "switch"),
    "--rdma-chunk": ("rdma_chunk", "int"),
    "--rdma-queue": ("rdma_queue", "int"),
    "--tune": ("tune", "switch"),
    "--ll-tokens": ("ll_tokens", "int"),
    "--ll-experts": ("ll_experts", "int"),
    "--ll-ranks-per-node": ("ll_ranks_per_node", "int"),
    "--ranks-per-gpu": ("ranks_per_gpu", "int"),
    "--warmup": ("warmup", "int"),
    "--iters": ("iters", "int"),
    "--seed": ("seed", "int"),
    "--launch-ahead-us": ("launch_ahead_us", "number"),
    "--json": ("json", "switch"),
    "--json-file": ("json_file", "text"),
}
DEFAULTS = {"mode": "all", "ranks": 0, "tokens": 4096, "hidden": 7168, "topk": 8, "experts": 256, "num_sms": [24],
            "ranks_per_node": 0, "nvl_chunk": 0, "nvl_queue": 0, "staging": False, "rdma_chunk": 0, "rdma_queue": 0,
            "tune": False,
            "ll_tokens": 128, "ll_experts": 288, "ll_ranks_per_node": 0, "ranks_per_gpu": 1, "warmup": 5,
            "iters": 30, "seed": 1, "launch_ahead_us": 200.0, "json": False, "json_file": ""}

HELP = f"""usage: {PROG} [options]   (--flag value or --flag=value)
EPX dispatch/combine through epx.Buffer on every visible GPU (one process per GPU), with NCCL all-to-all moving
the same bytes in the same run. epx-bench's flags, defaults and rules; a flag of a feature only epx-bench has
takes only its default here.
  --mode normal|low-latency|all   what to run (default all)
  --ranks N                       GPUs to use (default: all visible)
  --tokens T --hidden H --topk K --experts E   normal-mode shape (default 4096 7168 8 256)
  --num-sms a,b,c                 SM budgets of the normal kernels (default 24)
  --ranks-per-node N              normal-mode ranks per node: fewer than --ranks makes virtual nodes, so
                                  dispatch/combine take the path across nodes (NVSHMEM between them);
                                  must divide --ranks (default: one node)
  --nvl-chunk N --nvl-queue N     epx-bench's NVLink config; here only 0: the Buffer's config (Config(num_sms)
                                  with its default chunk 6 and queue 256)
  --staging                       normal mode in one node: a combine staging area for every row
                                  (peers' copy engines return the rows; num_nvl_staging_bytes)
  --rdma-chunk N --rdma-queue N   epx-bench's network config; here only 0: Config's defaults, 6 and 256
  --tune                          epx-bench only (its config sweep); refused here
  --ll-tokens T --ll-experts E    low-latency shape (default 128 288; hidden and top-k shared)
  --ll-ranks-per-node N           low-latency ranks per node: fewer than --ranks makes virtual nodes
                                  whose traffic between them goes through NVSHMEM (default: one node)
  --ranks-per-gpu N               only 1 here (NCCL refuses two ranks on one GPU); epx-bench takes more
  --warmup N --iters N            untimed and timed runs per number (default 5 30; median reported)
  --seed N                        seed of the random inputs and routing (default 1)
  --launch-ahead-us US            GPU spin queued before each timed call so Python's host time is not
                                  counted (default 200; 0 times as epx-bench, host time included)
  --json                          JSON lines on stdout instead of tables
  --json-file PATH                also write the JSON lines to PATH
Bytes (docs/BENCHMARKS.md): normal = rows received x (2H BF16 | H + 4H/128 FP8), combine as BF16 dispatch;
low latency = valid (token, expert) selections x (H + H/32 + 16 FP8 | 2H BF16 | 1.25H + H/32 LogFMT).
Exit status: 0 measured and verified; 1 nothing measured (no CUDA build, torch or GPU: said on stderr) or a
rank failed; 2 a bad flag or value.
"""


class FlagError(Exception):
    """A bad command line; the message is epx-bench's for the same mistake."""


def _invalid(flag: str, value: Any, rule: str) -> FlagError:
    return FlagError(f"invalid {flag} = {value}: {rule}")


_INT = re.compile(r"\s*[+-]?[0-9]+", re.ASCII)
_NUMBER = re.compile(r"\s*[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?", re.ASCII)


def parse_int(flag: str, text: str) -> int:
    """An int flag value as epx-bench's parse_int (std::stoi, the whole text, within int32)."""
    value = int(text) if _INT.fullmatch(text) else None
    if value is None or not -(1 << 31) <= value < (1 << 31):
        raise _invalid(flag, text, "must be an integer")
    return value


def parse_number(flag: str, text: str) -> float:
    value = float(text) if _NUMBER.fullmatch(text) else math.nan
    if not math.isfinite(value):
        raise _invalid(flag, text, "must be a number")
    return value


def parse_list(flag: str, text: str) -> List[int]:
    """A comma-separated int list as epx-bench's parse_list (std::getline: a trailing comma adds nothing)."""
    items = text.split(",")
    if items[-1] == "":
        items.pop()
    values = [parse_int(flag, item) for item in items]
    if not values:
        raise _invalid(flag, text, "must list at least one value")
    return values


def _number_text(value: float) -> str:
    return f"{value:g}"  # as a C++ stream writes a double


def _check_ranks_per_node(flag: str, value: int, num_ranks: int, ranks_from: str) -> None:
    if value > 0 and num_ranks > 0 and num_ranks % value != 0:
        raise _invalid(flag, value, f"must divide {ranks_from} ({num_ranks}): nodes are equal blocks of ranks")


def _require(holds: bool, flag: str, value: Any, rule: str) -> None:
    if not holds:
        raise _invalid(flag, value, rule)


def validate_options(o: argparse.Namespace) -> None:
    """bench_options.hpp's validate_options: the same rules in the same order, with the same messages."""
    _require(o.ranks >= 0, "--ranks", o.ranks, "must be >= 1")
    _require(o.ranks <= MAX_NVL_RANKS, "--ranks", o.ranks, f"must be <= {MAX_NVL_RANKS} (one NVLink domain)")
    _require(o.tokens >= 0, "--tokens", o.tokens, "must be >= 0")
    _require(o.hidden > 0, "--hidden", o.hidden, "must be > 0")
    _require(o.hidden % 128 == 0, "--hidden", o.hidden, "must be a multiple of 128 (FP8 is benchmarked)")
    _require(o.topk >= 1, "--topk", o.topk, "must be >= 1")
    _require(o.topk <= MAX_TOPK, "--topk", o.topk, f"must be <= {MAX_TOPK}")
    _require(o.experts >= o.topk, "--experts", o.experts, "must be >= --topk")
    for sms in o.num_sms:
        _require(sms >= 1, "--num-sms", sms, "must be >= 1")
    _require(o.ranks_per_node >= 0, "--ranks-per-node", o.ranks_per_node, "must be >= 0 (0: one node)")
    _check_ranks_per_node("--ranks-per-node", o.ranks_per_node, o.ranks, "--ranks")
    _require(o.nvl_chunk >= 0, "--nvl-chunk", o.nvl_chunk, "must be >= 0 (0: recommended)")
    _require(o.nvl_queue >= 0, "--nvl-queue", o.nvl_queue, "must be >= 0 (0: recommended)")
    _require(o.rdma_chunk >= 0, "--rdma-chunk", o.rdma_chunk, "must be >= 0 (0: the default)")
    _require(o.rdma_queue >= 0, "--rdma-queue", o.rdma_queue, "must be >= 0 (0: the default)")
    _require(o.ll_tokens >= 1, "--ll-tokens", o.ll_tokens, "must be >= 1")
    _require(o.ll_experts >= o.topk, "--ll-experts", o.ll_experts, "must be >= --topk")
    _require(o.ll_ranks_per_node >= 0, "--ll-ranks-per-node", o.ll_ranks_per_node, "must be >= 0 (0: one node)")
    _check_ranks_per_node("--ll-ranks-per-node", o.ll_ranks_per_node, o.ranks, "--ranks")
    _require(o.ranks_per_gpu >= 1, "--ranks-per-gpu", o.ranks_per_gpu, "must be >= 1")
    _require(o.warmup >= 0, "--warmup", o.warmup, "must be >= 0")
    _require(o.iters >= 1, "--iters", o.iters, "must be >= 1")


def check_supported(o: argparse.Namespace) -> None:
    """Flags epx-bench honours and this bench cannot: refused (a value it would ignore would mislabel the run)."""
    if o.tune:
        raise FlagError("--tune is epx-bench's (a sweep of NVLink configs through the C++ API): run epx-bench --tune")
    if o.ranks_per_gpu != 1:
        raise _invalid("--ranks-per-gpu", o.ranks_per_gpu,
                       f"must be 1 in {PROG} (its NCCL group refuses two ranks on one GPU; epx-bench runs them)")
    for flag, value in (("--nvl-chunk", o.nvl_chunk), ("--nvl-queue", o.nvl_queue), ("--rdma-chunk", o.rdma_chunk),
                        ("--rdma-queue", o.rdma_queue)):
        if value != 0:
            raise _invalid(flag, value, f"must be 0 in {PROG} (it times the Buffer's config: Config(num_sms) with "
                                        "its default chunks; epx-bench times others)")


def parse_options(argv: Sequence[str]) -> Optional[argparse.Namespace]:
    """The options, checked as epx-bench checks them; None for --help. Raises FlagError."""
    o = argparse.Namespace(**{name: list(v) if isinstance(v, list) else v for name, v in DEFAULTS.items()})
    i = 0
    while i < len(argv):
        flag, inline_value = argv[i], None  # --flag value, or --flag=value
        i += 1
        if flag.startswith("--") and "=" in flag:
            flag, inline_value = flag.split("=", 1)
        if flag in ("--help", "-h"):
            return None
        if flag not in FLAGS:
            raise FlagError(f"unknown flag {flag} (see --help)")
        name, kind = FLAGS[flag]
        if kind == "switch":
            if inline_value is not None:
                raise FlagError(f"{flag} takes no value (see --help)")
            setattr(o, name, True)
            if flag == "--tune":
                o.mode = "normal"  # as epx-bench: the sweep is normal mode's
            continue
        if inline_value is not None:
            text = inline_value
        elif i < len(argv):
            text = argv[i]
            i += 1
        else:
            raise FlagError(f"{flag} needs a value (see --help)")
        if kind == "mode":
            if text not in ("normal", "low-latency", "all"):
                raise _invalid(flag, text, "must be normal, low-latency or all")
            o.mode = text
        elif kind == "int":
            setattr(o, name, parse_int(flag, text))
        elif kind == "ints":
            o.num_sms = parse_list(flag, text)
        elif kind == "number":
            o.launch_ahead_us = parse_number(flag, text)
        else:
            setattr(o, name, text)
        # Checked as soon as read, as epx-bench does.
        if flag == "--ranks" and o.ranks < 1:
            raise _invalid(flag, o.ranks, "must be >= 1")
        if flag == "--seed" and o.seed < 0:
            raise _invalid(flag, o.seed, "must be >= 0")
        if flag == "--launch-ahead-us" and o.launch_ahead_us < 0:
            raise _invalid(flag, _number_text(o.launch_ahead_us), "must be >= 0")
    validate_options(o)
    check_supported(o)
    return o


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The options, checked; --help prints the flags and exits 0, a bad flag or value prints epx-bench's message
    for it ("python -m epx_tools.bench: invalid --tokens = x: must be an integer") and exits 2."""
    try:
        o = parse_options(sys.argv[1:] if argv is None else list(argv))
    except FlagError as error:
        print(f"{PROG}: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    if o is None:
        print(HELP, end="", flush=True)
        raise SystemExit(0)
    return o


# ---- Host barrier of the ranks: shared memory, like the C++ bootstrap's (a few microseconds of skew) ----


class HostBarrier:
    """Sense-counting barrier of num_ranks processes over a shared array; made before spawning, passed to each
    process as an argument. Spins (each rank has a core), with a timeout so a dead peer cannot hang a rank."""

    def __init__(self, context: Any, num_ranks: int, timeout_s: float = 600.0) -> None:
        self.state = context.RawArray("q", 2)  # [arrived, generation]
        self.lock = context.Lock()
        self.num_ranks = num_ranks
        self.timeout_s = timeout_s

    def wait(self) -> None:
        state = self.state
        with self.lock:
            generation = state[1]
            state[0] += 1
            if state[0] == self.num_ranks:
                state[0] = 0
                state[1] = generation + 1
                return
        deadline = time.monotonic() + self.timeout_s
        spins = 0
        while state[1] == generation:
            spins += 1
            if spins & 0xFFFF == 0 and time.monotonic() > deadline:
                raise RuntimeError(f"epx_tools.bench: host barrier timed out after {self.timeout_s:.0f} s "
                                   "(a rank died?)")


# ---- Inputs any rank can recompute for any rank (so every rank checks every row it received) ----

_FIELDS = {"x_bf16": 1, "x_fp8": 2, "scales": 3, "topk": 4, "weights": 5, "ll_topk": 6, "ll_weights": 7, "ll_x": 8}


def _generator(torch: Any, device: Any, salt: int, rank: int, field: str, index: int = 0) -> Any:
    seed = 0
    for part in (salt, rank, _FIELDS[field], index):
        seed = (seed * 1_000_003 + int(part) + 1) % (1 << 62)
    return torch.Generator(device=device).manual_seed(seed)


def random_bf16(torch: Any, gen: Any, shape: Sequence[int], device: Any) -> Any:
    """BF16 of magnitude in [1/128, 2) with 7 random mantissa bits and a random sign: normal numbers whose sum
    of up to 8 copies is exact in float (bench/normal_bench.cpp's values)."""
    bits = torch.randint(0, 1 << 11, tuple(shape), generator=gen, device=device, dtype=torch.int32)
    value = ((bits & 1) << 15) | ((120 + ((bits >> 1) & 7)) << 7) | ((bits >> 4) & 0x7F)
    value = torch.where(value >= 1 << 15, value - (1 << 16), value).to(torch.int16)
    return value.view(torch.bfloat16)


def random_fp8(torch: Any, gen: Any, shape: Sequence[int], device: Any) -> Any:
    """Random float8_e4m3fn bytes, never NaN (0x7F / 0xFF)."""
    byte = torch.randint(0, 256, tuple(shape), generator=gen, device=device, dtype=torch.int32)
    byte = torch.where((byte & 0x7F) == 0x7F, byte - 1, byte).to(torch.uint8)
    return byte.view(torch.float8_e4m3fn)


def random_topk(torch: Any, gen: Any, num_tokens: int, num_topk: int, num_experts: int, device: Any) -> Any:
    """int64 [T, K]: each token picks num_topk distinct experts uniformly."""
    keys = torch.rand(num_tokens, num_experts, generator=gen, device=device)
    return keys.topk(num_topk, dim=1).indices.to(torch.int64).contiguous()


def normal_field(torch: Any, o: argparse.Namespace, salt: int, rank: int, field: str, device: Any) -> Any:
    """One input of `rank` in normal mode: x_bf16, x_fp8, scales ([T, H/128] in [0.5, 2)), topk, weights."""
    gen = _generator(torch, device, salt, rank, field)
    t, h = o.tokens, o.hidden
    if field == "x_bf16":
        return random_bf16(torch, gen, (t, h), device)
    if field == "x_fp8":
        return random_fp8(torch, gen, (t, h), device)
    if field == "scales":
        return torch.rand(t, h // 128, generator=gen, device=device) * 1.5 + 0.5
    if field == "topk":
        return random_topk(torch, gen, t, o.topk, o.experts, device)
    if field == "weights":
        return torch.rand(t, o.topk, generator=gen, device=device) * 1.5 + 0.5
    raise ValueError(field)


def ll_field(torch: Any, o: argparse.Namespace, seed: int, rank: int, field: str, device: Any, index: int = 0):
    """One input of `rank` in low-latency mode: ll_x (input set `index`), ll_topk, ll_weights ([0, 1))."""
    gen = _generator(torch, device, seed, rank, field, index)
    if field == "ll_x":
        return random_bf16(torch, gen, (o.ll_tokens, o.hidden), device)
    if field == "ll_topk":
        return random_topk(torch, gen, o.ll_tokens, o.topk, o.ll_experts, device)
    if field == "ll_weights":
        return torch.rand(o.ll_tokens, o.topk, generator=gen, device=device)
    raise ValueError(field)


# ---- Checks (raise RuntimeError naming the rank and what differs) ----


def _bits(torch: Any, tensor: Any) -> Any:
    return tensor.view(torch.int16) if tensor.element_size() == 2 else tensor.view(torch.uint8)


def token_ranks(torch: Any, topk_idx: Any, num_ranks: int, num_experts: int) -> Any:
    """bool [T, R]: whether each token has an expert on each rank (experts split evenly over ranks)."""
    num_local = num_experts // num_ranks
    in_rank = torch.zeros(topk_idx.size(0), num_ranks, dtype=torch.bool, device=topk_idx.device)
    valid = topk_idx >= 0
    dest = torch.where(valid, topk_idx // num_local, torch.zeros_like(topk_idx))
    in_rank.scatter_(1, dest, valid)
    return in_rank


def check_layout(torch: Any, rank: int, topk_idx: Any, num_ranks: int, num_experts: int, per_rank: Any,
                 per_expert: Any, in_rank: Any) -> None:
    want_in_rank = token_ranks(torch, topk_idx, num_ranks, num_experts)
    if not torch.equal(in_rank.cpu(), want_in_rank.cpu()):
        raise RuntimeError(f"rank {rank}: get_dispatch_layout's is_token_in_rank differs from the routing")
    if per_rank.cpu().tolist() != want_in_rank.sum(0).cpu().tolist():
        raise RuntimeError(f"rank {rank}: num_tokens_per_rank {per_rank.cpu().tolist()} != "
                           f"{want_in_rank.sum(0).cpu().tolist()}")
    want_per_expert = torch.bincount(topk_idx[topk_idx >= 0].flatten(), minlength=num_experts)
    if per_expert.cpu().tolist() != want_per_expert.cpu().tolist():
        raise RuntimeError(f"rank {rank}: num_tokens_per_expert differs from the routing")


def check_received(torch: Any, o: argparse.Namespace, salt: int, rank: int, num_ranks: int, fp8: bool,
                   recv_x: Any, recv_scales: Any, recv_topk_idx: Any, recv_topk_weights: Any, src_idx: Any,
                   num_recv_per_rank: Sequence[int], device: Any) -> None:
    """Every received row holds its source's token: rows arrive by source rank, then source token index (the
    tokens of that source routed here), with the FP8 scales, local top-k ids (-1 elsewhere) and weights (0
    elsewhere). The sources' inputs are recomputed from their seeds."""
    num_local = o.experts // num_ranks
    rows = recv_x.size(0)
    if sum(num_recv_per_rank) != rows:
        raise RuntimeError(f"rank {rank}: num_recv_rows {rows} != the sum of rows received per source rank "
                           f"{list(num_recv_per_rank)}")
    begin = 0
    for src in range(num_ranks):
        count = num_recv_per_rank[src]
        topk = normal_field(torch, o, salt, src, "topk", device)
        tokens = ((topk // num_local) == rank).any(dim=1).nonzero().flatten()
        where = f"rank {rank}: rows from source rank {src} ({'FP8' if fp8 else 'BF16'}, salt {salt})"
        if count != tokens.numel():
            raise RuntimeError(f"{where}: {count} received, the routing sends {tokens.numel()}")
        got_idx = src_idx[begin:begin + count].to(torch.int64)
        if not torch.equal(got_idx, tokens):
            raise RuntimeError(f"{where}: recv_src_idx is not the routed tokens in ascending order")
        x = normal_field(torch, o, salt, src, "x_fp8" if fp8 else "x_bf16", device)
        got, want = _bits(torch, recv_x[begin:begin + count]), _bits(torch, x).index_select(0, tokens)
        if not torch.equal(got, want):
            bad = (got != want).nonzero()[0].tolist()
            raise RuntimeError(f"{where}: received row {begin + bad[0]} (token {tokens[bad[0]].item()}) differs "
                               f"at channel {bad[1]}")
        if fp8 and not torch.equal(recv_scales[begin:begin + count],
                                   normal_field(torch, o, salt, src, "scales", device).index_select(0, tokens)):
            raise RuntimeError(f"{where}: recv_x_scales differ from the sender's scales")
        if recv_topk_idx is not None:
            routed = topk.index_select(0, tokens)
            here = (routed // num_local) == rank
            want_idx = torch.where(here, routed - rank * num_local, torch.full_like(routed, -1))
            weights = normal_field(torch, o, salt, src, "weights", device).index_select(0, tokens)
            want_w = torch.where(here, weights, torch.zeros_like(weights))
            if not torch.equal(recv_topk_idx[begin:begin + count], want_idx):
                raise RuntimeError(f"{where}: recv_topk_idx differs (local expert ids, -1 elsewhere)")
            if not torch.equal(recv_topk_weights[begin:begin + count], want_w):
                raise RuntimeError(f"{where}: recv_topk_weights differ (the weights, 0 elsewhere)")
        begin += count


def check_identity_combine(torch: Any, rank: int, x: Any, topk_idx: Any, num_ranks: int, num_experts: int,
                           combined: Any, ranks_per_node: int = 0) -> None:
    """The combine of the rows as received returns each token times the number of ranks it went to; across
    nodes (ranks_per_node < num_ranks) the sum over its nodes of each node's copies rounded to BF16, in node
    order (reference::internode_combine's order)."""
    in_rank = token_ranks(torch, topk_idx, num_ranks, num_experts)
    copies = in_rank.sum(1, dtype=torch.float32)
    ranks_per_node = ranks_per_node if 0 < ranks_per_node < num_ranks else num_ranks
    node_copies = in_rank.view(in_rank.size(0), num_ranks // ranks_per_node, ranks_per_node).sum(2, dtype=torch.float32)
    want = torch.zeros_like(x, dtype=torch.float32)
    for node in range(node_copies.size(1)):
        want += (x.float() * node_copies[:, node:node + 1]).to(torch.bfloat16).float()
    want = want.to(torch.bfloat16)
    got_bits, want_bits = combined.view(torch.int16), want.view(torch.int16)
    if not torch.equal(got_bits, want_bits):
        t, c = (got_bits != want_bits).nonzero()[0].tolist()
        raise RuntimeError(f"rank {rank}: combined token {t} channel {c} is {combined[t, c].item()}, expected "
                           f"{want[t, c].item()} ({int(copies[t].item())} copies)")


def check_ll_round_trip(torch: Any, rank: int, x: Any, topk_idx: Any, weights: Any, combined: Any) -> None:
    """BF16 dispatch, identity experts, weighted combine: each token comes back as sum_k w_k * x (1% bound)."""
    w = torch.where(topk_idx >= 0, weights, torch.zeros_like(weights)).sum(1, keepdim=True)
    want = x.float() * w
    have = combined.float()
    bad = (have - want).abs() > 1e-2 * want.abs() + 1e-6
    if bool(bad.any()):
        t, c = bad.nonzero()[0].tolist()
        raise RuntimeError(f"rank {rank}: low-latency round trip of token {t} channel {c} gave {have[t, c].item()}, "
                           f"expected {want[t, c].item()}")


def check_ll_counts(torch: Any, o: argparse.Namespace, rank: int, num_ranks: int, recv_count: Any,
                    device: Any) -> None:
    """recv_count[e] of each local expert = the selections of it over every rank's routing."""
    num_local = o.ll_experts // num_ranks
    want = torch.zeros(o.ll_experts, dtype=torch.int64, device=device)
    for src in range(num_ranks):
        ids = ll_field(torch, o, o.seed, src, "ll_topk", device)
        want += torch.bincount(ids[ids >= 0].flatten(), minlength=o.ll_experts)
    want = want[rank * num_local:(rank + 1) * num_local]
    if recv_count.to(torch.int64).cpu().tolist() != want.cpu().tolist():
        raise RuntimeError(f"rank {rank}: low-latency recv_count {recv_count.cpu().tolist()} != "
                           f"{want.cpu().tolist()}")


# ---- One rank ----


class _Rank:
    """Per-process state: the process groups, the stream every call runs on, the timing helpers."""

    def __init__(self, rank: int, num_ranks: int, o: argparse.Namespace, barrier: HostBarrier) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.rank, self.num_ranks, self.o, self.host_barrier = rank, num_ranks, o, barrier
        self.device = torch.device("cuda", rank)
        self.world = dist.group.WORLD  # NCCL: the Buffer's bootstrap and the all-to-all baseline
        self.gloo = dist.new_group(backend="gloo")  # host-side gathers
        self.stream = torch.cuda.Stream(device=self.device)
        self.spin_cycles = 0
        self.warnings: List[str] = []
        self.leaks: dict = {}  # op -> (timed runs whose host enqueueing outlasted the launch-ahead, timed runs)

    def calibrate_launch_ahead(self) -> None:
        """Cycles of torch.cuda._sleep that last --launch-ahead-us on this GPU."""
        torch = self.torch
        if self.o.launch_ahead_us <= 0:
            return
        if not hasattr(torch.cuda, "_sleep"):
            self.warnings.append("torch.cuda._sleep is missing: timing with host time included")
            return
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 1_000_000
        for _ in range(3):
            start.record(self.stream)
            torch.cuda._sleep(cycles)
            stop.record(self.stream)
            stop.synchronize()
        us = start.elapsed_time(stop) * 1000.0
        self.spin_cycles = max(1, int(cycles * self.o.launch_ahead_us / max(us, 1e-3)))

    def launch_ahead(self) -> None:
        if self.spin_cycles:
            self.torch.cuda._sleep(self.spin_cycles)

    def gather(self, value: Any) -> List[Any]:
        out: List[Any] = [None] * self.num_ranks
        self.dist.all_gather_object(out, value, group=self.gloo)
        return out

    def _note_leaks(self, op: str, leaks: int, iters: int) -> None:
        if leaks:
            self.leaks[op] = (leaks, iters)

    def report_warnings(self) -> None:
        """Rank 0 prints every rank's warnings to stderr, each once (collective)."""
        gathered = self.gather((self.warnings, self.leaks))
        if self.rank != 0:
            return
        lines: List[str] = []
        for warnings, _ in gathered:
            lines += [w for w in warnings if w not in lines]
        ops: List[str] = []
        for _, leaks in gathered:
            ops += [op for op in leaks if op not in ops]
        for op in ops:
            ranks = [r for r, (_, leaks) in enumerate(gathered) if op in leaks]
            worst = max(gathered[r][1][op] for r in ranks)
            lines.append(f"{op}: the host was still enqueueing after the {self.o.launch_ahead_us:g} us launch-ahead "
                         f"in up to {worst[0]}/{worst[1]} timed runs (ranks {', '.join(map(str, ranks))}): host time "
                         "is counted there; raise --launch-ahead-us")
        for line in lines:
            print(f"{PROG}: warning: {line}", file=sys.stderr, flush=True)

    def median_us(self, op: str, prepare: Optional[Callable[[], None]], body: Callable[[], Any],
                  host_waits: bool = False) -> float:
        """bench/timing.hpp's median_us: per run prepare, stream sync, host barrier, events around body."""
        torch, o, stream = self.torch, self.o, self.stream
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times, leaks = [], 0
        for i in range(o.warmup + o.iters):
            if prepare is not None:
                prepare()
            stream.synchronize()
            self.host_barrier.wait()
            self.launch_ahead()
            start.record(stream)
            body()
            if self.spin_cycles and not host_waits and i >= o.warmup and start.query():
                leaks += 1
            stop.record(stream)
            stop.synchronize()
            if i >= o.warmup:
                times.append(start.elapsed_time(stop) * 1000.0)
        self._note_leaks(op, leaks, o.iters)
        times.sort()
        return times[len(times) // 2]

    def hook_phases_us(self, op: str, send: Callable[[int], Callable[[], None]]):
        """Events around a send-only call and, after every rank sent, around its hook: both phases' medians."""
        torch, o, stream = self.torch, self.o, self.stream
        e = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        send_us, recv_us, leaks = [], [], 0
        for i in range(o.warmup + o.iters):
            stream.synchronize()
            self.host_barrier.wait()
            self.launch_ahead()
            e[0].record(stream)
            hook = send(i)
            leaks += int(bool(self.spin_cycles) and i >= o.warmup and e[0].query())
            e[1].record(stream)
            e[1].synchronize()
            self.host_barrier.wait()  # every rank's data is in flight or landed: the receive only waits on it
            self.launch_ahead()
            e[2].record(stream)
            hook()
            leaks += int(bool(self.spin_cycles) and i >= o.warmup and e[2].query())
            e[3].record(stream)
            e[3].synchronize()
            if i >= o.warmup:
                send_us.append(e[0].elapsed_time(e[1]) * 1000.0)
                recv_us.append(e[2].elapsed_time(e[3]) * 1000.0)
        self._note_leaks(op, leaks, 2 * o.iters)
        send_us.sort()
        recv_us.sort()
        return send_us[len(send_us) // 2], recv_us[len(recv_us) // 2]

    # ---- Normal mode (bench/normal_bench.cpp) ----

    def run_normal(self) -> List[BenchRow]:
        import epx
        from epx._ext import _epx

        torch, o, rank, num_ranks, dev = self.torch, self.o, self.rank, self.num_ranks, self.device
        # Sized for the largest config used: the checks run with the default one (20 SMs), the timed runs with
        # each --num-sms budget (the hint grows with the SMs, never with the tokens).
        configs = [epx.Config()] + [epx.Config(num_sms=sms) for sms in o.num_sms]
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(o.hidden * 2, num_ranks) for config in configs)
        # Across nodes (--ranks-per-node): the network queues live in the symmetric buffer.
        ranks_per_node = normal_ranks_per_node(o, num_ranks)
        num_rdma_bytes = 0
        if ranks_per_node < num_ranks:
            num_rdma_bytes = max(config.get_rdma_buffer_size_hint(o.hidden * 2, num_ranks, ranks_per_node)
                                 for config in configs)
        # --staging within one node: a combine staging area with room for every row from each peer.
        staging = epx.normal_nvl_staging_bytes_hint(o.tokens, o.hidden, num_ranks, o.topk) \
            if o.staging and ranks_per_node == num_ranks else 0
        buffer = epx.Buffer(self.world, num_nvl_bytes=num_nvl_bytes + staging, num_rdma_bytes=num_rdma_bytes,
                            ranks_per_node=ranks_per_node if ranks_per_node < num_ranks else 0,
                            num_nvl_staging_bytes=staging)

        def make(salt: int) -> dict:
            return {f: normal_field(torch, o, salt, rank, f, dev) for f in ("x_bf16", "x_fp8", "scales", "topk",
                                                                             "weights")}

        def dispatch(data: dict, layout: Any, fp8: bool) -> Any:
            x = (data["x_fp8"], data["scales"]) if fp8 else data["x_bf16"]
            return buffer.dispatch(x, topk_idx=data["topk"], topk_weights=data["weights"], num_experts=o.experts,
                                   is_token_in_rank=layout.is_token_in_rank,
                                   num_tokens_per_expert=layout.num_tokens_per_expert,
                                   num_tokens_per_rank=layout.num_tokens_per_rank)

        # Correctness first, on two fresh input sets; the last one is kept for timing.
        for salt in (o.seed * 2 + 1, o.seed * 2 + 2):
            mine = make(salt)
            layout = buffer.get_dispatch_layout(mine["topk"], o.experts)
            self.stream.synchronize()
            check_layout(torch, rank, mine["topk"], num_ranks, o.experts, layout.num_tokens_per_rank,
                         layout.num_tokens_per_expert, layout.is_token_in_rank)
            for fp8 in (False, True):
                result = dispatch(mine, layout, fp8)
                self.stream.synchronize()
                handle = result.handle
                check_received(torch, o, salt, rank, num_ranks, fp8, result.recv_x, result.recv_x_scales,
                               result.recv_topk_idx, result.recv_topk_weights, handle.recv_src_idx,
                               handle.num_recv_per_rank, dev)
                if not fp8:
                    combined = buffer.combine(result.recv_x, handle).combined_x
                    self.stream.synchronize()
                    check_identity_combine(torch, rank, mine["x_bf16"], mine["topk"], num_ranks, o.experts,
                                           combined, ranks_per_node)
                del result, handle
            self.host_barrier.wait()

        plan = dispatch(mine, layout, False)
        self.stream.synchronize()
        rows = plan.handle.num_recv_rows
        bf16_bytes, fp8_bytes = normal_bytes(rows, o.hidden, False), normal_bytes(rows, o.hidden, True)
        net_rows = 0.0
        if layout.num_tokens_per_rdma_rank is not None:
            net_rows = network_rows(layout.num_tokens_per_rdma_rank.cpu().tolist(), rank // ranks_per_node)
        bf16_net, fp8_net = normal_bytes(net_rows, o.hidden, False), normal_bytes(net_rows, o.hidden, True)

        scratch = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=dev)

        def flush() -> None:
            scratch.fill_(0x5A)

        out: List[BenchRow] = []
        for sms in o.num_sms:
            buffer.num_sms = sms
            for fp8 in (False, True):
                x = (mine["x_fp8"], mine["scales"]) if fp8 else mine["x_bf16"]
                name, nbytes, net = ("FP8", fp8_bytes, fp8_net) if fp8 else ("BF16", bf16_bytes, bf16_net)
                us = self.median_us(f"dispatch {name}", flush, lambda: dispatch(mine, layout, fp8), host_waits=True)
                out.append(BenchRow(f"dispatch {name}", sms, us, nbytes, net))
                # The first step alone (count exchange, host sync): the rest of the time is the transfer.
                native_in = _native_dispatch_input(_epx, torch, x, mine["topk"], mine["weights"], o.experts,
                                                   layout.is_token_in_rank, layout.num_tokens_per_expert,
                                                   layout.num_tokens_per_rank)

                def notify() -> None:
                    order = _epx.StreamOrder(compute_stream=torch.cuda.current_stream().cuda_stream,
                                             previous_event=0, async_finish=False)
                    _epx.dispatch_notify(buffer.runtime, native_in, order, None)

                us = self.median_us(f"notify {name}", flush, notify, host_waits=True)
                out.append(BenchRow(f"  of which notify ({name})", sms, us, 0.0))
                # Cached: the layout of a previous call, no count exchange and no host sync.
                us = self.median_us(f"dispatch {name} cached", flush, lambda: buffer.dispatch(x, handle=plan.handle))
                out.append(BenchRow(f"dispatch {name} cached", sms, us, nbytes, net))
            us = self.median_us("combine BF16", flush, lambda: buffer.combine(
                plan.recv_x, plan.handle, topk_weights=plan.recv_topk_weights))
            out.append(BenchRow("combine BF16", sms, us, bf16_bytes, bf16_net))

        # The link ceiling: a copy-engine copy of the next rank's memory (no SMs), 32 MiB or the buffer size.
        if num_ranks > 1:
            row = self.copy_engine_row(min(COPY_ENGINE_BYTES, buffer.num_nvl_bytes), flush)
            if row is not None:
                out.append(row)

        # NCCL moving the same rows, already permuted per destination (split sizes from the layout). Across nodes
        # it sends a row once per destination rank; its net GB/s counts EPX's network bytes over its time.
        send_rows = [int(v) for v in layout.num_tokens_per_rank.cpu().tolist()]
        recv_rows = list(plan.handle.num_recv_per_rank)
        for fp8 in (False, True):
            row_bytes = nccl_row_bytes(o.hidden, fp8, low_latency=False)
            send = torch.full((sum(send_rows), row_bytes), 0x3C, dtype=torch.uint8, device=dev)
            recv = torch.empty((sum(recv_rows), row_bytes), dtype=torch.uint8, device=dev)
            name = "FP8" if fp8 else "BF16"
            us = self.median_us(f"NCCL {name}", flush, lambda: self.dist.all_to_all_single(
                recv, send, recv_rows, send_rows, group=self.world))
            out.append(BenchRow(f"NCCL all-to-all {name} rows", 0, us, fp8_bytes if fp8 else bf16_bytes,
                                fp8_net if fp8 else bf16_net))
        self.stream.synchronize()
        buffer.destroy()
        plan = None  # its outputs go before the window's Buffer comes
        if num_ranks > 1 and ranks_per_node == num_ranks:
            out += self.run_normal_window(num_nvl_bytes, mine, layout, flush)
        return out

    def run_normal_window(self, num_nvl_bytes: int, mine: dict, layout: Any,
                          flush: Callable[[], None]) -> List[BenchRow]:
        """The dispatch rows with the outputs in an output window (epx.Buffer(num_nvl_output_bytes=...), within
        one node, with the torch extension): the sources store rows straight into them. Verified first; no rows
        where the outputs did not land in the window (said once)."""
        import epx
        from epx._ext import torch_calls

        torch, o, rank, num_ranks = self.torch, self.o, self.rank, self.num_ranks
        if torch_calls is None:
            return []
        # A timed call's outputs beside the two plans' (BF16 with top-k: the largest).
        window = epx.normal_nvl_output_bytes_hint(o.tokens, o.hidden, num_ranks, o.topk, num_live=3)
        buffer = epx.Buffer(self.world, num_nvl_bytes=num_nvl_bytes + window, num_nvl_output_bytes=window)
        base, size = buffer.runtime.nvl_output_window, buffer.runtime.num_nvl_output_bytes

        def tokens(fp8: bool) -> Any:
            return (mine["x_fp8"], mine["scales"]) if fp8 else mine["x_bf16"]

        def dispatch(fp8: bool) -> Any:
            return buffer.dispatch(tokens(fp8), topk_idx=mine["topk"], topk_weights=mine["weights"],
                                   num_experts=o.experts, is_token_in_rank=layout.is_token_in_rank,
                                   num_tokens_per_expert=layout.num_tokens_per_expert,
                                   num_tokens_per_rank=layout.num_tokens_per_rank)

        salt = o.seed * 2 + 2  # `mine`'s
        plans = {}
        for fp8 in (False, True):
            plans[fp8] = dispatch(fp8)
            self.stream.synchronize()
            result = plans[fp8]
            check_received(torch, o, salt, rank, num_ranks, fp8, result.recv_x, result.recv_x_scales,
                           result.recv_topk_idx, result.recv_topk_weights, result.handle.recv_src_idx,
                           result.handle.num_recv_per_rank, self.device)
        probe = dispatch(False)  # a timed call's outputs, beside the plans'
        self.stream.synchronize()
        recv_x = plans[True].recv_x[0] if isinstance(plans[True].recv_x, tuple) else plans[True].recv_x
        in_window = all(base <= p.data_ptr() < base + size for p in (plans[False].recv_x, recv_x, probe.recv_x))
        del probe
        out: List[BenchRow] = []
        if not all(self.gather(in_window)):
            self.warnings.append("the output window's rows were skipped: a dispatch's outputs did not land in "
                                 "a window")
        else:
            rows = plans[False].handle.num_recv_rows
            for sms in o.num_sms:
                buffer.num_sms = sms
                for fp8 in (False, True):
                    x = tokens(fp8)
                    name = "FP8" if fp8 else "BF16"
                    nbytes = normal_bytes(rows, o.hidden, fp8)
                    handle = plans[fp8].handle
                    us = self.median_us(f"dispatch {name} into window", flush, lambda: dispatch(fp8),
                                        host_waits=True)
                    out.append(BenchRow(f"dispatch {name} into window", sms, us, nbytes))
                    us = self.median_us(f"dispatch {name} cached into window", flush,
                                        lambda: buffer.dispatch(x, handle=handle))
                    out.append(BenchRow(f"dispatch {name} cached into window", sms, us, nbytes))
        del plans  # the window's outputs go before its Buffer
        self.stream.synchronize()
        buffer.destroy()
        return out

    def copy_engine_row(self, num_bytes: int, flush: Callable[[], None]) -> Optional[BenchRow]:
        """Times a copy of num_bytes of the next rank's memory into this rank's (the copy engine, no SMs; the
        memory mapped through CUDA IPC by torch). None on every rank when any rank could not map its peer's."""
        torch = self.torch
        local = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
        mine = torch.full((num_bytes,), 0x3C, dtype=torch.uint8, device=self.device)
        torch.cuda.synchronize(self.device)
        peer, rebuild, args, error = None, None, None, ""
        try:
            from torch.multiprocessing.reductions import reduce_tensor

            rebuild, args = reduce_tensor(mine)
        except Exception as exc:  # noqa: BLE001 - any failure only drops this row, on every rank
            error = f"{type(exc).__name__}: {exc}"
        shared = self.gather(args)
        theirs = shared[(self.rank + 1) % self.num_ranks]
        if not error and theirs is not None:
            try:
                peer = rebuild(*theirs)
                local.copy_(peer)  # one untimed copy: a failure here drops the row instead of the run
                torch.cuda.synchronize(self.device)
            except Exception as exc:  # noqa: BLE001
                error = f"{type(exc).__name__}: {exc}"
        elif not error:
            error = "the next rank could not share its memory"
        errors = self.gather(error)
        row = None
        if not any(errors):
            us = self.median_us("copy engine", flush, lambda: local.copy_(peer, non_blocking=True))
            row = BenchRow("copy engine: read next rank", 0, us, float(num_bytes))
        elif self.rank == 0:
            self.warnings.append(f"copy-engine row skipped: {next(e for e in errors if e)}")
        peer = None  # drops the mapping of the peer's memory
        torch.cuda.synchronize(self.device)
        self.host_barrier.wait()  # every peer mapping is gone before the exporters free their memory
        del mine
        return row

    # ---- Low-latency mode (bench/low_latency_bench.cpp) ----

    def run_low_latency(self) -> List[BenchRow]:
        import epx

        torch, o, rank, num_ranks, dev = self.torch, self.o, self.rank, self.num_ranks, self.device
        tokens, hidden, experts = o.ll_tokens, o.hidden, o.ll_experts
        buffer = epx.Buffer(self.world, num_rdma_bytes=epx.get_low_latency_rdma_size_hint(tokens, hidden, num_ranks,
                                                                                          experts),
                            low_latency_mode=True, ranks_per_node=o.ll_ranks_per_node)
        xs = [ll_field(torch, o, o.seed, rank, "ll_x", dev, i) for i in range(LL_INPUT_SETS)]
        ids = ll_field(torch, o, o.seed, rank, "ll_topk", dev)
        weights = ll_field(torch, o, o.seed, rank, "ll_weights", dev)

        def dispatch(x: Any, fp8: bool, hook: bool = False) -> Any:
            return buffer.low_latency_dispatch(x, ids, tokens, experts, use_fp8=fp8, return_recv_hook=hook)

        # BF16 dispatch, identity experts, weighted combine; and the per-expert counts.
        d = dispatch(xs[1], False)
        c = buffer.low_latency_combine(d.recv_x, ids, weights, d.handle)
        self.stream.synchronize()
        check_ll_round_trip(torch, rank, xs[1], ids, weights, c.combined_x)
        check_ll_counts(torch, o, rank, num_ranks, d.recv_count, dev)
        del d, c
        self.host_barrier.wait()

        selections = int((ids >= 0).sum().item())
        fp8_bytes = ll_bytes(selections, hidden, "fp8")
        bf16_bytes = ll_bytes(selections, hidden, "bf16")
        logfmt_bytes = ll_bytes(selections, hidden, "logfmt")
        out: List[BenchRow] = []
        for fp8 in (True, False):
            calls = [0]

            def body(fp8: bool = fp8) -> None:
                dispatch(xs[calls[0] % LL_INPUT_SETS], fp8)
                calls[0] += 1

            name = "LL dispatch FP8" if fp8 else "LL dispatch BF16"
            out.append(BenchRow(name, 0, self.median_us(name, None, body), fp8_bytes if fp8 else bf16_bytes))
        # Combine the rows of one BF16 dispatch (the handle stays valid for repeated combines of the same shape).
        d = dispatch(xs[0], False)
        combined = torch.empty(tokens, hidden, dtype=torch.bfloat16, device=dev)
        for logfmt in (False, True):
            name = "LL combine LogFMT" if logfmt else "LL combine BF16"
            # LogFMT codes every row, within the node too: what the format costs (alone, within one node it
            # would run the BF16 combine).
            us = self.median_us(name, None, lambda: buffer.low_latency_combine(
                d.recv_x, ids, weights, d.handle, use_logfmt=logfmt, logfmt_within_node=logfmt, out=combined))
            out.append(BenchRow(name, 0, us, logfmt_bytes if logfmt else bf16_bytes))

        # Hook mode: the send and the receive phase timed apart.
        send_us, recv_us = self.hook_phases_us(
            "LL dispatch FP8 (hook)", lambda i: dispatch(xs[i % LL_INPUT_SETS], True, hook=True).hook)
        out.append(BenchRow("LL dispatch FP8 send (hook)", 0, send_us, fp8_bytes))
        out.append(BenchRow("LL dispatch FP8 recv (hook)", 0, recv_us, fp8_bytes))
        send_us, recv_us = self.hook_phases_us("LL combine BF16 (hook)", lambda i: buffer.low_latency_combine(
            d.recv_x, ids, weights, d.handle, return_recv_hook=True, out=combined).hook)
        out.append(BenchRow("LL combine BF16 send (hook)", 0, send_us, bf16_bytes))
        out.append(BenchRow("LL combine BF16 recv (hook)", 0, recv_us, bf16_bytes))

        # NCCL: every (token, expert) selection as one row to the expert's rank, FP8-sized then BF16-sized.
        num_local = experts // num_ranks
        send_rows = [int(v) for v in torch.bincount((ids[ids >= 0] // num_local).flatten(),
                                                    minlength=num_ranks).cpu().tolist()]
        all_rows = self.gather(send_rows)
        recv_rows = [all_rows[src][rank] for src in range(num_ranks)]
        for fp8 in (True, False):
            row_bytes = nccl_row_bytes(hidden, fp8, low_latency=True)
            send = torch.full((sum(send_rows), row_bytes), 0x3C, dtype=torch.uint8, device=dev)
            recv = torch.empty((sum(recv_rows), row_bytes), dtype=torch.uint8, device=dev)
            name = "NCCL all-to-all FP8 selections" if fp8 else "NCCL all-to-all BF16 selections"
            us = self.median_us(name, None, lambda: self.dist.all_to_all_single(
                recv, send, recv_rows, send_rows, group=self.world))
            out.append(BenchRow(name, 0, us, fp8_bytes if fp8 else bf16_bytes))
        self.stream.synchronize()
        buffer.destroy()
        return out


def _native_dispatch_input(_epx: Any, torch: Any, x: Any, topk_idx: Any, topk_weights: Any, num_experts: int,
                           is_token_in_rank: Any, num_tokens_per_expert: Any, num_tokens_per_rank: Any) -> Any:
    """The binding's DispatchInput that epx.Buffer.dispatch builds for these tensors (for timing the notify
    step alone, which the Buffer does not expose). The caller keeps the tensors alive."""
    data, scales = x if isinstance(x, tuple) else (x, None)
    native = _epx.DispatchInput()
    native.x = data.data_ptr()
    native.format = _epx.TokenFormat.FP8 if scales is not None else _epx.TokenFormat.BF16
    native.x_scales = 0 if scales is None else scales.data_ptr()
    native.num_tokens, native.hidden = data.shape
    native.topk_idx = topk_idx.data_ptr()
    native.topk_weights = topk_weights.data_ptr()
    native.num_topk = topk_idx.size(1)
    native.num_experts = num_experts
    native.is_token_in_rank = is_token_in_rank.data_ptr()
    native.num_tokens_per_expert = num_tokens_per_expert.data_ptr()
    native.num_tokens_per_rank = num_tokens_per_rank.data_ptr()
    native.expert_alignment = 1
    native.num_worst_tokens = 0
    return native


def _worker(rank: int, num_ranks: int, port: int, o: argparse.Namespace, barrier: HostBarrier) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_ranks)
    json_file = None
    try:
        me = _Rank(rank, num_ranks, o, barrier)
        with torch.cuda.stream(me.stream):
            me.calibrate_launch_ahead()
            if rank == 0:
                if not o.json:
                    prop = torch.cuda.get_device_properties(rank)
                    spin = (f"; each timed call queued behind a {o.launch_ahead_us:g} us GPU spin (host time not "
                            "counted)" if me.spin_cycles else "; host time counted")
                    print(f"{PROG} (epx.Buffer) on {num_ranks} x {prop.name} ({prop.multi_processor_count} SMs "
                          f"each), one process per GPU; medians of {count_of(o.iters, 'run', 'runs')} after {o.warmup} "
                          f"warm-up{spin}",
                          flush=True)
                if o.json_file:
                    json_file = open(o.json_file, "w")
            modes = []
            if o.mode != "low-latency":
                modes.append(("normal", me.run_normal, normal_header(o, num_ranks)))
            if o.mode != "normal":
                modes.append(("low-latency", me.run_low_latency, low_latency_header(o, num_ranks)))
            for mode, run, header in modes:
                rows = run()
                gathered = me.gather([(r.op, r.num_sms, r.time_us, r.bytes, r.network_bytes) for r in rows])
                if rank == 0:
                    rank_rows = [[BenchRow(*item) for item in theirs] for theirs in gathered]
                    print("\n".join(format_rows(rank_rows, o.json, header, mode)), flush=True)
                    if json_file is not None:
                        json_file.write("\n".join(format_rows(rank_rows, True, header, mode)) + "\n")
                        json_file.flush()
        me.report_warnings()
        torch.cuda.synchronize()
        dist.barrier(group=me.gloo)
    finally:
        if json_file is not None:
            json_file.close()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def visible_gpus() -> int:
    """CUDA devices torch sees (0 without torch or CUDA)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def why_nothing_runs(with_cuda: bool) -> Optional[str]:
    """Why this machine cannot run the benchmark (epx without CUDA, no torch, torch without CUDA, no GPU), or
    None when it can."""
    if not with_cuda:
        return "epx was built without CUDA (EPX_WITH_CUDA=OFF)"
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        from epx._util import TORCH_MISSING

        return TORCH_MISSING
    if visible_gpus() == 0:
        import torch

        if torch.version.cuda is None:
            return f"torch {torch.__version__} is a CPU build (no CUDA); install a CUDA build of torch"
        return "no CUDA GPU visible"
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    o = parse_args(argv)
    os.environ.update(NVLINK_ENV)  # before any rank starts (and before NCCL / NVSHMEM read them)
    import epx

    # This bench times epx.Buffer on GPUs and has no CPU stand-in (epx-bench runs its CPU reference instead):
    # without a GPU it measured nothing, says why on stderr (stdout stays empty, JSON or not) and exits 1.
    why = why_nothing_runs(epx.WITH_CUDA)
    if why is not None:
        print(f"{PROG}: {why}: nothing measured ({PROG} times epx.Buffer on CUDA GPUs; epx-bench, the C++ bench, "
              "runs its CPU reference where there is no GPU)", file=sys.stderr, flush=True)
        return 1
    num_gpus = visible_gpus()
    num_ranks = o.ranks if o.ranks > 0 else num_gpus
    try:
        # As epx-bench's run_gpus: the counts that need the visible GPUs, checked now that they are known.
        if num_ranks > num_gpus * o.ranks_per_gpu:
            raise _invalid("--ranks", num_ranks, "must be <= the number of visible GPUs times --ranks-per-gpu")
        if o.ranks == 0:
            _check_ranks_per_node("--ranks-per-node", o.ranks_per_node, num_ranks, "the visible GPUs")
            _check_ranks_per_node("--ll-ranks-per-node", o.ll_ranks_per_node, num_ranks, "the visible GPUs")
    except FlagError as error:
        print(f"{PROG}: {error}", file=sys.stderr, flush=True)
        return 2
    import torch.multiprocessing as mp

    from epx_tools import bench as this  # the worker pickled as epx_tools.bench._worker, also under `python -m`

    barrier = HostBarrier(mp.get_context("spawn"), num_ranks)
    try:
        mp.spawn(this._worker, args=(num_ranks, _free_port(), o, barrier), nprocs=num_ranks, join=True)
    except Exception as exc:  # noqa: BLE001 - a rank's traceback is in the message
        print(f"{PROG} failed: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
