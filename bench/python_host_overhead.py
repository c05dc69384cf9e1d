#!/usr/bin/env python3
"""Host time per call of the Python entry points of ``deep_ep.Buffer`` (EPX's DeepEP interface), beside
NCCL's ``all_to_all_single`` of the same bytes: what a decode loop that is not graph-captured pays per call.

Each entry point runs alone, back to back, ``--iters`` times after ``--warmup`` calls: host microseconds of each
call from time.perf_counter (no sync inside the loop; the median is printed), and the GPU's microseconds per call
from CUDA events around the whole loop (back to back: when the host is the bottleneck, this is the host time).
Entry points: get_dispatch_layout, the layout then a dispatch given it (the pair callers issue each step: the
dispatch reads its counts off the layout's board), dispatch (repeated with one layout: the count exchange), the
same with num_worst_tokens (DeepEP's CPU-sync-free dispatch: outputs of the worst case's rows), cached dispatch,
combine, low_latency_dispatch (FP8, cumulative_local_expert_recv_stats), low_latency_combine (BF16), both with
return_recv_hook (the call plus its hook), and the eager low-latency step (dispatch then combine, no hooks,
async_finish=False), the number issue 37 compares with DeepEP's 46 us on 2 x H100.

A dispatch without a cached handle or num_worst_tokens sizes its outputs by the received counts, so its host
waits for the GPU's count exchange (DeepEP's does too): in a back-to-back loop that wait also covers the work
queued before it. Two columns split it off: the host's mean wait per call (epx.Buffer.dispatch_count_wait_us),
and the host's own work, the median over calls of each call's host time less its own wait. Back to back, a call
the GPU paces blocks where its rank happens to (rank 0's table may then read tens of us more or less than rank
1's): the table is rank 0's, with the slowest rank's own work beside it. The last two columns time each call
alone (its host time, and that less its count wait): after a barrier and a device sync, on an idle GPU, as a call
between other work finds the host (caches and the driver's submission path cold): on 2 x H200 1.2-2x the
back-to-back host time. Each rank's process runs where the OS puts it; --pin runs it on a few cores of its GPU's
NUMA node (--pin-cores, default 4: the calling thread on the first, the threads NCCL, NVSHMEM and CUDA start on
the others). Pinned, a thread started after the calling thread moved shares its core, and the layout's GPU time
per call read 191-264 us against 20-24 unpinned (2 x H100): the default leaves the processes unpinned. Each rank
prints the threads that kept a CPU busy (none but the calling thread in those runs: no helper thread spins).

    PYTHONPATH=python:build/python python bench/python_host_overhead.py             # 2 ranks (2 GPUs)
    PYTHONPATH=python:build/python python bench/python_host_overhead.py --ranks 1   # one GPU
    PYTHONPATH=python:build/python python bench/python_host_overhead.py --stub      # no GPU, see below
    ... --stub --profile ll_step                                                    # cProfile of one entry
    ... --stub --stub-extension                   # the torch extension's path (what a GPU runs), calls stubbed

--stub runs one rank on the CPU with the native calls stubbed (tests/python/cpu/fake_runtime.py's
StubBinding: they return at once, the structs are the compiled binding's): the Python layer's own cost. Its
default shapes are smaller (--experts 8) so that CPU allocations stay cheap; the Python path is the same.
--stub-extension takes the torch extension's path instead, its calls stubbed too (StubTorchCalls): the Python
that path runs per call on a GPU, the rest of a call's host time being the extension's and the runtime's C++
and the driver. A tool, not part of the shipped package.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# NVLink multicast stays off on the lent machines (as epx_tools.bench sets it).
NVLINK_ENV = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}

# (entry point, what it runs): the rows of the table, in order.
ENTRY_POINTS = (
    "get_dispatch_layout",
    "layout_then_dispatch",
    "dispatch",
    "dispatch_worst_case",
    "dispatch_cached",
    "combine",
    "low_latency_dispatch",
    "low_latency_combine",
    "low_latency_dispatch_hook",
    "low_latency_combine_hook",
    "ll_step",
)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="ranks (one per GPU), at most the GPUs present")
    p.add_argument("--stub", action="store_true", help="CPU, one rank, native calls stubbed")
    p.add_argument("--stub-extension", action="store_true",
                   help="with --stub: the torch extension's path (what a GPU runs), its calls stubbed too")
    p.add_argument("--tokens", type=int, default=128, help="low-latency tokens per rank (and max per rank)")
    p.add_argument("--normal-tokens", type=int, default=128, help="normal-mode tokens per rank")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=None, help="default 288 (8 with --stub)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--profile", choices=ENTRY_POINTS, help="cProfile this entry point (--iters calls)")
    p.add_argument("--trace", help="comma-separated entry points: the CUDA API calls each makes per call and their "
                   "host time (torch.profiler, --iters calls), printed instead of the table")
    p.add_argument("--json", help="also write the rows to this file (JSON)")
    p.add_argument("--pin", action="store_true",
                   help="run each rank's process on --pin-cores cores near its GPU (default: where the OS puts it)")
    p.add_argument("--no-pin", action="store_true", help="the default (kept for older command lines)")
    p.add_argument("--pin-cores", type=int, default=4, help="cores each rank's process may run on (default 4)")
    o = p.parse_args(argv)
    if o.experts is None:
        o.experts = 8 if o.stub else 288
    if o.stub:
        o.ranks = 1
    return o


# ---- Timing ----


def own_work_us(host_s: List[float], waits_us: List[float]) -> float:
    """Median over calls of the host's own work: each call's host time less its own wait for counts (a median
    of host times less a mean of waits mixes two statistics of skewed samples)."""
    return statistics.median(h * 1e6 - w for h, w in zip(host_s, waits_us))


def time_calls(
    call: Callable[[], Any], warmup: int, iters: int, torch: Any, gpu: bool, waited_us: Callable[[], float],
    barrier: Callable[[], None] = lambda: None,
) -> Tuple[float, float, float, float, float, float]:
    """(median host us per call, GPU us per call back to back or nan, mean us per call the host waited for
    dispatch counts, median us per call of the host's own work; then the same call in isolation: median host us,
    median own work). No sync inside the back-to-back loop; each call's wait is read after its clock stops.

    Back to back, a call whose GPU work is the bottleneck blocks somewhere (its count wait, or a driver call
    that waits for room) for the GPU's pace: which rank blocks where differs, so the two ranks' own work can
    differ by tens of us (26 / 60 us at 4,096 tokens, 2 x H200) with the same GPU time. Alone, each call starts
    on an idle GPU, the ranks lined up by `barrier` (cold caches and submission path: it reads more host time
    than back to back, not less)."""
    for _ in range(warmup):
        call()
    waited_before = waited_us()
    if gpu:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    clock = time.perf_counter
    host = []
    waits = []
    last_wait = waited_before
    for _ in range(iters):
        begin = clock()
        call()
        host.append(clock() - begin)
        now = waited_us()
        waits.append(now - last_wait)  # this call's own wait
        last_wait = now
    gpu_us = float("nan")
    if gpu:
        end.record()
        end.synchronize()
        gpu_us = start.elapsed_time(end) * 1e3 / iters
    alone, alone_waits = [], []
    for _ in range(iters):
        barrier()
        if gpu:
            torch.cuda.synchronize()
        last_wait = waited_us()
        begin = clock()
        call()
        alone.append(clock() - begin)
        alone_waits.append(waited_us() - last_wait)
    return (statistics.median(host) * 1e6, gpu_us, sum(waits) / iters, own_work_us(host, waits),
            statistics.median(alone) * 1e6, own_work_us(alone, alone_waits))


def profile_calls(call: Callable[[], Any], warmup: int, iters: int, show: bool) -> None:
    for _ in range(warmup):
        call()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(iters):
        call()
    profiler.disable()
    if show:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def trace_api_calls(call: Callable[[], Any], warmup: int, iters: int, torch: Any) -> List[str]:
    """The CUDA runtime and driver calls one call of `call` makes: per name, calls per call and host us per
    call (CUPTI adds its own cost to each)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    lines = []
    for event in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total):
        if event.key.startswith(("cuda", "cu")) and event.key != "cudaDeviceSynchronize":
            lines.append(f"  {event.key}: {event.count / iters:.2f} per call, "
                         f"{event.self_cpu_time_total / iters:.1f} us per call")
    return lines


