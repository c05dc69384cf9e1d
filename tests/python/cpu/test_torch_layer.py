"""The torch layer end to end on the CPU, one rank, with the CUDA binding replaced by the reference
(fake_runtime.py): output shapes, dtypes and strides, named results and DeepEP tuples, cached handles, events,
receive hooks, statistics and the autograd functions. Skipped without torch."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import epx  # noqa: E402
import epx.compat.deep_ep as deep_ep  # noqa: E402
import epx_tools.reference as ref  # noqa: E402
import epx.training as training  # noqa: E402
from fake_runtime import deep_ep_wrapper, sample_tokens, install  # noqa: E402

HIDDEN = 256
NUM_EXPERTS = 4
NUM_TOPK = 2


@pytest.fixture
def fake(monkeypatch):
    return install(monkeypatch)


@pytest.fixture
def compat(fake):
    buffer, binding = fake
    wrapper = deep_ep_wrapper(buffer)
    return wrapper, binding


def tokens(num_tokens=6, seed=0):
    return sample_tokens(HIDDEN, NUM_TOPK, num_tokens, seed)


def test_native_dispatch_and_combine(fake):
    buffer, binding = fake
    x, ids, weights = tokens()
    layout = buffer.get_dispatch_layout(ids, NUM_EXPERTS)
    assert isinstance(layout, epx.DispatchLayout) and layout.num_tokens_per_rdma_rank is None
    assert layout.num_tokens_per_rank.tolist() == [5] and layout.is_token_in_rank.dtype == torch.bool
    assert layout.num_tokens_per_expert.tolist() == [2, 2, 2, 2]

    result = buffer.dispatch(x, topk_idx=ids, topk_weights=weights, num_experts=NUM_EXPERTS, expert_alignment=4)
    assert isinstance(result, epx.DispatchResult)
    assert result.recv_x.shape == (5, HIDDEN) and result.recv_x.dtype == torch.bfloat16
    kept = [0, 1, 3, 4, 5]  # token 2 chose no expert
    assert torch.equal(result.recv_x, x[kept])
    assert result.recv_topk_idx.dtype == torch.int64 and torch.equal(result.recv_topk_idx, ids[kept])
    assert torch.equal(result.recv_topk_weights, torch.where(ids[kept] >= 0, weights[kept], 0))
    assert result.num_recv_tokens_per_expert_list == [4, 4, 4, 4]
    assert result.recv_x_scales is None and result.event.event is None
    handle = result.handle
    assert (handle.num_tokens, handle.num_recv_rows, handle.num_experts, handle.num_topk) == (6, 5, 4, 2)
    assert handle.num_recv_per_rank == [5]

    bias = ref.to_torch_bf16(ref.native.random_bf16_tokens(9, 6, HIDDEN, 0, stamp=False).reshape(6, HIDDEN))
    combined = buffer.combine(result.recv_x, handle, topk_weights=result.recv_topk_weights, bias=bias)
    assert isinstance(combined, epx.CombineResult)
    sent = (ids >= 0).any(dim=1, keepdim=True)
    assert torch.equal(combined.combined_x, (x.float() * sent + bias.float()).to(torch.bfloat16))
    assert torch.equal(combined.combined_topk_weights, torch.where(ids >= 0, weights, 0))

    # Cached: same routing, new tokens, no top-k outputs, the same handle back.
    x2 = x * 2
    cached = buffer.dispatch(x2, handle=handle)
    assert torch.equal(cached.recv_x, x2[kept]) and cached.recv_topk_idx is None and cached.handle is handle


def test_launch_receive_goes_with_the_count_exchange_and_is_cancelled_on_failure(fake, monkeypatch):
    buffer, binding = fake
    x, ids, weights = tokens()
    first = buffer.dispatch(x, topk_idx=ids, topk_weights=weights, num_experts=NUM_EXPERTS, launch_receive=False)
    # The launched receive writes into outputs sized from the last dispatch's rows (5) plus a margin.
    second = buffer.dispatch(x, topk_idx=ids, topk_weights=weights, num_experts=NUM_EXPERTS)
    assert second.recv_x.shape == first.recv_x.shape and torch.equal(second.recv_x, first.recv_x)
    assert torch.equal(second.recv_topk_idx, first.recv_topk_idx)
    # after_counts queues work that must precede the receive and reads the handle: then dispatch_receive
    # launches the receive, and the handle's arrays are written before dispatch_notify returns.
    buffer.dispatch(x, topk_idx=ids, topk_weights=weights, num_experts=NUM_EXPERTS, launch_receive=True,
                    after_counts=lambda h: [])
    overlap = binding.DispatchOverlap
    assert binding.overlaps == [overlap.NONE, overlap.LAUNCH_RECEIVE, overlap.HANDLE_BEFORE_RECEIVE]
    assert binding.guesses[0] is None and binding.guesses[1].rows == 5 + 64 and binding.guesses[2] is None

    # Outputs that cannot be allocated: the launched receive is cancelled (it drains) and the error surfaces.
    def no_memory(*args, **kwargs):
        raise MemoryError("no memory for recv_x")

    real_notify = binding.dispatch_notify

    def notify_then_run_out_of_memory(*args):
        plan = real_notify(*args)
        monkeypatch.setattr(buffer, "_fast_empty", no_memory)  # the Buffer's allocator (Buffer._empty)
        monkeypatch.setattr(torch, "empty_strided", no_memory)  # and its fallback
        return plan

    monkeypatch.setattr(binding, "dispatch_notify", notify_then_run_out_of_memory)
    buffer._last_recv_rows = None  # no guess: the outputs are allocated after the counts
    with pytest.raises(MemoryError):
        buffer.dispatch(x, topk_idx=ids, topk_weights=weights, num_experts=NUM_EXPERTS, launch_receive=True)
    assert binding.cancelled == 1


def test_layout_counts_tokens_per_node_when_the_group_spans_nodes(compat):
    wrapper, _ = compat
    buffer = wrapper.runtime
    buffer.num_ranks, buffer.runtime.ranks_per_node = 4, 2  # 2 nodes of 2 ranks (experts 0..3 on ranks 0..3)
    ids = torch.tensor([[0, 3], [1, -1], [-1, -1], [2, 1]])
    layout = buffer.get_dispatch_layout(ids, NUM_EXPERTS)
    per_node = layout.num_tokens_per_rdma_rank
    assert per_node.dtype == torch.int32 and per_node.tolist() == [3, 2]  # a token counts once per node
    assert layout.num_tokens_per_rank.tolist() == [1, 2, 1, 1] and layout.is_token_in_rank.shape == (4, 4)
    per_rank, per_rdma, _, in_rank, _ = wrapper.get_dispatch_layout(ids, NUM_EXPERTS)  # DeepEP's tuple
    assert per_rdma.tolist() == [3, 2] and per_rank.tolist() == [1, 2, 1, 1]


def test_dispatch_argument_checks(fake):
    buffer, _ = fake
    x, ids, weights = tokens()
    with pytest.raises(epx.EpxError, match="topk_weights = None: are required with topk_idx"):
        buffer.dispatch(x, topk_idx=ids, num_experts=NUM_EXPERTS)
    with pytest.raises(epx.EpxError, match="num_experts = None"):
        buffer.dispatch(x, topk_idx=ids, topk_weights=weights)
    with pytest.raises(epx.EpxError, match=r"topk_idx.shape = \(5, 2\): must have size 6 in dimension 0"):
        buffer.dispatch(x, topk_idx=ids[:5], topk_weights=weights[:5], num_experts=NUM_EXPERTS)
    with pytest.raises(epx.EpxError, match="topk_idx.dtype = torch.float32: must be torch.int64 or torch.int32"):
        buffer.get_dispatch_layout(ids.float(), NUM_EXPERTS)
    with pytest.raises(epx.EpxError, match="must be contiguous"):
        buffer.dispatch(torch.zeros(HIDDEN, 6, dtype=torch.bfloat16).t(), topk_idx=ids, topk_weights=weights,
                        num_experts=NUM_EXPERTS)
    with pytest.raises(epx.EpxError, match=r"x\[1\].shape = \(5, 3\): must have size 6 in dimension 0"):
        buffer.dispatch((x.to(torch.float8_e4m3fn), torch.ones(5, 3)), topk_idx=ids, topk_weights=weights,
                        num_experts=NUM_EXPERTS)
    result = buffer.dispatch(x, topk_idx=ids, topk_weights=weights, num_experts=NUM_EXPERTS)
    with pytest.raises(epx.EpxError, match="must be None with a cached handle"):
        buffer.dispatch(x, handle=result.handle, topk_idx=ids, topk_weights=weights)
    with pytest.raises(epx.EpxError, match=r"x.shape = \(3, 256\)"):
        buffer.combine(result.recv_x[:3], result.handle)
    other = object.__new__(epx.Buffer)
    with pytest.raises(epx.EpxError, match="from another Buffer"):
        other.combine(result.recv_x, result.handle)
    with pytest.raises(epx.EpxError, match="allocate_on_comm_stream"):
        buffer.get_dispatch_layout(ids, NUM_EXPERTS, async_finish=True, allocate_on_comm_stream=True)


def test_deep_ep_tuples(compat):
    wrapper, binding = compat
    x, ids, weights = tokens()
    layout = wrapper.get_dispatch_layout(ids, NUM_EXPERTS)
    assert len(layout) == 5 and layout[1] is None and isinstance(layout[4], epx.EventOverlap)
    per_rank, _, per_expert, in_rank, _ = layout
    out = wrapper.dispatch(x, None, per_rank, None, in_rank, per_expert, ids, weights, 2)
    assert len(out) == 6
    recv_x, recv_idx, recv_w, counts, handle, event = out
    assert counts == [2, 2, 2, 2] and event.event is None
    assert wrapper.runtime.num_sms == deep_ep.Buffer.num_sms  # the default config's SM count
    cached = wrapper.dispatch(x, handle)
    assert len(cached) == 6 and cached[1:5] == (None, None, None, None) and torch.equal(cached[0], recv_x)
    combined, combined_w, event = wrapper.combine(recv_x, handle, topk_weights=recv_w)
    assert combined.shape == (6, HIDDEN) and combined_w.shape == (6, NUM_TOPK)
    combined, combined_w, _ = wrapper.combine(recv_x, handle)
    assert combined_w is None

    # FP8 in, FP8 tuple out.
    fp8 = (x.float().to(torch.float8_e4m3fn), torch.ones(6, HIDDEN // 128))
    recv_x, *_ = wrapper.dispatch(fp8, None, per_rank, None, in_rank, per_expert, ids, weights)
    assert isinstance(recv_x, tuple) and recv_x[0].dtype == torch.float8_e4m3fn and recv_x[1].shape == (5, 2)
    cached = wrapper.dispatch(fp8, handle)
    assert isinstance(cached[0], tuple)

    # Async: an event comes back and can be waited on.
    _, _, _, _, _, event = wrapper.dispatch(x, None, per_rank, None, in_rank, per_expert, ids, weights,
                                            async_finish=True)
    assert event.event is not None
    with event:
        pass
    assert event.event.waits == 1
    assert binding.orders[-1].async_finish is True

    wrapper.destroy()
    with pytest.raises(epx.EpxError, match="after destroy"):
        wrapper.combine(recv_x, handle)


def test_config_sets_the_whole_runtime_config(fake):
    buffer, _ = fake
    x, ids, weights = tokens()
    assert buffer.config == epx.Config()  # the runtime's initial config
    config = epx.Config(num_sms=8, num_max_nvl_chunked_send_tokens=4, num_max_nvl_chunked_recv_tokens=128)
    result = buffer.dispatch(x, topk_idx=ids, topk_weights=weights, num_experts=NUM_EXPERTS, config=config)
    assert buffer.runtime.num_sms == 8 and buffer.num_sms == 8
    assert buffer.runtime.config == config.to_native() and buffer.config == config
    # Without a config a call keeps the current one.
    buffer.combine(result.recv_x, result.handle)
    assert buffer.config == config
    combine_config = epx.Config(num_sms=4, num_max_nvl_chunked_send_tokens=2, num_max_nvl_chunked_recv_tokens=64)
    buffer.combine(result.recv_x, result.handle, config=combine_config)
    assert buffer.config == combine_config
    # num_sms changes the SM budget alone; assigning a Config sets all of it.
    buffer.num_sms = 12
    assert buffer.config == epx.Config(12, 2, 64)
    buffer.config = epx.Config(16, 8, 32)
    assert buffer.runtime.config == epx.Config(16, 8, 32).to_native()
    with pytest.raises(epx.EpxError, match="invalid num_max_nvl_chunked_send_tokens = 64"):
        bad = epx.Config(16, 8, 32).to_native()
        bad.num_max_nvl_chunked_send_tokens = 64
        buffer.config = bad
    with pytest.raises(epx.EpxError, match="invalid config = NoneType"):
        buffer.config = None
    assert buffer.config == epx.Config(16, 8, 32)


class _TorchCalls:
    """A stand-in for the torch extension epx._epx_torch: every call returns `made` or raises it."""

    def __init__(self, made):
        self.made, self.calls = made, 0

    def __getattr__(self, name):
        def call(*args):
            self.calls += 1
            if isinstance(self.made, BaseException):
                raise self.made
            return self.made

        return call


@pytest.mark.parametrize("made", [None, TypeError("incompatible function arguments")], ids=["none", "type-error"])
def test_calls_the_extension_declines_take_the_python_path(fake, monkeypatch, made):
    """The torch extension returns None (not the plain case) or its argument conversion raises TypeError: the call
    runs the Python path, with the call's config applied once (none left half set)."""
    import epx.buffer as buffer_module

    buffer, _ = fake
    x, ids, weights = tokens()
    result = buffer.dispatch(x, topk_idx=ids, topk_weights=weights, num_experts=NUM_EXPERTS)
    declining = _TorchCalls(made)
    monkeypatch.setattr(buffer_module, "torch_calls", declining)
    config = epx.Config(num_sms=8, num_max_nvl_chunked_send_tokens=4, num_max_nvl_chunked_recv_tokens=128)
    combined = buffer.combine(result.recv_x, result.handle, config=config)
    cached = buffer.dispatch(x, handle=result.handle, config=config)
    assert declining.calls == 2
    assert buffer.config == config
    monkeypatch.setattr(buffer_module, "torch_calls", None)
    assert torch.equal(combined.combined_x, buffer.combine(result.recv_x, result.handle).combined_x)
    assert torch.equal(cached.recv_x, buffer.dispatch(x, handle=result.handle).recv_x)


