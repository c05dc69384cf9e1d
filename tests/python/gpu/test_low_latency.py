"""Low-latency mode through epx.compat.deep_ep against the CPU reference, on 2 and 4 GPUs: BF16 / FP8 /
rounded / UE8M0 dispatch, BF16 and LogFMT weighted combine, receive hooks, zero-copy, async events, statistics,
the two-pending-results rule, and CUDA-graph capture and replay. Compared bit-exactly, as the C++ tests do."""

from dataclasses import dataclass

import numpy as np
import pytest

from dist_util import gpu_counts, run

HIDDEN = 512
NUM_TOPK = 4
MAX_TOKENS = 16  # M


@dataclass
class Case:
    use_fp8: bool = False
    round_scale: bool = False
    use_ue8m0: bool = False
    use_logfmt: bool = False
    dispatch_hook: bool = False
    combine_hook: bool = False
    zero_copy: bool = False
    async_finish: bool = False
    pre_reduce: bool = False  # epx's own API (deep_ep has no pre-reduced combine): pre_reduced_round


CASES = [
    Case(),
    Case(use_fp8=True),
    Case(use_fp8=True, round_scale=True, dispatch_hook=True, combine_hook=True),
    Case(use_fp8=True, round_scale=True, use_ue8m0=True, use_logfmt=True, zero_copy=True),
    Case(use_logfmt=True, async_finish=True),
    Case(dispatch_hook=True, zero_copy=True, async_finish=True),
]


class World:
    """Every rank's seeded inputs of one iteration and the reference's outputs (each process builds all)."""

    def __init__(self, num_ranks, num_experts, seed, case, stats=None, masked_ranks=(), ranks_per_node=0):
        import epx_tools.reference as ref

        native = ref.native
        self.params = ref.low_latency_params(num_ranks=num_ranks, num_experts=num_experts, hidden=HIDDEN,
                                             num_topk=NUM_TOPK, num_max_dispatch_tokens_per_rank=MAX_TOKENS,
                                             masked_ranks=masked_ranks)
        self.num_tokens = [MAX_TOKENS, MAX_TOKENS - 3, 1, 0][:num_ranks] if num_ranks <= 4 else [MAX_TOKENS] * num_ranks
        ids = native.make_unbalanced_routing(seed, self.num_tokens, NUM_TOPK, num_experts, num_ranks)
        self.ids = [ids[r].reshape(-1, NUM_TOPK) for r in range(num_ranks)]
        self.x = [native.random_bf16_tokens(seed * 7919 + r, self.num_tokens[r], HIDDEN, r,
                                            native.TokenValues.UNIFORM).reshape(-1, HIDDEN) for r in range(num_ranks)]
        self.weights = [
            native.random_topk_weights(seed * 104729 + r, self.num_tokens[r], NUM_TOPK).reshape(-1, NUM_TOPK)
            for r in range(num_ranks)
        ]
        self.received = ref.low_latency_dispatch(self.x, self.ids, self.params, use_fp8=case.use_fp8,
                                                 round_scale=case.round_scale, use_ue8m0=case.use_ue8m0,
                                                 cumulative_local_expert_recv_stats=stats)
        # Expert outputs: seeded rows where each expert received tokens, zeros elsewhere.
        num_local, rows = num_experts // num_ranks, num_ranks * MAX_TOKENS
        self.expert_out = []
        for d in range(num_ranks):
            out = np.zeros((num_local, rows, HIDDEN), dtype=np.uint16)
            for le in range(num_local):
                count = int(self.received[d].recv_count[le])
                values = native.TokenValues.UNIFORM if le % 2 == 0 else native.TokenValues.SMALL_INTEGERS
                out[le, :count] = native.random_bf16_tokens(seed * 31337 + d * 4096 + le, count, HIDDEN, d, values,
                                                            False).reshape(count, HIDDEN)
            self.expert_out.append(out)
        # LogFMT codes the rows that cross nodes (of ranks_per_node ranks; 0: one node).
        self.combined = ref.low_latency_combine(self.expert_out, self.ids, self.weights, self.params,
                                                use_logfmt=case.use_logfmt, pre_reduce=case.pre_reduce,
                                                ranks_per_node=ranks_per_node)

    def inputs(self, rank, device):
        import torch

        import epx_tools.reference as ref

        return (ref.to_torch_bf16(self.x[rank], device), torch.from_numpy(self.ids[rank]).to(device),
                torch.from_numpy(self.weights[rank]).to(device), ref.to_torch_bf16(self.expert_out[rank], device))


