"""deep_ep as DeepEP's own tests and callers use it, on 2 and 4 GPUs (or ranks sharing one GPU): handles read as
tuples (rank_prefix_matrix's column, recv_src_idx, is_token_in_rank; low latency: src_info and the packed
layout_range), handles passed back rebuilt, combine with another hidden than the dispatch's, FP8 scales as
callers produce them (column-major, per token, UE8M0-packed int32) and int32 top-k ids. Tokens are stamped with
(source rank, token index), so a misplaced row names itself; all checks are bit-exact."""

import gc
import weakref

import pytest

from dist_util import gpu_counts, run

HIDDEN = 256
NUM_TOPK = 4
NUM_TOKENS = 48


def stamped_tokens(torch, rank, num_tokens, hidden, device):
    x = torch.full((num_tokens, hidden), float(rank), dtype=torch.bfloat16, device=device)
    x[:, 1] = torch.arange(num_tokens, dtype=torch.bfloat16, device=device)  # exact below 256
    return x


def routing(torch, rank, num_tokens, num_experts, device):
    generator = torch.Generator().manual_seed(1234 + rank)
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    ids = scores.topk(NUM_TOPK, dim=1).indices
    ids[::7, -1] = -1  # some unused slots
    weights = torch.rand(num_tokens, NUM_TOPK, generator=generator)
    return ids.to(device), weights.to(device)