def test_an_extension_error_restores_the_config(fake, monkeypatch):
    """An error the torch extension raises (the runtime's EpxError) leaves the Buffer's config as it was."""
    import epx.buffer as buffer_module

    buffer, _ = fake
    x, ids, weights = tokens()
    result = buffer.dispatch(x, topk_idx=ids, topk_weights=weights, num_experts=NUM_EXPERTS)
    before = buffer.config
    monkeypatch.setattr(buffer_module, "torch_calls", _TorchCalls(epx.EpxError("invalid x = 1: a test")))
    with pytest.raises(epx.EpxError, match="a test"):
        buffer.combine(result.recv_x, result.handle, config=epx.Config(num_sms=8))
    assert buffer.config == before


def test_deep_ep_calls_use_the_default_configs(compat):
    wrapper, _ = compat
    x, ids, weights = tokens()
    per_rank, _, per_expert, in_rank, _ = wrapper.get_dispatch_layout(ids, NUM_EXPERTS)
    # One rank: DeepEP lists no config (it asserts); EPX uses Config's defaults with Buffer.num_sms.
    recv_x, _, recv_w, _, handle, _ = wrapper.dispatch(x, None, per_rank, None, in_rank, per_expert, ids, weights)
    assert wrapper.runtime.config == deep_ep.Config(deep_ep.Buffer.num_sms)
    wrapper.combine(recv_x, handle, topk_weights=recv_w)
    assert wrapper.runtime.config == deep_ep.Config(deep_ep.Buffer.num_sms)
    # A group size DeepEP lists: its recommended configs (the fake runtime serves any group size).
    wrapper.group_size = 2
    wrapper.dispatch(x, handle)
    assert wrapper.runtime.config == deep_ep.Buffer.get_dispatch_config(2)
    wrapper.combine(recv_x, handle, topk_weights=recv_w)
    assert wrapper.runtime.config == deep_ep.Buffer.get_combine_config(2)
    config = deep_ep.Config(8, 4, 64, 6, 128)
    wrapper.dispatch(x, handle, config=config)
    assert wrapper.runtime.config == config
    # A caller's config changed in place is read again (only the default configs are kept per Buffer).
    config.num_max_nvl_chunked_send_tokens = 8
    wrapper.combine(recv_x, handle, topk_weights=recv_w, config=config)
    assert wrapper.runtime.config == deep_ep.Config(8, 8, 64, 6, 128)
    wrapper.combine(recv_x, handle, topk_weights=recv_w)
    assert wrapper.runtime.config == deep_ep.Buffer.get_combine_config(2)


