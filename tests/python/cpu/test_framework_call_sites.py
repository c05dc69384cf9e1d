"""vLLM- and SGLang-style DeepEP call sequences on the CPU with one rank (fake_runtime.py): every keyword those
frameworks pass is accepted and the results land where they read them. Plus the two compat pieces their calls
need: queues shortened to fit a Buffer sized for narrower rows (SGLang sizes it for FP8 rows, then combines
BF16), and input copies (contiguous scales, widened ids) ordered after previous_event. The GPU test
(tests/python/gpu/test_inference_call_sites.py) runs the same sequences on several ranks. Skipped without
torch."""

import contextlib

import pytest

torch = pytest.importorskip("torch")

import epx.buffer as buffer_module  # noqa: E402
import epx.compat.deep_ep as deep_ep  # noqa: E402
from fake_runtime import deep_ep_wrapper, sample_tokens, FakeEvent, install  # noqa: E402

HIDDEN = 512
NUM_EXPERTS = 4
NUM_TOPK = 2
MAX_TOKENS = 8


@pytest.fixture
def wrapper(monkeypatch):
    import epx.event as event_module

    buffer, binding = install(monkeypatch)
    monkeypatch.setattr(event_module, "_record_on_current_stream", lambda: FakeEvent(True))  # EventHandle()
    wrapper = deep_ep_wrapper(buffer)
    wrapper.low_latency_mode = True
    return wrapper, binding


def tokens(num_tokens=6, seed=0):
    return sample_tokens(HIDDEN, NUM_TOPK, num_tokens, seed)


SENT = torch.tensor([True, True, False, True, True, True])  # token 2 picked no expert


# ---- Queues shortened to fit ----


