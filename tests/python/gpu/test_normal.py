"""Normal mode through epx.compat.deep_ep (DeepEP V1's calls) against the CPU reference, on 2 and 4 GPUs:
layout, BF16 and FP8 dispatch, combine with weights and biases, the cached handle, calls from two streams,
async with events and comm-stream allocation, worst-case rows, argument errors, configs (queue sizes), a
32,768-token batch through a buffer sized as Megatron-LM sizes it, and outputs from the output window (epx.Buffer
and deep_ep).
Data movement is compared bit-exactly (the values are small integers, so the combine's sums are exact in any
order)."""

import os
import warnings

import numpy as np
import pytest

from dist_util import gpu_counts, run

HIDDEN = 256
NUM_TOPK = 4


def make_inputs(num_ranks, num_experts, seed, fp8=False):
    import epx_tools.reference as ref

    native = ref.native
    num_tokens = [37, 64, 0, 5][:num_ranks] if num_ranks <= 4 else [17 + 3 * r for r in range(num_ranks)]
    ids = native.make_unbalanced_routing(seed, num_tokens, NUM_TOPK, num_experts, num_ranks)
    inputs = []
    for r in range(num_ranks):
        item = ref.NormalRankInput(
            topk_idx=ids[r].reshape(num_tokens[r], NUM_TOPK),
            topk_weights=native.random_topk_weights(seed * 31 + r, num_tokens[r], NUM_TOPK).reshape(-1, NUM_TOPK))
        if fp8:
            x, scales = native.random_fp8_tokens(seed * 17 + r, num_tokens[r], HIDDEN, r)
            item.x_fp8, item.x_scales = x.reshape(-1, HIDDEN), scales.reshape(-1, HIDDEN // 128)
        else:
            item.x = native.random_bf16_tokens(seed * 17 + r, num_tokens[r], HIDDEN, r).reshape(-1, HIDDEN)
        inputs.append(item)
    return inputs


def random_rows(seed, rows, rank):
    import epx_tools.reference as ref

    return ref.native.random_bf16_tokens(seed, rows, HIDDEN, rank, stamp=False).reshape(rows, HIDDEN)


def to_device(rank_input, device):
    import torch

    import epx_tools.reference as ref

    x = (ref.to_torch_fp8(rank_input.x_fp8, device), torch.from_numpy(rank_input.x_scales).to(device)) \
        if rank_input.x_fp8 is not None else ref.to_torch_bf16(rank_input.x, device)
    return (x, torch.from_numpy(rank_input.topk_idx).to(device), torch.from_numpy(rank_input.topk_weights).to(device))


def check_dispatch(expected, recv_x, recv_idx, recv_w, counts, rows=None):
    import epx_tools.reference as ref

    rows = expected.num_rows if rows is None else rows
    if isinstance(recv_x, tuple):
        np.testing.assert_array_equal(ref.fp8_bytes(recv_x[0])[:rows], expected.recv_x_fp8[:rows])
        np.testing.assert_array_equal(recv_x[1].cpu().numpy()[:rows], expected.recv_x_scales[:rows])
    else:
        np.testing.assert_array_equal(ref.bf16_bits(recv_x)[:rows], expected.recv_x[:rows])
    if recv_idx is not None:
        np.testing.assert_array_equal(recv_idx.cpu().numpy(), expected.recv_topk_idx)
        np.testing.assert_array_equal(recv_w.cpu().numpy(), expected.recv_topk_weights)
    if counts is not None:
        assert counts == expected.num_recv_tokens_per_expert_list


def normal_worker(rank, num_ranks, group, seed, python_path=False):
    """python_path: epx.Buffer's Python path for every call instead of the torch extension's (the same results)."""
    import torch

    import epx
    import epx.buffer
    import epx.compat.deep_ep as deep_ep
    import epx_tools.reference as ref

    if python_path:
        epx.buffer.torch_calls = None
    device = torch.device("cuda", torch.cuda.current_device())
    num_experts = 8 * num_ranks
    buffer = deep_ep.Buffer(group, num_nvl_bytes=deep_ep.Config().get_nvl_buffer_size_hint(HIDDEN * 2, num_ranks),
                            explicitly_destroy=True)
    assert (buffer.rank, buffer.group_size) == (rank, num_ranks)

    inputs = make_inputs(num_ranks, num_experts, seed)
    x, topk_idx, topk_weights = to_device(inputs[rank], device)

    # ---- Layout ----
    per_rank, per_rdma, per_expert, in_rank, event = buffer.get_dispatch_layout(topk_idx, num_experts)
    exp_rank, exp_expert, exp_in_rank = ref.dispatch_layout(inputs[rank].topk_idx, num_experts, num_ranks)
    assert per_rdma is None and event.event is None
    np.testing.assert_array_equal(per_rank.cpu().numpy(), exp_rank)
    np.testing.assert_array_equal(per_expert.cpu().numpy(), exp_expert)
    np.testing.assert_array_equal(in_rank.cpu().numpy(), exp_in_rank)
    # The torch extension's layout (where it loaded) makes its outputs in one block; the Python path in four.
    one_block = per_rank.untyped_storage().data_ptr() == in_rank.untyped_storage().data_ptr()
    assert one_block == (epx.buffer.torch_calls is not None)

    # ---- BF16 dispatch with top-k ----
    outputs, ref_handle = ref.normal_dispatch(inputs, num_ranks=num_ranks, num_experts=num_experts, hidden=HIDDEN,
                                              expert_alignment=4)
    recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=topk_idx, topk_weights=topk_weights, expert_alignment=4)
    check_dispatch(outputs[rank], recv_x, recv_idx, recv_w, counts)
    assert recv_idx.dtype == torch.int64 and recv_w.dtype == torch.float32

    # ---- Combine: unweighted sum of the copies, weights reduced, two biases ----
    expert_out = [random_rows(seed * 7 + d, outputs[d].num_rows, d) for d in range(num_ranks)]
    bias0 = [random_rows(seed * 11 + r, len(inputs[r].topk_idx), r) for r in range(num_ranks)]
    bias1 = [random_rows(seed * 13 + r, len(inputs[r].topk_idx), r) for r in range(num_ranks)]
    expected = ref.normal_combine(ref_handle, expert_out, topk_weights=[o.recv_topk_weights for o in outputs],
                                  bias0=bias0, bias1=bias1)[rank]
    combined, combined_w, event = buffer.combine(ref.to_torch_bf16(expert_out[rank], device), handle,
                                                 topk_weights=recv_w,
                                                 bias=(ref.to_torch_bf16(bias0[rank], device),
                                                       ref.to_torch_bf16(bias1[rank], device)))
    np.testing.assert_array_equal(ref.bf16_bits(combined), expected[0])
    np.testing.assert_array_equal(combined_w.cpu().numpy(), expected[1])
    # Without weights or bias, the same handle again.
    plain = ref.normal_combine(ref_handle, expert_out)[rank]
    combined, combined_w, _ = buffer.combine(ref.to_torch_bf16(expert_out[rank], device), handle)
    assert combined_w is None
    np.testing.assert_array_equal(ref.bf16_bits(combined), plain[0])

    # ---- Cached handle: new tokens, same routing, no top-k outputs ----
    fresh = make_inputs(num_ranks, num_experts, seed)
    for r, item in enumerate(fresh):
        item.x = random_rows(seed * 19 + r, len(item.topk_idx), r)
    cached_outputs, _ = ref.normal_dispatch(fresh, num_ranks=num_ranks, num_experts=num_experts, hidden=HIDDEN)
    result = buffer.dispatch(ref.to_torch_bf16(fresh[rank].x, device), handle=handle)
    assert len(result) == 6 and result[1:5] == (None, None, None, None)
    check_dispatch(cached_outputs[rank], result[0], None, None, None)

    # ---- Calls from two streams: a combine queued behind a long kernel on the current stream, then a cached
    # dispatch from another stream that waits for neither: one Buffer's calls run in the order they were made
    # whatever streams they come from (the dispatch uses the same queues), however the runtime orders them ----
    # Then the same with the dispatch ordered by an event of the other stream (the comm stream waits for that alone).
    expert_rows = ref.to_torch_bf16(expert_out[rank], device)
    fresh_x = ref.to_torch_bf16(fresh[rank].x, device)
    side = torch.cuda.Stream()
    for by_event in (False, True):
        buffer.dispatch(fresh_x, handle=handle)  # the last call before the pair came from the current stream
        inputs_ready = torch.cuda.Event()
        inputs_ready.record()
        torch.cuda._sleep(50_000_000)
        combined, _, _ = buffer.combine(expert_rows, handle)
        side.wait_event(inputs_ready)
        with torch.cuda.stream(side):
            if by_event:
                result = buffer.dispatch(fresh_x, handle=handle, previous_event=buffer.capture(), async_finish=True)
                result[5].current_stream_wait()
            else:
                result = buffer.dispatch(fresh_x, handle=handle)
        torch.cuda.synchronize()
        np.testing.assert_array_equal(ref.bf16_bits(combined), plain[0])
        check_dispatch(cached_outputs[rank], result[0], None, None, None)

    # ---- Async: previous_event, async_finish, outputs allocated on the comm stream ----
    layout = buffer.get_dispatch_layout(topk_idx, num_experts, previous_event=buffer.capture(), async_finish=True,
                                        allocate_on_comm_stream=True)
    layout[4].current_stream_wait()
    np.testing.assert_array_equal(layout[3].cpu().numpy(), exp_in_rank)
    recv_x, recv_idx, recv_w, counts, handle2, event = buffer.dispatch(
        x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
        topk_idx=topk_idx, topk_weights=topk_weights, expert_alignment=4, previous_event=buffer.capture(),
        async_finish=True, allocate_on_comm_stream=True)
    assert event.event is not None
    with event:
        pass  # overlapped work would go here
    check_dispatch(outputs[rank], recv_x, recv_idx, recv_w, counts)
    combined, _, event = buffer.combine(ref.to_torch_bf16(expert_out[rank], device), handle2, async_finish=True,
                                        previous_event=buffer.capture())
    event.current_stream_wait()
    np.testing.assert_array_equal(ref.bf16_bits(combined), plain[0])

    # ---- Worst-case rows: no CPU sync, padded outputs ----
    worst = sum(len(item.topk_idx) for item in inputs)
    worst_outputs, worst_handle = ref.normal_dispatch(inputs, num_ranks=num_ranks, num_experts=num_experts,
                                                      hidden=HIDDEN, num_worst_tokens=worst)
    recv_x, recv_idx, recv_w, counts, handle3, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=topk_idx, topk_weights=topk_weights, num_worst_tokens=worst)
    assert recv_x.shape == (worst, HIDDEN) and counts == []
    check_dispatch(worst_outputs[rank], recv_x, recv_idx, recv_w, counts, rows=worst_outputs[rank].num_recv_tokens)
    padded = [np.zeros((worst, HIDDEN), dtype=np.uint16) for _ in range(num_ranks)]
    for d in range(num_ranks):
        real = worst_outputs[d].num_recv_tokens
        padded[d][:real] = random_rows(seed * 23 + d, real, d)
    expected = ref.normal_combine(worst_handle, padded)[rank]
    combined, _, _ = buffer.combine(ref.to_torch_bf16(padded[rank], device), handle3)
    np.testing.assert_array_equal(ref.bf16_bits(combined), expected[0])

    # ---- FP8 dispatch ----
    fp8_inputs = make_inputs(num_ranks, num_experts, seed + 1, fp8=True)
    fp8_outputs, _ = ref.normal_dispatch(fp8_inputs, num_ranks=num_ranks, num_experts=num_experts, hidden=HIDDEN,
                                         fp8=True)
    fx, fidx, fw = to_device(fp8_inputs[rank], device)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(fidx, num_experts)
    recv_x, recv_idx, recv_w, counts, _, _ = buffer.dispatch(
        fx, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=fidx, topk_weights=fw)
    assert isinstance(recv_x, tuple) and recv_x[0].dtype == torch.float8_e4m3fn
    check_dispatch(fp8_outputs[rank], recv_x, recv_idx, recv_w, counts)

    # ---- Argument errors raise EpxError with the rule, and the buffer keeps working ----
    with pytest.raises(epx.EpxError, match="x.shape"):  # other dtypes move as raw rows of 16-byte multiples
        buffer.dispatch(x.float()[:, :3].contiguous(), topk_idx=topk_idx, topk_weights=topk_weights)
    with pytest.raises(epx.EpxError, match="x.shape"):
        buffer.combine(torch.zeros(outputs[rank].num_rows + 1, HIDDEN, dtype=torch.bfloat16, device=device), handle)
    with pytest.raises(epx.EpxError, match="low-latency"):  # no low-latency buffer: the C++ check
        buffer.low_latency_dispatch(x[:1], topk_idx[:1], 8, num_experts)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_idx, recv_w, counts, _, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=topk_idx, topk_weights=topk_weights, expert_alignment=4)
    check_dispatch(outputs[rank], recv_x, recv_idx, recv_w, counts)

    torch.cuda.synchronize()
    buffer.destroy()
    with pytest.raises(epx.EpxError, match="after destroy"):
        buffer.get_comm_stream()