def test_deep_ep_default_configs_follow_the_gpu_kind(compat, monkeypatch):
    """Without a config, a call on an H200 takes the chunks EPX measured there (at 2 ranks they follow num_sms);
    get_*_config, DeepEP's static table, does not depend on the GPU."""
    wrapper, _ = compat
    x, ids, weights = tokens()
    per_rank, _, per_expert, in_rank, _ = wrapper.get_dispatch_layout(ids, NUM_EXPERTS)
    recv_x, _, recv_w, _, handle, _ = wrapper.dispatch(x, None, per_rank, None, in_rank, per_expert, ids, weights)
    monkeypatch.setattr(wrapper.runtime.runtime, "gpu_kind", "H200", raising=False)
    monkeypatch.setattr(deep_ep.Buffer, "num_sms", 32)
    wrapper.group_size = 2
    wrapper.combine(recv_x, handle, topk_weights=recv_w)
    assert wrapper.runtime.config == deep_ep.Config(32, 8, 256, 6, 128)
    assert deep_ep.Buffer.get_combine_config(2) == deep_ep.Config(32, 16, 256, 6, 128)
    wrapper.dispatch(x, handle)
    assert wrapper.runtime.config == deep_ep.Config(32, 32, 256, 6, 128)
    assert deep_ep.Buffer.get_dispatch_config(2) == deep_ep.Config(32, 48, 256, 6, 128)