def test_queues_shorten_to_fit_rows_wider_than_the_buffer_was_sized_for(wrapper):
    wrapper, _ = wrapper
    runtime = wrapper.runtime
    runtime.num_ranks = 2  # size the hints for two ranks (only the helper runs)
    config = deep_ep.Config(20, 6, 256, 6, 128)
    hidden = 7168
    fp8_bytes = config.get_nvl_buffer_size_hint(hidden, 2)  # SGLang: hidden * 1 byte for FP8 dispatch
    runtime.runtime.num_nvl_bytes = fp8_bytes
    assert wrapper._config_that_fits(config, hidden) is config  # rows as wide as it was sized for
    # FP8 rows with their 56 scales are a little wider, BF16 rows (the combine) twice as wide: the longest queues
    # that fit, the send chunk no larger.
    for row_bytes, shortest in ((hidden + 4 * (hidden // 128), 200), (hidden * 2, 64)):
        fitted = wrapper._config_that_fits(config, row_bytes)
        queue = fitted.num_max_nvl_chunked_recv_tokens
        assert shortest <= queue < 256 and fitted.num_sms == config.num_sms
        assert fitted.num_max_nvl_chunked_send_tokens == min(6, queue)
        assert fitted.get_nvl_buffer_size_hint(row_bytes, 2) <= fp8_bytes
        assert deep_ep.Config(20, 6, queue + 1, 6, 128).get_nvl_buffer_size_hint(row_bytes, 2) > fp8_bytes
    # Nothing fits (a buffer of a few bytes): unchanged, so the call names the bytes it needs.
    runtime.runtime.num_nvl_bytes = 1024
    assert wrapper._config_that_fits(config, hidden * 2) is config
    # No NVLink buffer (a low-latency-only Buffer), or not a token tensor: unchanged.
    runtime.runtime.num_nvl_bytes = 0
    assert wrapper._config_that_fits(config, hidden * 2) is config
    runtime.runtime.num_nvl_bytes = fp8_bytes
    assert wrapper._config_that_fits(config, None) is config


def test_row_bytes_of_call_inputs():
    x = torch.zeros(3, 256, dtype=torch.bfloat16)
    assert deep_ep._row_bytes(x) == 512
    fp8 = x.to(torch.float8_e4m3fn)
    assert deep_ep._row_bytes((fp8, torch.ones(3, 2))) == 256 + 8
    assert deep_ep._row_bytes((fp8, torch.ones(3, 1, dtype=torch.int32))) == 256 + 4
    assert deep_ep._row_bytes((fp8,)) is None and deep_ep._row_bytes(torch.zeros(3)) is None


# ---- Input copies ordered after previous_event ----


@pytest.fixture
def comm_stream_log(wrapper, monkeypatch):
    """Records which streams the layer enters (the fake's comm stream is the string "comm")."""
    wrapper, _ = wrapper
    entered = []

    @contextlib.contextmanager
    def recording(stream):
        entered.append(stream)
        yield

    class OnCommStream:  # the Buffer's reusable switch to its comm stream
        def __enter__(self):
            entered.append("comm")

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(buffer_module, "maybe_stream", recording)
    wrapper.runtime.comm_stream = "comm"
    wrapper.runtime._on_comm_stream = OnCommStream()
    return wrapper, entered


def test_input_copies_follow_previous_event_on_the_comm_stream(comm_stream_log):
    wrapper, entered = comm_stream_log
    x, ids, weights = tokens()
    column_major = torch.ones(HIDDEN // 128, 6).t()
    fp8 = (x.float().to(torch.float8_e4m3fn), column_major)
    previous = FakeEvent(True)
    wrapper.get_dispatch_layout(ids.int(), NUM_EXPERTS, previous_event=previous)
    assert entered == ["comm", None] and previous.waits == 1  # the widened ids: on the comm stream, after it
    entered.clear()
    result = wrapper.dispatch(fp8, topk_idx=ids.int(), topk_weights=weights,
                              num_tokens_per_expert=torch.zeros(NUM_EXPERTS, dtype=torch.int32),
                              is_token_in_rank=SENT[:, None].clone(), previous_event=deep_ep.EventOverlap(previous))
    # The input copies on the comm stream (the handle's matrices come from the count exchange itself).
    assert entered == ["comm", None] and previous.waits == 2
    assert torch.equal(result[0][1], torch.ones(5, HIDDEN // 128))
    # Without previous_event the call orders the comm stream after the current stream: copies stay there.
    entered.clear()
    wrapper.dispatch(fp8, topk_idx=ids.int(), topk_weights=weights,
                     num_tokens_per_expert=torch.zeros(NUM_EXPERTS, dtype=torch.int32),
                     is_token_in_rank=SENT[:, None].clone())
    assert entered == [None] and previous.waits == 2


# ---- vLLM-style sequences ----


def test_vllm_high_throughput_sequence(wrapper):
    """deepep_ht prepare / finalize: layout and dispatch by keyword, FP8 per-token scales, local ids mapped back
    to global ones, the weighted rows reduced locally, combine without weights into the caller's output."""
    wrapper, _ = wrapper
    x, ids, weights = tokens()
    fp8 = x.float().to(torch.float8_e4m3fn)
    per_token = torch.full((6, 1), 0.5)
    previous_event = None  # vLLM captures an event (Buffer.capture) only under dual-batch overlap
    per_rank, per_rdma, per_expert, in_rank, event = wrapper.get_dispatch_layout(
        topk_idx=ids, num_experts=NUM_EXPERTS, previous_event=previous_event, async_finish=False,
        allocate_on_comm_stream=False)
    (recv_fp8, recv_scales), recv_ids, recv_w, counts, handle, event = wrapper.dispatch(
        x=(fp8, per_token), handle=None, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=ids, topk_weights=weights,
        expert_alignment=1, num_worst_tokens=0, config=None, previous_event=previous_event, async_finish=False,
        allocate_on_comm_stream=False)
    assert event.event is None  # vLLM waits only when there is an event
    assert recv_scales.shape == (5, 1) and torch.equal(recv_fp8.view(torch.uint8), fp8[SENT].view(torch.uint8))
    global_ids = torch.where(recv_ids == -1, NUM_EXPERTS - 1, recv_ids + 0)
    assert bool((global_ids >= 0).all()) and counts == [2, 2, 2, 2]
    fused = (recv_fp8.float() * recv_scales).to(torch.bfloat16)
    combined, _, event = wrapper.combine(x=fused, handle=handle, topk_weights=None, config=None,
                                         previous_event=None, async_finish=False, allocate_on_comm_stream=False)
    output = torch.empty(6, HIDDEN, dtype=torch.bfloat16)
    output.copy_(combined, non_blocking=True)
    assert torch.equal(output, (x.float() * 0.5 * SENT[:, None]).to(torch.bfloat16))


def test_vllm_low_latency_sequence(wrapper):
    """deepep_ll prepare_async / finalize: the size hint by keyword, dispatch with a receive hook (FP8,
    UE8M0-packed scales), combine into `out=` with and without a hook."""
    wrapper, _ = wrapper
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN,
                                                         num_ranks=1, num_experts=NUM_EXPERTS)
    assert hint > 0
    x, ids, weights = tokens()
    expert_x, expert_num_tokens, handle, _, hook = wrapper.low_latency_dispatch(
        x, ids, MAX_TOKENS, NUM_EXPERTS, use_fp8=True, round_scale=True, use_ue8m0=True, async_finish=False,
        return_recv_hook=True)
    hook()
    data, scales = expert_x
    assert scales.dtype == torch.int32 and scales.shape == (NUM_EXPERTS, MAX_TOKENS, 1)
    assert expert_num_tokens.tolist() == [2, 2, 2, 2]
    expert_out = torch.zeros(NUM_EXPERTS, MAX_TOKENS, HIDDEN, dtype=torch.bfloat16)
    output = torch.empty(6, HIDDEN, dtype=torch.bfloat16)
    returned, _, recv_hook = wrapper.low_latency_combine(expert_out, ids, weights, handle, async_finish=False,
                                                         zero_copy=False, return_recv_hook=True, out=output)
    assert returned is output and callable(recv_hook)
    recv_hook()
    assert bool((output == 0).all())
    returned, _, recv_hook = wrapper.low_latency_combine(expert_out, ids, torch.ones_like(weights), handle,
                                                         async_finish=False, zero_copy=False, return_recv_hook=False,
                                                         out=output)
    assert returned is output and recv_hook is None


# ---- SGLang-style sequence ----


def test_sglang_sequence(wrapper):
    """The DeepEP token dispatcher: normal mode with Buffer.capture() events and allocation on the comm stream,
    expert_alignment=128; then low latency after clean_low_latency_buffer, keywords for combine."""
    wrapper, binding = wrapper
    # --deepep-config: the normal-mode configs as JSON objects, built by keyword.
    fields = dict(num_sms=24, num_max_nvl_chunked_send_tokens=6, num_max_nvl_chunked_recv_tokens=256,
                  num_max_rdma_chunked_send_tokens=6, num_max_rdma_chunked_recv_tokens=128)
    assert deep_ep.Config(**fields) == deep_ep.Config(24, 6, 256, 6, 128)
    x, ids, weights = tokens()
    previous_event = wrapper.capture()
    per_rank, per_rdma, per_expert, in_rank, previous_event = wrapper.get_dispatch_layout(
        ids, NUM_EXPERTS, previous_event=previous_event, async_finish=True,
        allocate_on_comm_stream=previous_event is not None)
    recv_x, recv_ids, recv_w, counts, handle, event = wrapper.dispatch(
        x, topk_idx=ids, topk_weights=weights, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, previous_event=previous_event,
        async_finish=True, allocate_on_comm_stream=previous_event is not None, expert_alignment=128, config=None)
    event.current_stream_wait()
    assert counts == [128] * NUM_EXPERTS and torch.equal(recv_x, x[SENT])
    previous_event = wrapper.capture()
    combined, _, event = wrapper.combine(recv_x, handle, async_finish=True, previous_event=previous_event,
                                         allocate_on_comm_stream=previous_event is not None, config=None)
    event.current_stream_wait()
    assert torch.equal(combined, (x.float() * SENT[:, None]).to(torch.bfloat16))

    cleaned = binding.cleaned
    wrapper.clean_low_latency_buffer(MAX_TOKENS, HIDDEN, NUM_EXPERTS)
    assert binding.cleaned == cleaned + 1
    hidden_states, masked_m, handle, event, hook = wrapper.low_latency_dispatch(
        x, ids, MAX_TOKENS, NUM_EXPERTS, use_fp8=False, async_finish=True, return_recv_hook=False)
    event.current_stream_wait()
    expected_m = (6 * wrapper.group_size * NUM_TOPK + NUM_EXPERTS) // NUM_EXPERTS
    assert expected_m == 4 and masked_m.tolist() == [2, 2, 2, 2]
    combined, event, hook = wrapper.low_latency_combine(x=hidden_states, topk_idx=ids, topk_weights=weights,
                                                        handle=handle, async_finish=True, return_recv_hook=False)
    event.current_stream_wait()
    expected = sum(torch.where(ids[:, k:k + 1] >= 0, weights[:, k:k + 1] * x.float(), 0) for k in range(NUM_TOPK))
    torch.testing.assert_close(combined.float(), expected, rtol=1e-2, atol=1e-2)