@pytest.mark.parametrize("num_ranks", gpu_counts(2, 4))
def test_normal_mode_against_reference(num_ranks):
    run(normal_worker, num_ranks, 1)


@pytest.mark.parametrize("num_ranks", gpu_counts(2))
def test_normal_mode_python_path_against_reference(num_ranks):
    run(normal_worker, num_ranks, 2, True)


def native_api_worker(rank, num_ranks, group):
    """epx.Buffer's own interface: layout computed inside dispatch, named results, handle views."""
    import torch

    import epx
    import epx_tools.reference as ref

    device = torch.device("cuda", torch.cuda.current_device())
    num_experts = 4 * num_ranks
    buffer = epx.Buffer(group, num_nvl_bytes=epx.normal_nvl_buffer_size_hint(HIDDEN * 2, num_ranks))
    inputs = make_inputs(num_ranks, num_experts, 5)
    x, topk_idx, topk_weights = to_device(inputs[rank], device)
    outputs, _ = ref.normal_dispatch(inputs, num_ranks=num_ranks, num_experts=num_experts, hidden=HIDDEN)
    result = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts)
    assert isinstance(result, epx.DispatchResult) and result.recv_x_scales is None
    check_dispatch(outputs[rank], result.recv_x, result.recv_topk_idx, result.recv_topk_weights,
                   result.num_recv_tokens_per_expert_list)
    handle = result.handle
    assert handle.num_recv_rows == outputs[rank].num_rows and handle.num_tokens == len(inputs[rank].topk_idx)
    assert handle.num_recv_per_rank == list(outputs[rank].num_recv_tokens_per_rank)
    np.testing.assert_array_equal(handle.recv_src_idx.cpu().numpy(), outputs[rank].recv_src_token_idx)
    combined = buffer.combine(result.recv_x, handle)
    assert isinstance(combined, epx.CombineResult) and combined.combined_topk_weights is None
    copies = torch.from_numpy(ref.dispatch_layout(inputs[rank].topk_idx, num_experts, num_ranks)[2].sum(1))
    expected = x.float().cpu() * copies.float().unsqueeze(1)
    assert torch.equal(combined.combined_x.float().cpu(), expected)
    # A one-channel config with short queues and one-record chunks still works (slower); it stays the Buffer's.
    tiny = epx.Config(num_sms=2, num_max_nvl_chunked_send_tokens=1, num_max_nvl_chunked_recv_tokens=4)
    result = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts,
                             config=tiny)
    assert buffer.num_sms == 2 and buffer.config == tiny
    check_dispatch(outputs[rank], result.recv_x, result.recv_topk_idx, result.recv_topk_weights, None)
    combined = buffer.combine(result.recv_x, result.handle)
    assert torch.equal(combined.combined_x.float().cpu(), expected)
    # A config whose queues do not fit the buffer is refused, naming the bytes it needs.
    huge = epx.Config(num_max_nvl_chunked_recv_tokens=1 << 16)
    with pytest.raises(epx.EpxError, match="invalid num_nvl_bytes = .*: must be >= .* for this call"):
        buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts, config=huge)
    buffer.config = epx.Config()
    result = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts)
    check_dispatch(outputs[rank], result.recv_x, result.recv_topk_idx, result.recv_topk_weights, None)
    # The raw NVLink buffer as a tensor (keeps the Buffer alive).
    view = buffer.local_buffer_tensor(torch.int32, (16,))
    assert view.shape == (16,) and view.device == device
    buffer.destroy()


