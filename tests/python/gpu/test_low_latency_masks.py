"""Rank masks in low-latency mode through the drop-in deep_ep.Buffer on 2 and 4 GPUs (or ranks sharing a GPU,
EPX_TEST_RANKS_PER_GPU): DeepEP's low_latency_update_mask_buffer / _query_ / _clean_ with a masked rank sitting
calls out (the others match the reference with it masked, bit-exactly), and enable_shrink masking a rank that
skips a call (the others finish without it within the wait bound + 1 s)."""

import os
import time

import pytest

from dist_util import gpu_counts, run
from test_low_latency import HIDDEN, MAX_TOKENS, Case, World, one_round

WAIT_TIMEOUT_S = 1.0


def masks_worker(rank, num_ranks, group):
    # EPX_WAIT_TIMEOUT_S overrides the Buffer's bound (the GPU scripts set it): the shrink test's bound.
    os.environ["EPX_WAIT_TIMEOUT_S"] = str(WAIT_TIMEOUT_S)
    import torch
    import torch.distributed as dist

    import epx.compat.deep_ep as deep_ep

    device = torch.device("cuda", torch.cuda.current_device())
    num_experts = 4 * num_ranks
    num_local = num_experts // num_ranks
    num_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, HIDDEN, num_ranks, num_experts)
    buffer = deep_ep.Buffer(group, num_rdma_bytes=num_bytes, low_latency_mode=True, num_qps_per_rank=num_local,
                            explicitly_destroy=True, enable_shrink=True)
    assert buffer.runtime.enable_shrink
    victim = num_ranks - 1
    case = Case(use_fp8=True)
    status = torch.full((num_ranks,), 7, dtype=torch.int32, device=device)

    def query():
        buffer.low_latency_query_mask_buffer(status)
        return status.cpu().tolist()

    def rejoin():
        dist.barrier(group)
        buffer.low_latency_clean_mask_buffer()
        buffer.clean_low_latency_buffer(MAX_TOKENS, HIDDEN, num_experts)
        assert query() == [0] * num_ranks

    assert query() == [0] * num_ranks
    one_round(buffer, World(num_ranks, num_experts, 1, case), rank, num_experts, case, device)

    # ---- Masked by the API: the others mask the last rank, which sits the call out ----
    if rank != victim:
        buffer.low_latency_update_mask_buffer(victim, True)
        assert query() == [0] * victim + [1]
        world = World(num_ranks, num_experts, 2, case, masked_ranks=[victim])
        one_round(buffer, world, rank, num_experts, case, device)
    rejoin()
    one_round(buffer, World(num_ranks, num_experts, 3, case), rank, num_experts, case, device)

    # ---- enable_shrink: the last rank skips a call; the others' timed-out wait masks it ----
    torch.cuda.synchronize()
    dist.barrier(group)
    if rank != victim:
        world = World(num_ranks, num_experts, 4, case, masked_ranks=[victim])
        start = time.monotonic()
        one_round(buffer, world, rank, num_experts, case, device)
        torch.cuda.synchronize()
        assert time.monotonic() - start < WAIT_TIMEOUT_S + 1.0
        assert buffer.runtime.low_latency_masked_ranks() == ([victim], [victim])
        assert query() == [0] * victim + [1]
        # The next call leaves it out at once.
        one_round(buffer, World(num_ranks, num_experts, 5, case, masked_ranks=[victim]), rank, num_experts, case,
                  device)
    buffer.runtime.check()  # nothing was aborted, on any rank
    rejoin()
    one_round(buffer, World(num_ranks, num_experts, 6, case), rank, num_experts, case, device)
    torch.cuda.synchronize()
    dist.barrier(group)
    buffer.destroy()


@pytest.mark.parametrize("num_ranks", gpu_counts(2, 4))
def test_low_latency_rank_masks_and_shrink(num_ranks):
    run(masks_worker, num_ranks)