def test_megatron_fused_a2a_flow(compat, monkeypatch):
    """Megatron-LM's fused_a2a through the top-level deep_ep package: EventOverlap(EventHandle()) orders a call
    (previous_event), an asynchronous call's event is waited on, the runtime answers DeepEP's queries."""
    import epx.event as event_module
    from deep_ep import Buffer
    from deep_ep.utils import EventHandle, EventOverlap
    from fake_runtime import FakeEvent

    recorded = []

    def record():
        recorded.append(FakeEvent(True))
        return recorded[-1]

    monkeypatch.setattr(event_module, "_record_on_current_stream", record)
    wrapper, binding = compat
    assert isinstance(wrapper, Buffer)
    assert wrapper.runtime.get_num_rdma_ranks() == 1 and wrapper.runtime.get_local_device_id() == 0
    x, ids, weights = tokens()
    hidden_bytes = x.size(1) * max(x.element_size(), 2)
    configs = (Buffer.get_dispatch_config(2), Buffer.get_combine_config(2))
    assert max(config.get_nvl_buffer_size_hint(hidden_bytes, 2) for config in configs) > 0

    # Forward: layout, then dispatch ordered after it.
    per_rank, per_rdma, per_expert, in_rank, event = wrapper.get_dispatch_layout(
        ids, NUM_EXPERTS, previous_event=EventOverlap(EventHandle()), async_finish=True,
        allocate_on_comm_stream=False)
    assert binding.orders[-1].previous_event == recorded[0].handle
    recv_x, _, recv_w, counts, handle, after = wrapper.dispatch(
        x, topk_idx=ids, topk_weights=weights, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, previous_event=event, async_finish=True,
        allocate_on_comm_stream=False)
    assert binding.orders[-1].previous_event == event.event.cuda_event
    after.current_stream_wait()
    assert after.event.waits == 1
    assert counts == [2, 2, 2, 2] and torch.equal(recv_x, x[[0, 1, 3, 4, 5]])

    # Backward: combine ordered after the current stream's work.
    combined, combined_w, event = wrapper.combine(recv_x, handle, topk_weights=recv_w.float(),
                                                  previous_event=EventOverlap(EventHandle()), async_finish=True,
                                                  allocate_on_comm_stream=False)
    assert binding.orders[-1].previous_event == recorded[1].handle
    event.current_stream_wait()
    assert event.event.waits == 1
    assert combined.shape == (6, HIDDEN) and combined_w.shape == (6, NUM_TOPK)