# ---- The calls ----


def normal_calls(
    buffer: Any, torch: Any, o: argparse.Namespace, num_ranks: int, device: Any
) -> Dict[str, Callable]:
    """Normal mode as argument-free callables over fixed inputs (collective: every rank makes them alike): the
    layout, a dispatch given it (as DeepEP callers pass it; also with num_worst_tokens), a cached one, a
    combine."""
    gen = torch.Generator(device="cpu").manual_seed(1234)
    x = torch.randn(o.normal_tokens, o.hidden, generator=gen).to(torch.bfloat16).to(device)
    idx, weights = routing(torch, gen, o, o.normal_tokens, device)
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, o.experts)
    layout = dict(
        num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=idx,
        topk_weights=weights,
    )
    recv_x, _, recv_weights, _, handle, _ = buffer.dispatch(x, **layout)

    def layout_then_dispatch() -> Any:
        # As callers issue them each step: the dispatch reads its counts off the fresh layout's board. The
        # "dispatch" row reuses one layout, so its dispatches run the count exchange and wait for it instead.
        fresh_rank, fresh_rdma, fresh_expert, fresh_in_rank, _ = buffer.get_dispatch_layout(idx, o.experts)
        return buffer.dispatch(x, num_tokens_per_rank=fresh_rank, num_tokens_per_rdma_rank=fresh_rdma,
                               is_token_in_rank=fresh_in_rank, num_tokens_per_expert=fresh_expert, topk_idx=idx,
                               topk_weights=weights)

    return {
        "get_dispatch_layout": lambda: buffer.get_dispatch_layout(idx, o.experts),
        "layout_then_dispatch": layout_then_dispatch,
        "dispatch": lambda: buffer.dispatch(x, **layout),
        "dispatch_worst_case": lambda: buffer.dispatch(x, **layout, num_worst_tokens=o.normal_tokens * num_ranks),
        "dispatch_cached": lambda: buffer.dispatch(x, handle=handle),
        "combine": lambda: buffer.combine(recv_x, handle, topk_weights=recv_weights),
    }


