"""A rank that stops calling, through deep_ep.Buffer (the drop-in) and epx.Buffer, with a 1 s wait bound: the
other ranks get EpxError naming the missing peer and the phase, torch's CUDA context survives, and after a
collective reset() the same Buffer runs a low-latency round checked against the reference.
Runs on one GPU with EPX_TEST_RANKS_PER_GPU=2 (a Gloo group)."""

import time

import pytest

from dist_util import gpu_counts, run
from test_low_latency import HIDDEN, MAX_TOKENS, Case, World, one_round

WAIT_TIMEOUT_S = 1.0


def victim_learns_and_all_reset(buffer, rank, victim, device):
    """After the others saw their errors: the rank that skipped the call learns of the abort from check(),
    torch's CUDA context survived on every rank, and a collective reset() recovers the Buffer."""
    import torch
    import torch.distributed as dist

    import epx

    dist.barrier()
    if rank == victim:
        with pytest.raises(epx.EpxError, match="the group was aborted"):
            buffer.check()
    assert (torch.ones(1, device=device) + 1).item() == 2
    buffer.reset()


def skipped_dispatch_worker(rank, num_ranks, group):
    import os

    import torch

    import epx
    import epx.compat.deep_ep as deep_ep

    os.environ["EPX_WAIT_TIMEOUT_S"] = str(WAIT_TIMEOUT_S)  # read when the Buffer is built
    device = torch.device("cuda", torch.cuda.current_device())
    num_experts = 4 * num_ranks
    num_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, HIDDEN, num_ranks, num_experts)
    buffer = deep_ep.Buffer(group, num_rdma_bytes=num_bytes, low_latency_mode=True,
                            num_qps_per_rank=num_experts // num_ranks, explicitly_destroy=True)
    case = Case()
    one_round(buffer, World(num_ranks, num_experts, 5, case), rank, num_experts, case, device)
    torch.cuda.synchronize()

    # ---- The last rank stops calling; the others dispatch alone ----
    victim = num_ranks - 1
    x, topk_idx, _, _ = World(num_ranks, num_experts, 6, case).inputs(rank, device)
    if rank != victim:
        start = time.monotonic()
        buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts, use_fp8=False)
        torch.cuda.synchronize()  # the kernel gave up and returned: no CUDA error
        with pytest.raises(epx.EpxError, match=f"peer {victim} in low-latency dispatch receive") as raised:
            buffer.check()
        assert time.monotonic() - start < WAIT_TIMEOUT_S + 1.0
        # Every call is refused with the same message until reset().
        with pytest.raises(epx.EpxError) as again:
            buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts, use_fp8=False)
        assert again.value.message == raised.value.message
        assert buffer.runtime.is_aborted
    victim_learns_and_all_reset(buffer, rank, victim, device)
    assert not buffer.runtime.is_aborted
    buffer.check()
    one_round(buffer, World(num_ranks, num_experts, 7, case), rank, num_experts, case, device)
    torch.cuda.synchronize()
    buffer.destroy()


@pytest.mark.parametrize("num_ranks", gpu_counts(2))
def test_skipped_low_latency_dispatch_is_reported_and_recovered(num_ranks):
    run(skipped_dispatch_worker, num_ranks)