@pytest.mark.parametrize("use_fp8,round_scale,use_ue8m0", [(False, False, False), (True, False, False),
                                                           (True, True, True)])
def test_low_latency_shapes_and_values(compat, use_fp8, round_scale, use_ue8m0):
    wrapper, binding = compat
    max_tokens, num_tokens = 8, 6
    x, ids, weights = tokens(num_tokens)
    stats = torch.zeros(NUM_EXPERTS, dtype=torch.int32)
    recv_x, recv_count, handle, event, hook = wrapper.low_latency_dispatch(
        x, ids, max_tokens, NUM_EXPERTS, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8,
        round_scale=round_scale, use_ue8m0=use_ue8m0)
    assert hook is None and event.event is None
    params = ref.low_latency_params(num_ranks=1, num_experts=NUM_EXPERTS, hidden=HIDDEN, num_topk=NUM_TOPK,
                                    num_max_dispatch_tokens_per_rank=max_tokens)
    (expected,) = ref.low_latency_dispatch([ref.bf16_bits(x)], [ids.numpy()], params, use_fp8=use_fp8,
                                           round_scale=round_scale, use_ue8m0=use_ue8m0)
    assert recv_count.tolist() == list(expected.recv_count) == stats.tolist()
    if use_fp8:
        data, scales = recv_x
        assert data.shape == (NUM_EXPERTS, max_tokens, HIDDEN) and data.dtype == torch.float8_e4m3fn
        columns = 1 if use_ue8m0 else HIDDEN // 128
        assert scales.shape == (NUM_EXPERTS, max_tokens, columns)
        assert scales.dtype == (torch.int32 if use_ue8m0 else torch.float32)
        assert scales.stride() == (columns * max_tokens, 1, max_tokens)  # column-major in the last two dims
        for e, count in enumerate(expected.recv_count):
            np.testing.assert_array_equal(ref.fp8_bytes(data)[e, :count], expected.recv_x[e, :count])
    else:
        assert recv_x.shape == (NUM_EXPERTS, max_tokens, HIDDEN) and recv_x.dtype == torch.bfloat16
    out = torch.zeros(NUM_EXPERTS, max_tokens, HIDDEN, dtype=torch.bfloat16)
    combined, event, hook = wrapper.low_latency_combine(out, ids, weights, handle)
    assert combined.shape == (num_tokens, HIDDEN) and hook is None