def low_latency_calls(
    buffer: Any, torch: Any, o: argparse.Namespace, num_ranks: int, device: Any
) -> Dict[str, Callable]:
    """Low-latency mode, the issue's step: FP8 dispatch with statistics, BF16 combine, without and with hooks."""
    gen = torch.Generator(device="cpu").manual_seed(4321)
    x = torch.randn(o.tokens, o.hidden, generator=gen).to(torch.bfloat16).to(device)
    idx, weights = routing(torch, gen, o, o.tokens, device)
    stats = torch.zeros(o.experts // num_ranks, dtype=torch.int32, device=device)
    expert_out = torch.empty(
        o.experts // num_ranks, num_ranks * o.tokens, o.hidden, dtype=torch.bfloat16, device=device
    ).uniform_(-1, 1)
    last: Dict[str, Any] = {}  # the handle of the last dispatch, for the combines timed alone

    def dispatch(hook: bool = False) -> None:
        _, _, handle, _, receive = buffer.low_latency_dispatch(
            x, idx, o.tokens, o.experts, cumulative_local_expert_recv_stats=stats, return_recv_hook=hook
        )
        last["handle"] = handle
        if hook:
            receive()

    def combine(hook: bool = False) -> None:
        _, _, receive = buffer.low_latency_combine(expert_out, idx, weights, last["handle"], return_recv_hook=hook)
        if hook:
            receive()

    def step() -> None:  # eager: no hooks, async_finish=False
        _, _, handle, _, _ = buffer.low_latency_dispatch(
            x, idx, o.tokens, o.experts, cumulative_local_expert_recv_stats=stats
        )
        buffer.low_latency_combine(expert_out, idx, weights, handle)

    dispatch()
    return {
        "low_latency_dispatch": dispatch,
        "low_latency_combine": combine,
        "low_latency_dispatch_hook": lambda: dispatch(True),
        "low_latency_combine_hook": lambda: combine(True),
        "ll_step": step,
    }


def routing(torch: Any, gen: Any, o: argparse.Namespace, num_tokens: int, device: Any) -> Tuple[Any, Any]:
    """Random top-k of distinct experts per token, and float32 weights."""
    idx = torch.rand(num_tokens, o.experts, generator=gen).topk(o.topk, dim=1).indices
    weights = torch.rand(num_tokens, o.topk, generator=gen)
    return idx.to(device), weights.to(device)


def nccl_calls(torch: Any, o: argparse.Namespace, num_ranks: int, device: Any) -> Dict[str, Callable]:
    """all_to_all_single of the bytes each family moves per rank: normal = every token to every rank (BF16),
    low latency = every (token, expert) selection (FP8 dispatch with scales, BF16 combine)."""
    import torch.distributed as dist

    def a2a(num_bytes: int) -> Callable[[], Any]:
        num_bytes = -(-num_bytes // num_ranks) * num_ranks
        send = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        recv = torch.empty_like(send)
        return lambda: dist.all_to_all_single(recv, send)

    normal = o.normal_tokens * num_ranks * o.hidden * 2
    ll_dispatch = o.tokens * o.topk * (o.hidden + 4 * (o.hidden // 128) + 16)
    ll_combine = o.tokens * o.topk * o.hidden * 2
    return {
        f"all_to_all_single {normal} B (normal)": a2a(normal),
        f"all_to_all_single {ll_dispatch} B (LL dispatch)": a2a(ll_dispatch),
        f"all_to_all_single {ll_combine} B (LL combine)": a2a(ll_combine),
    }


def run_rows(
    buffers: Tuple[Any, Any],
    torch: Any,
    o: argparse.Namespace,
    num_ranks: int,
    device: Any,
    gpu: bool,
    barrier: Callable[[], None],
    show: bool = True,
) -> List[Tuple[str, float, float, float, float, float, float]]:
    """The table's rows (--profile: prints the profile where `show`, returns none)."""
    normal_buffer, ll_buffer = buffers
    calls = normal_calls(normal_buffer, torch, o, num_ranks, device)
    # deep_ep.Buffer holds an epx.Buffer, which counts the host's waits for dispatch counts.
    epx_buffer = normal_buffer._live()

    def waited_us() -> float:
        return epx_buffer.dispatch_count_wait_us

    calls.update(low_latency_calls(ll_buffer, torch, o, num_ranks, device))
    if o.profile:
        profile_calls(calls[o.profile], o.warmup, o.iters, show)
        return []
    if o.trace:
        for name in o.trace.split(","):
            barrier()
            lines = trace_api_calls(calls[name], o.warmup, o.iters, torch)
            if show:
                print(f"{name}: CUDA API calls\n" + "\n".join(lines), flush=True)
        return []
    rows = []
    for name in ENTRY_POINTS:
        barrier()
        rows.append((name, *time_calls(calls[name], o.warmup, o.iters, torch, gpu, waited_us, barrier)))
    if gpu:
        for name, call in nccl_calls(torch, o, num_ranks, device).items():
            barrier()
            rows.append((name, *time_calls(call, o.warmup, o.iters, torch, gpu, waited_us, barrier)))
    return rows


def slowest_own_us(every_rank: List[List[Tuple]]) -> List[float]:
    """Per row (entry point) of the ranks' tables: the largest own work (the 5th field) over the ranks."""
    return [max(rows[i][4] for rows in every_rank) for i in range(len(every_rank[0]))]


def print_rows(rows: List[Tuple[str, float, float, float, float, float, float]], header: str,
               json_path: Optional[str], slowest_own: Optional[List[float]] = None) -> None:
    """Rank 0's table; `slowest_own`: each row's own work on the slowest rank (one rank: its own)."""
    slowest_own = slowest_own or [row[4] for row in rows]
    print(header)
    print(
        f"{'entry point':<48} {'host us/call (median)':>22} {'GPU us/call (back to back)':>27} "
        f"{'of host: count wait (mean)':>27} {'own work (median)':>18} {'own, slowest rank':>18} "
        f"{'alone: host':>12} {'alone: own':>11}"
    )
    for (name, host_us, gpu_us, wait_us, own_us, alone_us, alone_own_us), slowest in zip(rows, slowest_own):
        print(f"{name:<48} {host_us:>22.1f} {gpu_us:>27.1f} {wait_us:>27.1f} {own_us:>18.1f} {slowest:>18.1f} "
              f"{alone_us:>12.1f} {alone_own_us:>11.1f}")
    if json_path:
        with open(json_path, "w") as f:
            # null where there is no GPU time (--stub): strict JSON has no NaN.
            json.dump(
                [
                    {"entry": n, "host_us": h, "gpu_us": None if g != g else g, "count_wait_us": w,
                     "own_work_us": own, "own_work_us_slowest_rank": slow, "alone_host_us": ah,
                     "alone_own_work_us": ao}
                    for (n, h, g, w, own, ah, ao), slow in zip(rows, slowest_own)
                ],
                f,
                indent=1,
            )


# ---- Where each rank runs ----


def parse_cpu_list(text: str) -> List[int]:
    """CPUs of a sysfs list such as "0-3,8,10-11"."""
    cpus: List[int] = []
    for part in filter(None, text.strip().split(",")):
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def compact_cpus(cpus: List[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    spans: List[List[int]] = []
    for cpu in sorted(cpus):
        if spans and cpu == spans[-1][1] + 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)


def gpu_local_cpus(pci_bus_id: str, sysfs: str = "/sys") -> List[int]:
    """The CPUs of the NUMA node the GPU at `pci_bus_id` ("0000:1b:00.0") hangs off, from sysfs; [] when
    sysfs does not say (no NUMA information, another OS)."""
    try:
        with open(os.path.join(sysfs, "bus", "pci", "devices", pci_bus_id.lower(), "numa_node")) as f:
            node = int(f.read().strip())
        if node < 0:
            return []
        with open(os.path.join(sysfs, "devices", "system", "node", f"node{node}", "cpulist")) as f:
            return parse_cpu_list(f.read())
    except (OSError, ValueError):
        return []


def thread_siblings(cpu: int, sysfs: str = "/sys") -> Tuple[int, ...]:
    """The CPUs of `cpu`'s physical core (its hyperthreads, itself included); (cpu,) where sysfs does not say."""
    path = os.path.join(sysfs, "devices", "system", "cpu", f"cpu{cpu}", "topology", "thread_siblings_list")
    try:
        with open(path) as f:
            return tuple(parse_cpu_list(f.read())) or (cpu,)
    except (OSError, ValueError):
        return (cpu,)


def pick_cpus(rank: int, num_ranks: int, local: List[int], allowed: List[int], count: int,
              sysfs: str = "/sys") -> List[int]:
    """Up to `count` physical cores for `rank`, one CPU of each: among its GPU's local CPUs that the process may
    use, else among all it may use, ranks given disjoint slices of physical cores so that two ranks never share
    one (ranks whose GPUs share a NUMA node take different cores of it). A core's other hyperthreads stay idle:
    the calling thread (the first CPU) shares its core with no thread of any rank. [] when nothing is
    allowed."""
    allowed_set = set(allowed)
    candidates = [c for c in local if c in allowed_set] or sorted(allowed_set)
    core_of: Dict[Tuple[int, ...], List[int]] = {}  # the candidates by physical core (dicts keep insertion order)
    for cpu in candidates:
        core_of.setdefault(thread_siblings(cpu, sysfs), []).append(cpu)
    cores = list(core_of.values())  # in the order of their first CPU
    if not cores:
        return []
    # Leave a node's first core (interrupts and housekeeping land there) when there is a choice.
    if len(cores) > num_ranks:
        cores = cores[1:]
    begin = (rank * len(cores)) // num_ranks
    end = max(((rank + 1) * len(cores)) // num_ranks, begin + 1)
    return [core[0] for core in cores[begin:min(end, begin + max(count, 1))]]


# Host times on one machine drift between processes by more than the changes they measure (NCCL's
# all_to_all_single row read 27 us in one run and 49 us in the next, same build): the CPU a rank lands on
# (its distance to the GPU, its neighbours) is the largest part of that, so each rank takes a few cores near
# its GPU, the calling thread one of its own. Not one for all: the threads NCCL, NVSHMEM and the CUDA driver
# start then share the calling thread's core, and on 2 x H100 the layout's GPU time per call read 90-729 us
# pinned so against 28-29 unpinned (the GPU waited for work the starved threads hand it). The calling thread
# gets the first core once those threads exist (pin_main_thread); they keep the others, which they inherited
# when they started (Linux: sched_setaffinity(0) sets the calling thread's mask).
def split_cores(cpus: List[int]) -> Tuple[List[int], List[int]]:
    """(the calling thread's core, the other threads' cores) of a rank's cores; one core serves both."""
    return cpus[:1], cpus[1:] or cpus[:1]


def local_cpus_of_gpu(torch: Any, device: int) -> List[int]:
    """The CPUs of GPU `device`'s NUMA node ([] when sysfs does not say)."""
    props = torch.cuda.get_device_properties(device)
    ids = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    return gpu_local_cpus("{:04x}:{:02x}:{:02x}.0".format(*ids)) if None not in ids else []


def pin_to_gpu_local_cpus(rank: int, num_ranks: int, torch: Any, count: int) -> List[int]:
    local = local_cpus_of_gpu(torch, rank)
    cpus = pick_cpus(rank, num_ranks, local, sorted(os.sched_getaffinity(0)), count)
    if cpus:
        os.sched_setaffinity(0, set(split_cores(cpus)[1]))  # what threads started from now on inherit
    return cpus


def pin_main_thread(cpus: List[int]) -> None:
    if cpus:
        os.sched_setaffinity(0, set(split_cores(cpus)[0]))


def process_lifetime_s() -> float:
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")


def busy_threads(min_share: float = 0.05, task_dir: str = "/proc/self/task",
                 lifetime_s: Optional[float] = None) -> List[str]:
    """This process's threads that used at least min_share of the process's lifetime on a CPU, busiest first:
    a thread that spins (a proxy polling for work) takes a core from the calling thread when they share one."""
    ticks = os.sysconf("SC_CLK_TCK")
    lifetime_s = process_lifetime_s() if lifetime_s is None else lifetime_s
    rows = []
    for tid in os.listdir(task_dir):
        try:
            with open(f"{task_dir}/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"{task_dir}/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        cpu_s = (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
        if lifetime_s > 0 and cpu_s / lifetime_s >= min_share:
            rows.append((cpu_s, f"{name} (tid {tid}, CPU {fields[36]}): {cpu_s:.1f} s of {lifetime_s:.1f} s"))
    return [text for _, text in sorted(rows, reverse=True)]


# ---- Modes ----


def run_stub(o: argparse.Namespace) -> None:
    sys.path.insert(0, os.path.join(ROOT, "tests", "python", "cpu"))
    import torch
    from fake_runtime import deep_ep_wrapper, install_stub

    buffer, _ = install_stub(o.normal_tokens, o.hidden, o.experts, extension=o.stub_extension, num_topk=o.topk)
    wrapper = deep_ep_wrapper(buffer)
    rows = run_rows((wrapper, wrapper), torch, o, 1, torch.device("cpu"), False, lambda: None)
    path = "the torch extension's path, its calls stubbed" if o.stub_extension else "native calls stubbed"
    if rows:
        print_rows(rows, f"stub (CPU, {path}), torch {torch.__version__}: {header(o, 1)}", o.json)


def header(o: argparse.Namespace, num_ranks: int) -> str:
    return (
        f"{num_ranks} rank(s); low latency {o.tokens} tokens, hidden {o.hidden}, top-{o.topk} of {o.experts} "
        f"experts, FP8 dispatch, BF16 combine; normal {o.normal_tokens} tokens BF16; {o.iters} calls each"
    )


def _worker(rank: int, num_ranks: int, store_file: str, o: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import deep_ep

    torch.cuda.set_device(rank)
    cpus: List[int] = []
    if o.pin and not o.no_pin:
        cpus = pin_to_gpu_local_cpus(rank, num_ranks, torch, o.pin_cores)
        main_core, others = split_cores(cpus)
        print(f"rank {rank}: calling thread on CPU {main_core}, other threads on {others}" if cpus
              else f"rank {rank}: not pinned", file=sys.stderr)
    dist.init_process_group("nccl", init_method=f"file://{store_file}", rank=rank, world_size=num_ranks)
    try:
        group = dist.new_group(list(range(num_ranks)))
        Buffer = deep_ep.Buffer
        configs = (
            [Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks)]
            if num_ranks in (2, 4, 8)
            else [deep_ep.Config(Buffer.num_sms)]
        )
        nvl_bytes = max(c.get_nvl_buffer_size_hint(o.hidden * 2, num_ranks) for c in configs)
        rdma_bytes = Buffer.get_low_latency_rdma_size_hint(o.tokens, o.hidden, num_ranks, o.experts)
        normal_buffer = Buffer(group, nvl_bytes, 0)
        ll_buffer = Buffer(group, 0, rdma_bytes, low_latency_mode=True, num_qps_per_rank=max(1, o.experts // num_ranks))
        dist.barrier(group)  # the group's communicator (and its threads) exists before the calling thread moves
        pin_main_thread(cpus)
        rows = run_rows(
            (normal_buffer, ll_buffer),
            torch,
            o,
            num_ranks,
            torch.device("cuda", rank),
            True,
            lambda: dist.barrier(group),
            show=rank == 0,
        )
        torch.cuda.synchronize()
        # One write: the ranks' lines otherwise interleave mid-line. Whether the calling thread ran on its GPU's
        # NUMA node: host times differ between runs by up to 1.5x, NCCL's calls as much as EPX's.
        local = local_cpus_of_gpu(torch, rank)
        where = f"GPU's NUMA node CPUs {compact_cpus(local)}" if local else "GPU's NUMA node unknown"
        sys.stderr.write(f"rank {rank}: {where}; busy threads: " + "; ".join(busy_threads()) + "\n")
        # Every rank's rows to rank 0: the table is rank 0's, beside the slowest rank's own work per entry (the
        # ranks of one run differ: 19.6 and 29.1 us for one dispatch on 2 x H200).
        every_rank: List[Any] = [None] * num_ranks
        dist.all_gather_object(every_rank, rows, group=group)
        if rank == 0 and rows:
            print_rows(
                rows,
                f"{torch.cuda.get_device_name()} x {num_ranks}, torch {torch.__version__}: {header(o, num_ranks)}",
                o.json,
                slowest_own_us(every_rank),
            )
    finally:
        dist.destroy_process_group()


def main(argv: Optional[List[str]] = None) -> int:
    o = parse_args(argv)
    if o.stub:
        run_stub(o)
        return 0
    for key, value in NVLINK_ENV.items():
        os.environ.setdefault(key, value)
    import torch
    import torch.multiprocessing as mp

    num_gpus = torch.cuda.device_count()
    if num_gpus < o.ranks:
        plural = "" if o.ranks == 1 else "s"
        print(f"needs {o.ranks} GPU{plural}, {num_gpus} present (--ranks 1 for one GPU, --stub for none)",
              file=sys.stderr)
        return 2
    # The group meets through a file (as tests/python/gpu/dist_util.py): no TCP port to collide with.
    with tempfile.TemporaryDirectory(prefix="epx-host-overhead-") as directory:
        mp.spawn(_worker, args=(o.ranks, os.path.join(directory, "store"), o), nprocs=o.ranks, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