@pytest.mark.parametrize("num_ranks", gpu_counts(2))
def test_native_api(num_ranks):
    run(native_api_worker, num_ranks)


def window_worker(rank, num_ranks, group):
    """epx.Buffer with an output window: with the torch extension the dispatch outputs come from it (the
    sources store rows straight into them) and go back to it when freed, a cached re-dispatch too; odd ranks'
    windows are too small for any output, so they receive through their queues while the others take rows
    into their windows. Every result as the reference's."""
    import torch

    import epx
    import epx_tools.reference as ref
    from epx._ext import torch_calls

    device = torch.device("cuda", torch.cuda.current_device())
    num_experts = 4 * num_ranks
    hint = epx.normal_nvl_buffer_size_hint(HIDDEN * 2, num_ranks)
    room = 64 << 20
    window = room if rank % 2 == 0 else 4096  # every rank's NVLink buffer has the same size
    buffer = epx.Buffer(group, num_nvl_bytes=hint + room, num_nvl_output_bytes=window)
    base, size = buffer.runtime.nvl_output_window, buffer.runtime.num_nvl_output_bytes
    in_window = rank % 2 == 0 and torch_calls is not None
    # Under expandable segments some torch releases refuse pools with their own allocator: then the outputs
    # come from torch's allocator (with a warning) and only the results are checked.
    either = "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    inputs = make_inputs(num_ranks, num_experts, 9)
    x, topk_idx, topk_weights = to_device(inputs[rank], device)
    outputs, _ = ref.normal_dispatch(inputs, num_ranks=num_ranks, num_experts=num_experts, hidden=HIDDEN)
    copies = torch.from_numpy(ref.dispatch_layout(inputs[rank].topk_idx, num_experts, num_ranks)[2].sum(1))
    expected = x.float().cpu() * copies.float().unsqueeze(1)
    seen = set()
    for _ in range(3):
        layout = buffer.get_dispatch_layout(topk_idx, num_experts)
        result = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights,
                                 num_tokens_per_rank=layout.num_tokens_per_rank,
                                 is_token_in_rank=layout.is_token_in_rank,
                                 num_tokens_per_expert=layout.num_tokens_per_expert)
        check_dispatch(outputs[rank], result.recv_x, result.recv_topk_idx, result.recv_topk_weights,
                       result.num_recv_tokens_per_expert_list)
        np.testing.assert_array_equal(result.handle.recv_src_idx.cpu().numpy(), outputs[rank].recv_src_token_idx)
        rows = outputs[rank].num_rows
        if rows > 0 and not either:
            assert (base <= result.recv_x.data_ptr() < base + size) == in_window
            seen.add(result.recv_x.data_ptr())
        combined = buffer.combine(result.recv_x, result.handle)
        assert torch.equal(combined.combined_x.float().cpu(), expected)
        again = buffer.dispatch(x, handle=result.handle)
        assert torch.equal(again.recv_x.view(torch.int16), result.recv_x.view(torch.int16))
        del result, again, combined
        torch.cuda.synchronize()
    # Outputs freed went back to the window's pool: the next dispatch took the same memory.
    assert len(seen) <= 1 or not in_window, seen
    # A window output still alive at destroy() is named (it would point at freed memory).
    kept = buffer.dispatch(x, handle=buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights,
                                                     num_tokens_per_rank=layout.num_tokens_per_rank,
                                                     is_token_in_rank=layout.is_token_in_rank,
                                                     num_tokens_per_expert=layout.num_tokens_per_expert).handle)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        buffer.destroy()
    named = [w for w in caught if "output window" in str(w.message)]
    if not either:
        assert len(named) == (1 if in_window and outputs[rank].num_rows > 0 else 0), [str(w.message) for w in caught]
    del kept

    # deep_ep.Buffer: EPX_NVL_OUTPUT_BYTES adds the window on every rank.
    import deep_ep

    os.environ["EPX_NVL_OUTPUT_BYTES"] = str(room)
    try:
        compat = deep_ep.Buffer(group, hint, explicitly_destroy=True)
    finally:
        del os.environ["EPX_NVL_OUTPUT_BYTES"]
    native = compat.runtime.runtime
    base, size = native.nvl_output_window, native.num_nvl_output_bytes
    assert size >= room
    per_rank, _, per_expert, in_rank, _ = compat.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_idx, recv_weights, per_expert_list, handle, _ = compat.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=topk_idx, topk_weights=topk_weights)
    check_dispatch(outputs[rank], recv_x, recv_idx, recv_weights, per_expert_list)
    if outputs[rank].num_rows > 0 and not either:
        assert (base <= recv_x.data_ptr() < base + size) == (torch_calls is not None)
    combined, _, _ = compat.combine(recv_x, handle)
    assert torch.equal(combined.float().cpu(), expected)
    del recv_x, recv_idx, recv_weights, handle, combined
    compat.destroy()