def test_low_latency_hooks_defer_the_receive(compat):
    wrapper, _ = compat
    x, ids, weights = tokens()
    recv_x, recv_count, handle, event, hook = wrapper.low_latency_dispatch(x, ids, 8, NUM_EXPERTS, use_fp8=False,
                                                                           return_recv_hook=True)
    recv_count.fill_(-7)
    assert callable(hook) and not hook.done
    assert recv_count.tolist() == [-7] * NUM_EXPERTS  # nothing received yet
    hook()
    assert hook.done and recv_count.tolist() == [2, 2, 2, 2]
    with pytest.raises(epx.EpxError, match="runs once"):
        hook()
    expert_out = recv_x.clone()
    preset = torch.full((6, HIDDEN), 3.0, dtype=torch.bfloat16)
    combined, event, hook = wrapper.low_latency_combine(expert_out, ids, weights, handle, return_recv_hook=True,
                                                        out=preset)
    assert combined is preset and bool((combined == 3).all())
    hook()
    expected = sum(torch.where(ids[:, k:k + 1] >= 0, weights[:, k:k + 1] * x.float(), 0) for k in range(NUM_TOPK))
    torch.testing.assert_close(combined.float(), expected, rtol=1e-2, atol=1e-2)
    with pytest.raises(epx.EpxError, match="must be the handle tuple low_latency_dispatch returned"):
        wrapper.low_latency_combine(expert_out, ids, weights, object())
    with pytest.raises(epx.EpxError, match=r"x.shape"):
        wrapper.low_latency_combine(expert_out[:, :4], ids, weights, handle)
    wrapper.clean_low_latency_buffer(8, HIDDEN, NUM_EXPERTS)


