"""torch.ops.epx.low_latency_dispatch / low_latency_combine (epx.ops) on 2 and 4 GPUs: called eagerly and inside
torch.compile (fullgraph, aot_eager and inductor), bit-exact against the CPU reference and against each other;
the fake implementations' shapes, strides and dtypes equal the real outputs'."""

import numpy as np
import pytest

from dist_util import gpu_counts, run
from test_low_latency import MAX_TOKENS, Case, World, check_received, waits_succeeded


def custom_ops_worker(rank, num_ranks, group):
    import os

    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    import epx.compat.deep_ep as deep_ep
    import epx.ops
    import epx_tools.reference as ref

    # A rank compiles (inductor: seconds) before its first op call while its peer may already wait in one.
    os.environ["EPX_WAIT_TIMEOUT_S"] = "90"
    device = torch.device("cuda", torch.cuda.current_device())
    num_experts = 4 * num_ranks
    num_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, 512, num_ranks, num_experts)
    buffer = deep_ep.Buffer(group, num_rdma_bytes=num_bytes, low_latency_mode=True, num_qps_per_rank=4,
                            explicitly_destroy=True)
    key = epx.ops.register(buffer)
    dispatch, combine = torch.ops.epx.low_latency_dispatch, torch.ops.epx.low_latency_combine

    def step(x, topk_idx, weights, expert_out, use_fp8):
        recv_x, recv_scales, recv_count, src_info, layout_range = dispatch(key, x, topk_idx, MAX_TOKENS,
                                                                           num_experts, None, use_fp8)
        combined = combine(key, expert_out, topk_idx, weights, src_info, layout_range, MAX_TOKENS, num_experts)
        return recv_x, recv_scales, recv_count, combined

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=False)
    for i, use_fp8 in enumerate((False, True)):
        case = Case(use_fp8=use_fp8)
        world = World(num_ranks, num_experts, 400 + i, case)
        x, topk_idx, weights, expert_out = world.inputs(rank, device)
        for run_step in (step, compiled):
            recv_x, recv_scales, recv_count, combined = run_step(x, topk_idx, weights, expert_out, use_fp8)
            check_received(buffer.runtime, world.received[rank], (recv_x, recv_scales) if use_fp8 else recv_x,
                           recv_count, case)
            np.testing.assert_array_equal(ref.bf16_bits(combined), world.combined[rank])
            assert recv_scales.numel() > 0 if use_fp8 else recv_scales.numel() == 0
        # The fake implementation describes the real outputs.
        real = dispatch(key, x, topk_idx, MAX_TOKENS, num_experts, None, use_fp8)
        with FakeTensorMode() as mode:
            fake = dispatch(key, mode.from_tensor(x), mode.from_tensor(topk_idx), MAX_TOKENS, num_experts, None,
                            use_fp8)
        for got, want in zip(fake, real):
            assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
        combine(key, expert_out, topk_idx, weights, real[3], real[4], MAX_TOKENS, num_experts)

    # Inductor: the expert step (rows x 2, exact in BF16) compiled between the two ops; as the eager call.
    def with_expert(x, topk_idx, weights, stats):
        recv_x, _, recv_count, src_info, layout_range = dispatch(key, x, topk_idx, MAX_TOKENS, num_experts, stats,
                                                                 False)
        return combine(key, recv_x * 2, topk_idx, weights, src_info, layout_range, MAX_TOKENS, num_experts), recv_count

    world = World(num_ranks, num_experts, 402, Case())
    x, topk_idx, weights, _ = world.inputs(rank, device)
    # The op writes the statistics in place (its one mutated argument): both calls add to them.
    stats = torch.zeros(num_experts // num_ranks, dtype=torch.int32, device=device)
    eager, recv_count = with_expert(x, topk_idx, weights, stats)
    dist.barrier(group)
    inductor, _ = torch.compile(with_expert, fullgraph=True, dynamic=False)(x, topk_idx, weights, stats)
    waits_succeeded(buffer.runtime)
    assert torch.equal(eager, inductor)
    assert torch.equal(stats, 2 * recv_count)
    epx.ops.unregister(key)
    with pytest.raises(Exception, match="not a registered Buffer"):
        dispatch(key, x, topk_idx, MAX_TOKENS, num_experts, None, False)
    buffer.destroy()


@pytest.mark.parametrize("num_ranks", gpu_counts(2, 4))
def test_low_latency_custom_ops(num_ranks):
    run(custom_ops_worker, num_ranks)