@pytest.mark.parametrize("num_ranks", gpu_counts(2, 4))
def test_outputs_in_the_window(num_ranks):
    run(window_worker, num_ranks)


@pytest.mark.parametrize("num_ranks", gpu_counts(2))
def test_outputs_in_the_window_under_expandable_segments(num_ranks, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as Megatron-LM recommends
    run(window_worker, num_ranks)


# ---- A large batch through a buffer sized as Megatron-LM sizes it ----

BIG_TOKENS = 32768
BIG_HIDDEN = 7168
BIG_TOPK = 8
BIG_EXPERTS = 64


def big_batch_worker(rank, num_ranks, group, seed):
    """32,768 tokens per rank (hidden 7168, random top-8 of 64 experts) through epx.compat.deep_ep, with the
    NVLink buffer sized as Megatron-LM's fused_a2a.get_buffer does: the largest hint of DeepEP's dispatch and
    combine configs, a small fraction of the batch (tokens stream through the queues)."""
    import torch

    import epx.compat.deep_ep as deep_ep
    import epx_tools.reference as ref

    native = ref.native
    device = torch.device("cuda", torch.cuda.current_device())
    inputs = []
    for r in range(num_ranks):
        ids = native.random_topk_idx(seed * 100 + r, BIG_TOKENS, BIG_TOPK, BIG_EXPERTS)
        inputs.append(ref.NormalRankInput(
            x=native.random_bf16_tokens(seed * 17 + r, BIG_TOKENS, BIG_HIDDEN, r).reshape(BIG_TOKENS, BIG_HIDDEN),
            topk_idx=ids.reshape(BIG_TOKENS, BIG_TOPK),
            topk_weights=native.random_topk_weights(seed * 31 + r, BIG_TOKENS, BIG_TOPK).reshape(-1, BIG_TOPK)))
    x, topk_idx, topk_weights = to_device(inputs[rank], device)

    # Megatron-LM: get_hidden_bytes(x) = hidden * max(x.element_size(), 2), then the max over both configs.
    hidden_bytes = x.size(1) * max(x.element_size(), 2)
    num_nvl_bytes = 0
    for config in (deep_ep.Buffer.get_dispatch_config(num_ranks), deep_ep.Buffer.get_combine_config(num_ranks)):
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks), num_nvl_bytes)
    assert num_nvl_bytes * 4 < BIG_TOKENS * hidden_bytes  # far less than one rank's batch
    buffer = deep_ep.Buffer(group, num_nvl_bytes=num_nvl_bytes, explicitly_destroy=True)

    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, BIG_EXPERTS)
    exp_rank, exp_expert, exp_in_rank = ref.dispatch_layout(inputs[rank].topk_idx, BIG_EXPERTS, num_ranks)
    np.testing.assert_array_equal(per_rank.cpu().numpy(), exp_rank)
    np.testing.assert_array_equal(per_expert.cpu().numpy(), exp_expert)
    np.testing.assert_array_equal(in_rank.cpu().numpy(), exp_in_rank)

    outputs, ref_handle = ref.normal_dispatch(inputs, num_ranks=num_ranks, num_experts=BIG_EXPERTS,
                                              hidden=BIG_HIDDEN)
    expected = outputs[rank]
    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=topk_idx, topk_weights=topk_weights)
    check_dispatch(expected, recv_x, recv_idx, recv_w, counts)
    del x

    # Combine with weights: every row of every rank's expert output differs.
    expert_out = [native.random_bf16_tokens(seed * 7 + d, outputs[d].num_rows, BIG_HIDDEN, d, stamp=False)
                  .reshape(outputs[d].num_rows, BIG_HIDDEN) for d in range(num_ranks)]
    combined_expected = ref.normal_combine(ref_handle, expert_out, topk_weights=[o.recv_topk_weights for o in outputs]
                                           )[rank]
    mine = ref.to_torch_bf16(expert_out[rank], device)
    del expert_out
    combined, combined_w, _ = buffer.combine(mine, handle, topk_weights=recv_w)
    np.testing.assert_array_equal(ref.bf16_bits(combined), combined_expected[0])
    np.testing.assert_array_equal(combined_w.cpu().numpy(), combined_expected[1])

    # Again with the cached handle: the queues carry on from where the first calls left them.
    cached_x = buffer.dispatch(ref.to_torch_bf16(inputs[rank].x, device), handle=handle)[0]
    np.testing.assert_array_equal(ref.bf16_bits(cached_x), expected.recv_x)
    combined, _, _ = buffer.combine(mine, handle, topk_weights=recv_w)
    np.testing.assert_array_equal(ref.bf16_bits(combined), combined_expected[0])

    torch.cuda.synchronize()
    buffer.destroy()


@pytest.mark.parametrize("num_ranks", gpu_counts(2))
def test_large_batch_with_megatron_sizing(num_ranks):
    run(big_batch_worker, num_ranks, 3)