def test_autograd_one_rank_matches_dense(fake):
    buffer, _ = fake
    x0, ids, w0 = tokens()
    generator = torch.Generator().manual_seed(3)
    experts = (torch.randn(NUM_EXPERTS, HIDDEN, HIDDEN, generator=generator) / 16).to(torch.bfloat16)
    target = torch.randn(6, HIDDEN, generator=generator)

    x = x0.clone().requires_grad_()
    w = w0.clone().requires_grad_()
    experts_d = experts.clone().requires_grad_()
    result = training.dispatch(buffer, x, ids, w, NUM_EXPERTS)
    rows, probs, info = training.permute(result.recv_x, result.recv_topk_idx, NUM_EXPERTS, result.recv_topk_weights)
    chunks = rows.split(info.num_tokens_per_expert.tolist())
    expert_out = torch.cat([chunk @ experts_d[e] for e, chunk in enumerate(chunks)])
    out = training.combine(buffer, training.unpermute(expert_out, info, probs), result.handle)
    (out.float() * target).sum().backward()

    xd = x0.clone().requires_grad_()
    wd = w0.clone().requires_grad_()
    experts_r = experts.clone().requires_grad_()
    dense = torch.zeros(6, HIDDEN)
    for k in range(NUM_TOPK):
        for e in range(NUM_EXPERTS):
            rows_e = (ids[:, k] == e).nonzero(as_tuple=True)[0]
            if rows_e.numel():
                y = (xd[rows_e] @ experts_r[e]).float() * wd[rows_e, k].unsqueeze(1)
                dense = dense.index_add(0, rows_e, y)
    (dense.to(torch.bfloat16).float() * target).sum().backward()

    def close(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm()) < 2e-2

    assert close(out.detach().float(), dense.detach())
    assert close(x.grad.float(), xd.grad.float())
    assert close(w.grad, wd.grad)
    assert close(experts_d.grad.float(), experts_r.grad.float())
    # Tokens routed nowhere get no gradient from the experts.
    assert bool((x.grad[2] == 0).all())