def skipped_notify_worker(rank, num_ranks, group):
    """Normal mode through epx.Buffer: the last rank skips a dispatch; the others' dispatch raises (its host
    wait for the counts reads the record); after reset() a dispatch + combine round trip runs."""
    import os

    import torch

    import epx

    os.environ["EPX_WAIT_TIMEOUT_S"] = str(WAIT_TIMEOUT_S)  # it overrides wait_timeout_s (the GPU scripts set it)
    device = torch.device("cuda", torch.cuda.current_device())
    hidden, num_experts, num_tokens = 256, 4 * num_ranks, 32
    config = epx.Config()
    buffer = epx.Buffer(group, num_nvl_bytes=config.get_nvl_buffer_size_hint(hidden * 2, num_ranks),
                        wait_timeout_s=WAIT_TIMEOUT_S)
    topk_idx = (torch.arange(num_tokens, device=device).unsqueeze(1) + torch.arange(2, device=device)) % num_experts
    weights = torch.full((num_tokens, 2), 0.5, dtype=torch.float32, device=device)
    x = torch.ones(num_tokens, hidden, dtype=torch.bfloat16, device=device)

    def round_trip():
        result = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_experts=num_experts)
        combined = buffer.combine(result.recv_x, result.handle).combined_x
        torch.cuda.synchronize()
        # Every token went to two experts: the combine adds the copies of the ranks that held one.
        copies = torch.zeros(num_tokens, dtype=torch.float32, device=device)
        owners = topk_idx // (num_experts // num_ranks)
        for r in range(num_ranks):
            copies += (owners == r).any(dim=1).float()
        assert torch.equal(combined.float(), copies.unsqueeze(1).expand(-1, hidden))

    round_trip()
    victim = num_ranks - 1
    if rank != victim:
        start = time.monotonic()
        with pytest.raises(epx.EpxError, match=f"peer {victim} in dispatch notify"):
            buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_experts=num_experts)
        assert time.monotonic() - start < WAIT_TIMEOUT_S + 1.0
    victim_learns_and_all_reset(buffer, rank, victim, device)
    round_trip()
    buffer.destroy()


@pytest.mark.parametrize("num_ranks", gpu_counts(2))
def test_skipped_normal_dispatch_is_reported_and_recovered(num_ranks):
    run(skipped_notify_worker, num_ranks)


def collected_buffer_worker(rank, num_ranks, group):
    """A Buffer collected without destroy() (a finalizer) frees this rank's memory without meeting the peers:
    the last rank's collection returns at once while the others wait in a barrier it has not joined; then
    every rank builds a new Buffer and runs a round trip on it."""
    import gc

    import torch
    import torch.distributed as dist

    import epx

    device = torch.device("cuda", torch.cuda.current_device())
    hidden, num_experts, num_tokens = 256, 4 * num_ranks, 32
    num_nvl_bytes = epx.Config().get_nvl_buffer_size_hint(hidden * 2, num_ranks)
    topk_idx = (torch.arange(num_tokens, device=device).unsqueeze(1) + torch.arange(2, device=device)) % num_experts
    topk_weights = torch.ones(num_tokens, 2, dtype=torch.float32, device=device)
    x = torch.ones(num_tokens, hidden, dtype=torch.bfloat16, device=device)
    # Combine sums one row per destination rank: a token comes back as x times its number of distinct ranks.
    ranks = topk_idx // (num_experts // num_ranks)
    expected = x * (1 + (ranks[:, 0] != ranks[:, 1]).to(torch.bfloat16)).unsqueeze(1)

    def round_trip(buffer):
        result = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts)
        combined = buffer.combine(result.recv_x, result.handle).combined_x
        torch.cuda.synchronize()
        assert torch.equal(combined, expected)
        del result, combined

    buffer = epx.Buffer(group, num_nvl_bytes=num_nvl_bytes, wait_timeout_s=WAIT_TIMEOUT_S)
    round_trip(buffer)
    if rank == num_ranks - 1:
        start = time.monotonic()
        del buffer
        gc.collect()
        assert time.monotonic() - start < WAIT_TIMEOUT_S
    dist.barrier()
    if rank != num_ranks - 1:
        del buffer
        gc.collect()
    assert (torch.ones(1, device=device) + 1).item() == 2
    again = epx.Buffer(group, num_nvl_bytes=num_nvl_bytes, wait_timeout_s=WAIT_TIMEOUT_S)
    round_trip(again)
    again.destroy()


@pytest.mark.parametrize("num_ranks", gpu_counts(2))
def test_collected_buffer_meets_no_peer(num_ranks):
    run(collected_buffer_worker, num_ranks)