def waits_succeeded(buffer):
    """A device wait that gave up reports itself here (rank, peer, phase), not as counts of 0 or rows that
    differ further down."""
    import torch

    torch.cuda.synchronize()
    buffer.check()


def check_received(buffer, expected, recv_x, recv_count, case):
    import epx_tools.reference as ref

    waits_succeeded(buffer)
    counts = recv_count.cpu().numpy()
    np.testing.assert_array_equal(counts, expected.recv_count)
    data, scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
    data_bits = ref.fp8_bytes(data) if case.use_fp8 else ref.bf16_bits(data)
    scales_host = None if scales is None else scales.cpu().numpy()
    for le, count in enumerate(counts):
        np.testing.assert_array_equal(data_bits[le, :count], expected.recv_x[le, :count])
        if case.use_fp8:
            got = scales_host[le, :count]
            if case.use_ue8m0:
                got = got.view(np.uint32)
            np.testing.assert_array_equal(got, expected.recv_x_scales[le, :count])


def one_round(buffer, world, rank, num_experts, case, device, stats=None):
    import epx_tools.reference as ref

    x, topk_idx, weights, expert_out = world.inputs(rank, device)
    recv_x, recv_count, handle, event, hook = buffer.low_latency_dispatch(
        x, topk_idx, MAX_TOKENS, num_experts, cumulative_local_expert_recv_stats=stats, use_fp8=case.use_fp8,
        round_scale=case.round_scale, use_ue8m0=case.use_ue8m0,
        async_finish=case.async_finish and not case.dispatch_hook, return_recv_hook=case.dispatch_hook)
    assert (hook is not None) == case.dispatch_hook
    if hook is not None:
        hook()
    event.current_stream_wait()
    check_received(buffer, world.received[rank], recv_x, recv_count, case)

    if case.zero_copy:
        rows = buffer.get_next_low_latency_combine_buffer(handle)
        rows.copy_(expert_out)
        expert_out = rows
    combined, event, hook = buffer.low_latency_combine(
        expert_out, topk_idx, weights, handle, use_logfmt=case.use_logfmt, zero_copy=case.zero_copy,
        async_finish=case.async_finish and not case.combine_hook, return_recv_hook=case.combine_hook)
    if hook is not None:
        hook()
    event.current_stream_wait()
    waits_succeeded(buffer)
    np.testing.assert_array_equal(ref.bf16_bits(combined), world.combined[rank])


def pre_reduced_round(buffer, world, rank, num_experts, case, device):
    """A dispatch that carries the top-k weights, then the pre-reduced combine, through epx's Buffer."""
    import epx_tools.reference as ref

    x, topk_idx, weights, expert_out = world.inputs(rank, device)
    dispatched = buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts, use_fp8=case.use_fp8,
                                             return_recv_hook=case.dispatch_hook, topk_weights=weights)
    if dispatched.hook is not None:
        dispatched.hook()
    recv_x = (dispatched.recv_x, dispatched.recv_x_scales) if case.use_fp8 else dispatched.recv_x
    check_received(buffer, world.received[rank], recv_x, dispatched.recv_count, case)
    if case.zero_copy:
        rows = buffer.get_next_low_latency_combine_buffer(dispatched.handle)
        rows.copy_(expert_out)
        expert_out = rows
    combined = buffer.low_latency_combine(expert_out, topk_idx, None, dispatched.handle, use_logfmt=case.use_logfmt,
                                          zero_copy=case.zero_copy, return_recv_hook=case.combine_hook,
                                          pre_reduce=True)
    if combined.hook is not None:
        combined.hook()
    waits_succeeded(buffer)
    np.testing.assert_array_equal(ref.bf16_bits(combined.combined_x), world.combined[rank])