def test_check_and_reset_reach_the_runtime(fake, compat):
    buffer, binding = fake
    buffer.check()
    assert not buffer.is_aborted
    message = "rank 0 timed out after 1.0 s waiting for peer 1 in barrier: expected >= 2, saw 1"
    buffer.runtime.fail(message)
    with pytest.raises(epx.EpxError, match="peer 1 in barrier"):
        buffer.check()
    assert buffer.is_aborted
    wrapper, _ = compat
    with pytest.raises(epx.EpxError, match="peer 1 in barrier"):
        wrapper.check()
    wrapper.reset()
    assert not buffer.is_aborted and buffer.runtime.resets == 1
    buffer.check()
    buffer.reset()
    assert buffer.runtime.resets == 2


def test_rank_mask_calls_reach_the_runtime(compat):
    wrapper, binding = compat
    buffer = wrapper.runtime
    status = torch.full((1,), 7, dtype=torch.int32)
    wrapper.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0]
    wrapper.low_latency_update_mask_buffer(0, True)
    wrapper.low_latency_query_mask_buffer(status)
    assert status.tolist() == [1] and buffer.low_latency_masked_ranks() == ([0], [])
    wrapper.low_latency_update_mask_buffer(0)  # DeepEP's default mask=False unmasks
    wrapper.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0]
    buffer.low_latency_update_mask_buffer(0, mask=True)
    wrapper.low_latency_clean_mask_buffer()
    assert buffer.low_latency_masked_ranks() == ([], [])
    assert all(order.async_finish is False for order in binding.orders)
    assert buffer.enable_shrink is False
    # Argument checks name the argument, the value and the rule.
    with pytest.raises(epx.EpxError, match=r"invalid mask_status.dtype = torch.int64: must be torch.int32"):
        wrapper.low_latency_query_mask_buffer(torch.zeros(1, dtype=torch.int64))
    with pytest.raises(epx.EpxError, match=r"invalid mask_status.shape = \(2,\): must have size 1"):
        wrapper.low_latency_query_mask_buffer(torch.zeros(2, dtype=torch.int32))
    with pytest.raises(epx.EpxError, match="invalid rank_to_mask = '1': must be an int"):
        wrapper.low_latency_update_mask_buffer("1", True)


def test_fake_structs_take_exactly_the_bindings_fields():
    """The fake runtime's structs have the binding's fields and defaults (read off the compiled binding, or its
    stand-ins in a build without the CUDA runtime part): a field the layer sets that the binding lacks fails on
    the CPU too."""
    from fake_runtime import FakeBinding

    fake_in = FakeBinding.DispatchInput(num_tokens=3)
    assert fake_in.num_tokens == 3 and fake_in.expert_alignment == 1 and fake_in.num_worst_tokens == 0
    with pytest.raises(AttributeError, match="DispatchInput has no field 'num_tokens_per_rnk'"):
        fake_in.num_tokens_per_rnk = 1
    assert set(FakeBinding.LowLatencyCombineInput.fields()) >= {"use_logfmt", "zero_copy", "topk_weights"}
    assert FakeBinding.LowLatencyDispatchInput().use_fp8 is True


def test_fake_stand_in_structs_match_the_binding():
    """The stand-ins the fake uses where the binding has no CUDA runtime part have the compiled structs' fields
    and defaults (enums by name)."""
    from fake_runtime import STAND_IN_STRUCTS, native_defaults

    from epx import _epx

    if not epx.WITH_CUDA:
        pytest.skip("built without CUDA (EPX_WITH_CUDA=OFF): epx._epx has no CUDA runtime part to compare with")
    for name, stand_in in STAND_IN_STRUCTS.items():
        native = {field: value.name.lower() if hasattr(value, "name") else value
                  for field, value in native_defaults(getattr(_epx, name)).items()}
        assert stand_in == native, name
        assert [type(stand_in[field]) for field in native] == [type(value) for value in native.values()], name