def normal_worker(rank, num_ranks, group):
    import torch
    import torch.distributed as dist

    import deep_ep

    device = torch.device("cuda", torch.cuda.current_device())
    num_experts = 8 * num_ranks
    hint = max(deep_ep.Buffer.get_dispatch_config(num_ranks).get_nvl_buffer_size_hint(2 * 2 * HIDDEN, num_ranks),
               deep_ep.Buffer.get_combine_config(num_ranks).get_nvl_buffer_size_hint(2 * 2 * HIDDEN, num_ranks))
    buffer = deep_ep.Buffer(group, hint, explicitly_destroy=True)
    x = stamped_tokens(torch, rank, NUM_TOKENS, HIDDEN, device)
    ids, weights = routing(torch, rank, NUM_TOKENS, num_experts, device)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, num_experts)
    recv_x, recv_ids, recv_w, counts, handle, _ = buffer.dispatch(x, None, per_rank, None, in_rank, per_expert,
                                                                  ids.int(), weights)
    # ---- The handle as DeepEP's test_intranode.py reads it ----
    assert isinstance(handle, tuple) and len(handle) == 6
    rank_prefix, channel_prefix, recv_channel_prefix, recv_src_idx, handle_in_rank, send_head = handle
    assert rank_prefix.shape == (num_ranks, num_ranks) and rank_prefix.dtype == torch.int32
    all_per_rank = [None] * num_ranks
    dist.all_gather_object(all_per_rank, per_rank.cpu().tolist(), group=group)
    start = 0
    for src in range(num_ranks):
        end = rank_prefix[src][rank].item()
        assert end - start == all_per_rank[src][rank], (src, start, end)
        block = recv_x[start:end]
        assert bool((block[:, 0] == src).all()), f"rows [{start}, {end}) must come from rank {src}"
        assert torch.equal(block[:, 1].int(), recv_src_idx[start:end]), "recv_src_idx must name each row's token"
        start = end
    assert start == recv_x.size(0)
    assert torch.equal(handle_in_rank, in_rank)
    assert bool(((send_head >= 0) == in_rank).all())
    num_channels = deep_ep.Buffer.num_sms // 2
    assert channel_prefix.shape == recv_channel_prefix.shape == (num_ranks, num_channels)
    assert bool((recv_channel_prefix[:, 0] == 0).all())

    # ---- Combine: the tuple, rebuilt, and with other hidden sizes ----
    combined, combined_w, _ = buffer.combine(recv_x, handle, topk_weights=recv_w)
    again, _, _ = buffer.combine(recv_x, tuple(list(handle)), topk_weights=recv_w)
    assert torch.equal(again, combined)
    narrow, _, _ = buffer.combine(recv_x[:, :HIDDEN // 2].contiguous(), handle)
    assert torch.equal(narrow, buffer.combine(recv_x, handle)[0][:, :HIDDEN // 2])
    wide, _, _ = buffer.combine(torch.cat([recv_x, recv_x], dim=1), handle)
    assert torch.equal(wide, torch.cat([combined, combined], dim=1))
    with pytest.raises(Exception, match="hidden = 100: must be a multiple of 8"):
        buffer.combine(torch.zeros(recv_x.size(0), 100, dtype=torch.bfloat16, device=device)[:, :100], handle)

    # ---- The tuple frees its handle without the garbage collector (no reference cycle through its first) ----
    gc.disable()
    try:
        *_, dropped, _ = buffer.dispatch(x, None, per_rank, None, in_rank, per_expert, ids, weights)
        assert torch.equal(dropped[0], rank_prefix)
        epx_handle = weakref.ref(dropped[0]._epx_handle)
        del dropped
        assert epx_handle() is None, "the handle tuple must free its EPX handle by reference counting"
    finally:
        gc.enable()

    # ---- Async: the handle's matrices are ordered by the returned event ----
    _, _, _, _, async_handle, event = buffer.dispatch(x, None, per_rank, None, in_rank, per_expert, ids, weights,
                                                      async_finish=True)
    event.current_stream_wait()
    assert torch.equal(async_handle[0], rank_prefix) and torch.equal(async_handle[2], recv_channel_prefix)

    # ---- FP8 scales as callers produce them ----
    fp8 = x.float().to(torch.float8_e4m3fn)
    token = torch.arange(NUM_TOKENS, device=device, dtype=torch.float32)[:, None]
    layouts = {
        "column-major": (rank * 1000 + token * 10 + torch.arange(HIDDEN // 128, device=device)).t().contiguous().t(),
        "per-token": rank * 1000 + token,
        "ue8m0-packed": (rank * 1000 + token.int() + 0x7F7F0000)[:, :1].expand(NUM_TOKENS, (HIDDEN + 511) // 512),
    }
    for name, scales in layouts.items():
        (recv_fp8, recv_scales), *_ = buffer.dispatch((fp8, scales), None, per_rank, None, in_rank, per_expert, ids,
                                                      weights)
        assert torch.equal(recv_fp8.view(torch.uint8), recv_x.float().to(torch.float8_e4m3fn).view(torch.uint8))
        assert recv_scales.dtype == scales.dtype and recv_scales.shape == (recv_x.size(0), scales.size(1)), name
        # Each row's scales are its source token's: rank * 1000 + token (* 10 + column).
        base = recv_x[:, 0].int()[:, None] * 1000 + recv_x[:, 1].int()[:, None]
        if name == "column-major":
            want = (recv_x[:, 0].int()[:, None] * 1000 + recv_x[:, 1].int()[:, None] * 10 +
                    torch.arange(HIDDEN // 128, device=device)).float()
        elif name == "per-token":
            want = base.float()
        else:
            want = (base + 0x7F7F0000).int().expand_as(recv_scales)
        assert torch.equal(recv_scales, want), name
    buffer.destroy()


@pytest.mark.parametrize("num_ranks", gpu_counts(2, 4))
def test_normal_mode_as_deep_ep_callers_use_it(num_ranks):
    run(normal_worker, num_ranks)


def low_latency_worker(rank, num_ranks, group):
    import torch
    import torch.distributed as dist

    import deep_ep

    device = torch.device("cuda", torch.cuda.current_device())
    num_experts, max_tokens = 4 * num_ranks, 64
    num_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(max_tokens, HIDDEN, num_ranks, num_experts)
    # vLLM, SGLang and LMDeploy pass an NVLink size too.
    buffer = deep_ep.Buffer(group, num_nvl_bytes=1 << 20, num_rdma_bytes=num_bytes, low_latency_mode=True,
                            num_qps_per_rank=num_experts // num_ranks, explicitly_destroy=True)
    x = stamped_tokens(torch, rank, NUM_TOKENS, HIDDEN, device)
    ids, weights = routing(torch, rank, NUM_TOKENS, num_experts, device)
    all_ids = [None] * num_ranks
    dist.all_gather_object(all_ids, ids.cpu(), group=group)
    recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(x, ids.int(), max_tokens, num_experts,
                                                                   use_fp8=False)
    # ---- The handle as DeepEP's test_low_latency.py reads it ----
    assert isinstance(handle, tuple) and len(handle) == 5 and handle[2:] == (max_tokens, HIDDEN, num_experts)
    src_info, layout_range = handle[0], handle[1]
    assert src_info.dtype == torch.int32 and layout_range.dtype == torch.int64
    num_local = num_experts // num_ranks
    assert layout_range.shape == (num_local, num_ranks)
    mask = (1 << 32) - 1
    for le in range(num_local):
        expert = rank * num_local + le
        for src in range(num_ranks):
            begin, count = (layout_range[le][src] >> 32).item(), (layout_range[le][src] & mask).item()
            assert count == int((all_ids[src] == expert).any(dim=1).sum()), (le, src)
            rows = recv_x[le, begin:begin + count]
            assert bool((rows[:, 0] == src).all()), f"expert {expert}: rows from rank {src}"
            assert torch.equal(rows[:, 1].int(), src_info[le, begin:begin + count])
        assert recv_count[le].item() == sum((layout_range[le] & mask).tolist())
    combined, _, _ = buffer.low_latency_combine(recv_x, ids, weights, handle)
    again, _, _ = buffer.low_latency_combine(recv_x, ids, weights, tuple(list(handle)))
    assert torch.equal(again, combined)
    # zero_copy with the caller's x (DeepEP ignores its data): the rows come from the combine buffer.
    recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, ids, max_tokens, num_experts, use_fp8=False)
    buffer.get_next_low_latency_combine_buffer(handle).copy_(recv_x)
    zero_copied, _, _ = buffer.low_latency_combine(torch.zeros_like(recv_x), ids, weights, handle, zero_copy=True)
    assert torch.equal(zero_copied, combined)
    buffer.destroy()


@pytest.mark.parametrize("num_ranks", gpu_counts(2, 4))
def test_low_latency_as_deep_ep_callers_use_it(num_ranks):
    run(low_latency_worker, num_ranks)