PRE_REDUCED_CASES = [
    Case(pre_reduce=True),
    Case(use_fp8=True, use_logfmt=True, dispatch_hook=True, combine_hook=True, zero_copy=True, pre_reduce=True),
]


def low_latency_worker(rank, num_ranks, group, python_path=False):
    """python_path: epx.Buffer's Python path for every call instead of the torch extension's (the same results)."""
    import torch

    import epx
    import epx.buffer
    import epx.compat.deep_ep as deep_ep
    import epx_tools.reference as ref

    if python_path:
        epx.buffer.torch_calls = None
    else:
        assert_torch_extension_loaded()
    device = torch.device("cuda", torch.cuda.current_device())
    num_experts = 4 * num_ranks
    num_local = num_experts // num_ranks
    num_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, HIDDEN, num_ranks, num_experts)
    buffer = deep_ep.Buffer(group, num_rdma_bytes=num_bytes, low_latency_mode=True, num_qps_per_rank=num_local,
                            explicitly_destroy=True)

    # ---- Every case, with cumulative statistics ----
    stats = torch.zeros(num_local, dtype=torch.int32, device=device)
    ref_stats = [np.zeros(num_local, dtype=np.int32) for _ in range(num_ranks)]
    for i, case in enumerate(CASES):
        world = World(num_ranks, num_experts, 100 + i, case, stats=ref_stats)
        one_round(buffer, world, rank, num_experts, case, device, stats=stats)
    np.testing.assert_array_equal(stats.cpu().numpy(), ref_stats[rank])
    for i, case in enumerate(PRE_REDUCED_CASES):
        pre_reduced_round(buffer.runtime, World(num_ranks, num_experts, 200 + i, case), rank, num_experts, case,
                          device)
    with pytest.raises(epx.EpxError, match="pre_reduce"):
        x, topk_idx, weights, expert_out = World(num_ranks, num_experts, 5, Case()).inputs(rank, device)
        plain = buffer.runtime.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts, use_fp8=False)
        buffer.runtime.low_latency_combine(expert_out, topk_idx, weights, plain.handle, pre_reduce=True)

    # ---- Wait-cost statistics and a caller-provided output ----
    case = Case()
    world = World(num_ranks, num_experts, 7, case)
    x, topk_idx, weights, expert_out = world.inputs(rank, device)
    wait_cost = torch.zeros(num_ranks, dtype=torch.int64, device=device)
    recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts,
                                                                   dispatch_wait_recv_cost_stats=wait_cost,
                                                                   use_fp8=False)
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=device)
    combine_cost = torch.zeros(num_ranks, dtype=torch.int64, device=device)
    combined, _, _ = buffer.low_latency_combine(expert_out, topk_idx, weights, handle, out=out,
                                                combine_wait_recv_cost_stats=combine_cost)
    assert combined.data_ptr() == out.data_ptr()
    torch.cuda.synchronize()
    assert bool((wait_cost >= 0).all()) and bool((combine_cost >= 0).all())

    # ---- Two results pending at once; a third call is refused until a hook runs ----
    worlds = [World(num_ranks, num_experts, 40 + j, case) for j in range(2)]
    pending = []
    for w in worlds:
        x, topk_idx, _, _ = w.inputs(rank, device)
        pending.append(buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts, use_fp8=False,
                                                   return_recv_hook=True))
    with pytest.raises(epx.EpxError, match="at most two low-latency results may be pending"):
        buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts, use_fp8=False)
    for w, (recv_x, recv_count, handle, _, hook) in zip(worlds, pending):
        hook()
    for w, (recv_x, recv_count, handle, _, hook) in zip(worlds, pending):
        check_received(buffer, w.received[rank], recv_x, recv_count, case)
    with pytest.raises(epx.EpxError, match="runs once"):
        pending[0][4]()
    # The next call sends into the first call's half again: a rank that ran ahead would overwrite what a slower
    # peer has not received yet (its hook still queued), so every rank's hooks run before anyone's next call, as
    # with DeepEP's hooks (ranks sharing a GPU once read a later call's count there).
    torch.cuda.synchronize()
    torch.distributed.barrier(group)

    # ---- Argument errors (before any launch) ----
    with pytest.raises(epx.EpxError, match="num_tokens"):
        too_many = torch.zeros(MAX_TOKENS + 1, HIDDEN, dtype=torch.bfloat16, device=device)
        buffer.low_latency_dispatch(too_many, torch.zeros(MAX_TOKENS + 1, NUM_TOPK, dtype=torch.int64, device=device),
                                    MAX_TOKENS, num_experts)
    with pytest.raises(epx.EpxError, match="use_ue8m0"):
        buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts, use_ue8m0=True)
    with pytest.raises(epx.EpxError, match="num_rdma_bytes"):
        buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS * 64, num_experts)
    one_round(buffer, World(num_ranks, num_experts, 9, case), rank, num_experts, case, device)

    # ---- Clean, then CUDA-graph capture of dispatch + combine, replayed with fresh inputs ----
    buffer.clean_low_latency_buffer(MAX_TOKENS, HIDDEN, num_experts)
    world = World(num_ranks, num_experts, 1000, case)
    x, topk_idx, weights, expert_out = world.inputs(rank, device)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="relaxed"):
        recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts,
                                                                       use_fp8=False)
        combined, _, _ = buffer.low_latency_combine(expert_out, topk_idx, weights, handle)
    for iteration in range(3):
        world = World(num_ranks, num_experts, 1000 + iteration, case)
        new_x, new_idx, new_weights, new_out = world.inputs(rank, device)
        x.copy_(new_x)
        topk_idx.copy_(new_idx)
        weights.copy_(new_weights)
        expert_out.copy_(new_out)  # the reference knows which rows the replayed dispatch will deliver
        graph.replay()
        torch.cuda.synchronize()
        check_received(buffer, world.received[rank], recv_x, recv_count, case)
        np.testing.assert_array_equal(ref.bf16_bits(combined), world.combined[rank])
    del graph
    torch.cuda.synchronize()
    buffer.destroy()


