"""``python -m epx.bench``: the C++ ``epx-bench`` through the Python layer (epx.Buffer), one process per GPU.

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

    python -m epx.bench                      # every visible GPU, both modes
    python -m epx.bench --mode normal --num-sms 12,24,48 --json
    python -m epx.bench --plot bench.svg     # also an SVG: per op EPX beside NCCL (epx.bench_plot)

torch is imported only when the benchmark runs (importing this module needs no torch).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

from epx import bench_plot

# Set in os.environ before the ranks are spawned: NVLink multicast (NVLS) stays off on the lent machines.
NVLINK_ENV = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
L2_FLUSH_BYTES = 256 << 20
COPY_ENGINE_BYTES = 32 << 20
LL_INPUT_SETS = 4  # timed low-latency calls rotate through these so no two consecutive calls see the same x
PROG = "python -m epx.bench"
MAX_TOPK = 16  # epx.MAX_TOPK (kMaxTopk); a CPU test checks they agree, so parsing flags needs no binding

# ---- Byte counts (docs/BENCHMARKS.md) ----


def normal_row_bytes(hidden: int, fp8: bool) -> float:
    """Bytes of one received row in normal mode: 2H for BF16, H + 4H/128 (the float32 scales) for FP8 (the
    formula of epx/bench_bytes.hpp, which epx-bench uses too)."""
    from ._ext import _epx

    return _epx.normal_row_bytes(hidden, fp8)


def normal_bytes(num_recv_rows: int, hidden: int, fp8: bool) -> float:
    """Bytes a rank receives in a normal-mode dispatch (combine counts the BF16 dispatch's bytes)."""
    return num_recv_rows * normal_row_bytes(hidden, fp8)


def network_rows(num_tokens_per_node: Sequence[int], own_node: int) -> float:
    """Normal mode across nodes: rows a rank sends over the network in a dispatch (and receives back in the
    combine): each token once per node other than its own that holds one of its experts, however many ranks of
    that node need it. num_tokens_per_node: get_dispatch_layout's num_tokens_per_rdma_rank (the formula of
    epx/bench_bytes.hpp, internode_network_rows)."""
    return float(sum(count for node, count in enumerate(num_tokens_per_node) if node != own_node))


def ll_selection_bytes(hidden: int, fmt: str) -> float:
    """Bytes of one valid (token, expert) selection in low-latency mode, fmt one of fp8, bf16, logfmt (the
    formula of epx/bench_bytes.hpp, which epx-bench uses too)."""
    from ._ext import _epx

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
    """One row averaged over ranks, as the table and the JSON lines report it (and --plot draws it)."""

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


def normal_header(o: argparse.Namespace, num_ranks: int) -> str:
    ranks_per_node = normal_ranks_per_node(o, num_ranks)
    nodes, net = "", ""
    if ranks_per_node < num_ranks:
        nodes = f" ({num_ranks // ranks_per_node} nodes of {ranks_per_node}, NVSHMEM between them)"
        net = "; net GB/s = rows crossing to other nodes, once per node, x row bytes / time"
    return (f"normal mode: {num_ranks} ranks{nodes}, {o.tokens} tokens/rank, hidden {o.hidden}, top-{o.topk} of "
            f"{o.experts} experts (GB/s = rows received x row bytes / time{net}; verified before timing)")


def low_latency_header(o: argparse.Namespace, num_ranks: int) -> str:
    nodes = ""
    if 0 < o.ll_ranks_per_node < num_ranks:
        nodes = f" ({num_ranks // o.ll_ranks_per_node} nodes of {o.ll_ranks_per_node}, NVSHMEM between them)"
    return (f"low-latency mode: {num_ranks} ranks{nodes}, {o.ll_tokens} tokens/rank, hidden {o.hidden}, top-{o.topk} "
            f"of {o.ll_experts} experts (GB/s = selections x bytes per selection / time; verified before timing)")


# ---- Arguments (bench/epx_bench.cpp) ----


def _int_list(text: str) -> List[int]:
    try:
        values = [int(item) for item in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every SM budget must be > 0")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        description="EPX dispatch/combine through epx.Buffer on every visible GPU (one process per GPU), with "
                    "NCCL all-to-all moving the same bytes in the same run; the numbers of the C++ epx-bench.",
        epilog="Bytes (docs/BENCHMARKS.md): normal = rows received x (2H BF16 | H + 4H/128 FP8), combine as BF16 "
               "dispatch; low latency = valid (token, expert) selections x (H + H/32 + 16 FP8 | 2H BF16 | "
               "1.25H + H/32 LogFMT).")
    p.add_argument("--mode", choices=("normal", "low-latency", "all"), default="all", help="what to run (default all)")
    p.add_argument("--ranks", type=int, default=None, help="GPUs to use (default: all visible)")
    p.add_argument("--tokens", type=int, default=4096, help="normal mode: tokens per rank (default 4096)")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size, both modes (default 7168)")
    p.add_argument("--topk", type=int, default=8, help="experts per token, both modes (default 8)")
    p.add_argument("--experts", type=int, default=256, help="normal mode: experts (default 256)")
    p.add_argument("--num-sms", type=_int_list, default=[24], metavar="A,B,...",
                   help="SM budgets of the normal kernels (default 24)")
    p.add_argument("--ranks-per-node", type=int, default=0, metavar="N",
                   help="normal-mode ranks per node: fewer than --ranks makes virtual nodes, so dispatch/combine take "
                        "the path across nodes (NVSHMEM between them); must divide --ranks (default: one node)")
    p.add_argument("--ll-tokens", type=int, default=128, help="low-latency tokens per rank (default 128)")
    p.add_argument("--ll-experts", type=int, default=288, help="low-latency experts (default 288)")
    p.add_argument("--ll-ranks-per-node", type=int, default=0, metavar="N",
                   help="low-latency ranks per node: fewer than --ranks makes virtual nodes joined by NVSHMEM "
                        "(default: one node)")
    p.add_argument("--warmup", type=int, default=5, help="untimed runs per number (default 5)")
    p.add_argument("--iters", type=int, default=30, help="timed runs per number, median reported (default 30)")
    p.add_argument("--json", action="store_true", help="JSON lines on stdout instead of tables")
    p.add_argument("--json-file", default="", metavar="PATH", help="also write the JSON lines to PATH")
    p.add_argument("--plot", default="", metavar="FILE.svg",
                   help="also write an SVG bar chart: per op the EPX time beside the NCCL all-to-all of the same run, "
                        "with GB/s (epx-bench --plot's figure; no matplotlib needed)")
    p.add_argument("--seed", type=int, default=1, help="seed of the random inputs and routing (default 1)")
    p.add_argument("--launch-ahead-us", type=float, default=200.0, metavar="US",
                   help="GPU spin queued before each timed call so Python's host time is not counted "
                        "(default 200; 0 times as the C++ bench, host time included)")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The options, checked; a bad flag or value exits with status 2 and a message (as epx-bench)."""
    p = build_parser()
    o = p.parse_args(argv)
    for name in ("tokens", "hidden", "topk", "experts", "ll_tokens", "ll_experts", "iters"):
        if getattr(o, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(o, name)})")
    if o.ranks is not None and o.ranks < 1:
        p.error(f"--ranks must be >= 1 (got {o.ranks})")
    o.ranks = o.ranks or 0  # 0: every visible GPU
    if o.topk > MAX_TOPK:
        p.error(f"--topk must be <= {MAX_TOPK} (got {o.topk})")
    if o.warmup < 0 or o.launch_ahead_us < 0 or o.ll_ranks_per_node < 0 or o.ranks_per_node < 0:
        p.error("--warmup, --launch-ahead-us, --ranks-per-node and --ll-ranks-per-node must be >= 0")
    for flag, value in (("--ranks-per-node", o.ranks_per_node), ("--ll-ranks-per-node", o.ll_ranks_per_node)):
        if o.ranks > 0 and value > 0 and o.ranks % value != 0:
            p.error(f"{flag} {value} must divide --ranks {o.ranks} (nodes are equal blocks of ranks)")
    if o.plot and not (len(o.plot) > 4 and o.plot.endswith(".svg")):  # as bench_options.hpp: the plot is SVG
        p.error(f"--plot {o.plot} must end in .svg (the plot is an SVG file)")
    if o.mode != "low-latency" and o.hidden % 128 != 0:
        p.error(f"--hidden {o.hidden} must be a multiple of 128 (FP8 dispatch is benchmarked)")
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
                raise RuntimeError(f"epx.bench: host barrier timed out after {self.timeout_s:.0f} s (a rank died?)")


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
        buffer = epx.Buffer(self.world, num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes,
                            ranks_per_node=ranks_per_node if ranks_per_node < num_ranks else 0)

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
    plot: List[bench_plot.Section] = []  # rank 0's report, for --plot
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
                          f"each), one process per GPU; medians of {o.iters} runs after {o.warmup} warm-up{spin}",
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
                    plot.append((header, summarize_rows(rank_rows)))
            if rank == 0 and o.plot:
                bench_plot.write_svg(o.plot, plot)
                if not o.json:
                    print(f"\nplot: {o.plot}", flush=True)
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    o = parse_args(argv)
    os.environ.update(NVLINK_ENV)  # before any rank starts (and before NCCL / NVSHMEM read them)
    import epx

    # With --json, stdout carries JSON only: why nothing ran goes to stderr.
    note = sys.stderr if o.json else sys.stdout
    if not epx.WITH_CUDA:
        print(f"{PROG}: epx was built without CUDA (EPX_WITH_CUDA=OFF): nothing to measure", file=note, flush=True)
        return 0
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        print(f"{PROG}: needs torch (with CUDA); it is not installed: nothing to measure", file=note, flush=True)
        return 0
    num_gpus = visible_gpus()
    if num_gpus == 0:
        print(f"{PROG}: no CUDA GPU visible: nothing to measure (the C++ epx-bench runs the CPU reference "
              "without GPUs)", file=note, flush=True)
        return 0
    num_ranks = o.ranks if o.ranks > 0 else num_gpus
    if num_ranks > num_gpus:
        print(f"{PROG}: --ranks {num_ranks} must be <= the number of visible GPUs ({num_gpus})", file=sys.stderr)
        return 2
    import torch.multiprocessing as mp

    from epx import bench as this  # the worker pickled as epx.bench._worker, also under `python -m`

    barrier = HostBarrier(mp.get_context("spawn"), num_ranks)
    try:
        mp.spawn(this._worker, args=(num_ranks, _free_port(), o, barrier), nprocs=num_ranks, join=True)
    except Exception as exc:  # noqa: BLE001 - a rank's traceback is in the message
        print(f"{PROG} failed: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
