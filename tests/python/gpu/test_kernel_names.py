"""Kernel names profilers look for, read from torch.profiler's CUDA kernel events on rank 0: each low-latency
call launches kernels named in a C++ namespace ending in ::dispatch or ::combine (as DeepEP's
deep_ep::internode_ll::dispatch / ::combine), one per call, and with a receive hook both the send and the
receive launch carry the name. No other EPX kernel runs in those calls."""

import re

import pytest

from dist_util import gpu_counts, run

HIDDEN = 1024
NUM_TOPK = 4
MAX_TOKENS = 32
DISPATCH = re.compile(r"::dispatch\b")
COMBINE = re.compile(r"::combine\b")


def low_latency_calls(buffer, x, topk_idx, topk_weights, num_experts):
    """Dispatch and combine with receive hooks, then without: 3 dispatch and 3 combine launches."""
    recv_x, _, handle, _, hook = buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts, use_fp8=False,
                                                             return_recv_hook=True)
    hook()
    _, _, hook = buffer.low_latency_combine(recv_x, topk_idx, topk_weights, handle, return_recv_hook=True)
    hook()
    recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts, use_fp8=True)
    expert_out = recv_x[0].float().to(x.dtype)
    buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle)


def kernel_names_worker(rank, num_ranks, group):
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    import deep_ep

    device = torch.device("cuda", torch.cuda.current_device())
    num_experts = 4 * num_ranks
    num_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, HIDDEN, num_ranks, num_experts)
    buffer = deep_ep.Buffer(group, num_rdma_bytes=num_bytes, low_latency_mode=True, explicitly_destroy=True)
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(MAX_TOKENS, HIDDEN, generator=generator).to(torch.bfloat16).to(device)
    topk_idx = torch.rand(MAX_TOKENS, num_experts, generator=generator).topk(NUM_TOPK, dim=1).indices.to(device)
    topk_weights = torch.rand(MAX_TOKENS, NUM_TOPK, generator=generator).to(device)
    low_latency_calls(buffer, x, topk_idx, topk_weights, num_experts)  # warm-up (module loading, allocations)
    torch.cuda.synchronize()
    if rank != 0:
        low_latency_calls(buffer, x, topk_idx, topk_weights, num_experts)
        torch.cuda.synchronize()
    else:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            low_latency_calls(buffer, x, topk_idx, topk_weights, num_experts)
            torch.cuda.synchronize()
        kernels = [event.name for event in prof.events() if event.device_type == DeviceType.CUDA]
        dispatch = [name for name in kernels if DISPATCH.search(name)]
        combine = [name for name in kernels if COMBINE.search(name)]
        epx = [name for name in kernels if "epx::" in name]
        assert len(dispatch) == 3 and len(combine) == 3, kernels
        assert all("epx::kernels::" in name for name in dispatch + combine), dispatch + combine
        assert sorted(epx) == sorted(dispatch + combine), kernels
    buffer.destroy()


@pytest.mark.parametrize("num_ranks", gpu_counts(2))
def test_low_latency_kernel_names(num_ranks):
    pytest.importorskip("torch")
    run(kernel_names_worker, num_ranks)