def assert_torch_extension_loaded():
    """Where epx._epx_torch was built (beside epx._epx), it loaded: the calls below take its path."""
    import glob
    import os

    import epx._ext

    built = glob.glob(os.path.join(os.path.dirname(epx._ext._epx.__file__), "_epx_torch*.so"))
    assert not built or epx._ext.torch_calls is not None or os.environ.get("EPX_TORCH_EXT") == "0", (
        epx._ext.torch_calls_error)


@pytest.mark.parametrize("num_ranks", gpu_counts(2, 4))
def test_low_latency_against_reference(num_ranks):
    run(low_latency_worker, num_ranks)


@pytest.mark.parametrize("num_ranks", gpu_counts(2))
def test_low_latency_python_path_against_reference(num_ranks):
    run(low_latency_worker, num_ranks, True)


def virtual_nodes_worker(rank, num_ranks, group):
    """The DeepEP-compatible calls, unchanged, on a group split into nodes of one GPU: every peer is reached
    through NVSHMEM, in a process where torch is loaded too."""
    import os

    import torch

    import epx.compat.deep_ep as deep_ep

    os.environ["EPX_RANKS_PER_NODE"] = "1"
    device = torch.device("cuda", torch.cuda.current_device())
    num_experts = 4 * num_ranks
    num_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, HIDDEN, num_ranks, num_experts)
    buffer = deep_ep.Buffer(group, num_rdma_bytes=num_bytes, low_latency_mode=True,
                            num_qps_per_rank=num_experts // num_ranks, explicitly_destroy=True)
    assert buffer.runtime.runtime.spans_nodes
    for i, case in enumerate(CASES):
        one_round(buffer, World(num_ranks, num_experts, 300 + i, case, ranks_per_node=1), rank, num_experts, case,
                  device)
    for i, case in enumerate(PRE_REDUCED_CASES):
        pre_reduced_round(buffer.runtime, World(num_ranks, num_experts, 400 + i, case, ranks_per_node=1), rank,
                          num_experts, case, device)
    buffer.destroy()


@pytest.mark.parametrize("num_ranks", gpu_counts(2, 4))
def test_low_latency_virtual_nodes(num_ranks):
    import epx

    if not epx.WITH_NVSHMEM:
        pytest.skip("epx was built without the NVSHMEM transport")
    run(virtual_nodes_worker, num_ranks)
