"""epx.ops (the low-latency calls as torch custom ops) on the CPU, one rank, the native calls stubbed
(fake_runtime): torch.compile traces a dispatch and a combine as one graph (fullgraph) and runs the Buffer's
calls with the caller's arguments, the combine given the dispatch's handle through recv_src_info; the fake
implementations describe the outputs the calls make (shapes, strides, dtypes: BF16, FP8, UE8M0); a key that is
not registered is named. Skipped without torch."""

import pytest

torch = pytest.importorskip("torch")

import epx  # noqa: E402
import epx.ops  # noqa: E402
from fake_runtime import deep_ep_wrapper, install_stub  # noqa: E402

HIDDEN, NUM_EXPERTS, NUM_TOPK, MAX_TOKENS = 512, 8, 4, 16


@pytest.fixture
def buffer(monkeypatch):
    made, _ = install_stub(MAX_TOKENS, HIDDEN, NUM_EXPERTS, monkeypatch)
    key = epx.ops.register(made)
    yield made
    epx.ops.unregister(key)


def inputs(num_tokens=MAX_TOKENS):
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(num_tokens, HIDDEN, generator=generator).to(torch.bfloat16)
    ids = torch.rand(num_tokens, NUM_EXPERTS, generator=generator).topk(NUM_TOPK, dim=1).indices
    return x, ids, torch.rand(num_tokens, NUM_TOPK, generator=generator)


def test_compiled_step_runs_the_buffers_calls_with_the_dispatchs_handle(buffer, monkeypatch):
    key = epx.ops.register(buffer)
    dispatched, combined_with = [], []
    dispatch_call, combine_call = buffer._low_latency_dispatch, buffer._low_latency_combine

    def spy_dispatch(*args, **kwargs):
        made = dispatch_call(*args, **kwargs)
        # M, E, use_fp8, outputs apart (a custom op's may not share storage, which the extension's do), the handle
        dispatched.append((args[2], args[3], args[6], kwargs.get("separate_outputs"), made[3]))
        return made

    def spy_combine(*args):
        combined_with.append(args[3])
        return combine_call(*args)

    monkeypatch.setattr(buffer, "_low_latency_dispatch", spy_dispatch)
    monkeypatch.setattr(buffer, "_low_latency_combine", spy_combine)

    def step(x, ids, weights):
        recv_x, _, _, src_info, layout_range = torch.ops.epx.low_latency_dispatch(key, x, ids, MAX_TOKENS,
                                                                                 NUM_EXPERTS, None, False)
        return torch.ops.epx.low_latency_combine(key, recv_x * 2, ids, weights, src_info, layout_range, MAX_TOKENS,
                                                 NUM_EXPERTS)

    x, ids, weights = inputs()
    combined = torch.compile(step, backend="aot_eager", fullgraph=True)(x, ids, weights)
    assert combined.shape == (MAX_TOKENS, HIDDEN) and combined.dtype == torch.bfloat16
    # The run's calls (tracing calls the fakes only): one dispatch, one combine given its handle.
    assert [d[:4] for d in dispatched] == [(MAX_TOKENS, NUM_EXPERTS, False, True)]
    assert combined_with == [dispatched[0][4]]


def test_a_compiled_step_takes_any_token_count(buffer):
    """A decode loop's batch varies: compiled with dynamic shapes, the fakes never need the token count."""
    key = epx.ops.register(buffer)

    def step(x, ids, weights):
        recv_x, _, _, src_info, layout_range = torch.ops.epx.low_latency_dispatch(key, x, ids, MAX_TOKENS,
                                                                                 NUM_EXPERTS, None, False)
        return torch.ops.epx.low_latency_combine(key, recv_x, ids, weights, src_info, layout_range, MAX_TOKENS,
                                                 NUM_EXPERTS)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=True)
    for num_tokens in (MAX_TOKENS, 5, 3):
        assert compiled(*inputs(num_tokens)).shape == (num_tokens, HIDDEN)


@pytest.mark.parametrize("use_fp8,use_ue8m0", [(False, False), (True, False), (True, True)])
def test_fakes_describe_the_real_outputs(buffer, use_fp8, use_ue8m0):
    from torch._subclasses.fake_tensor import FakeTensorMode

    key = epx.ops.register(deep_ep_wrapper(buffer))  # a deep_ep.Buffer registers its epx.Buffer
    assert key == id(buffer)
    x, ids, _ = inputs(5)
    real = torch.ops.epx.low_latency_dispatch(key, x, ids, MAX_TOKENS, NUM_EXPERTS, None, use_fp8, use_ue8m0,
                                              use_ue8m0)
    with FakeTensorMode() as mode:
        fake = torch.ops.epx.low_latency_dispatch(key, mode.from_tensor(x), mode.from_tensor(ids), MAX_TOKENS,
                                                  NUM_EXPERTS, None, use_fp8, use_ue8m0, use_ue8m0)
    assert len(fake) == len(real) == 5
    for got, want in zip(fake, real):
        assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
    assert real[0].shape == (NUM_EXPERTS, MAX_TOKENS, HIDDEN)  # one rank: L = E, R * M = M
    assert (real[1].numel() > 0) == use_fp8


def test_a_key_that_is_not_registered_is_named(buffer):
    x, ids, _ = inputs()
    with pytest.raises(epx.EpxError, match="buffer = 12345: not a registered Buffer"):
        torch.ops.epx.low_latency_dispatch(12345, x, ids, MAX_TOKENS, NUM_EXPERTS, None)


def test_the_written_argument_has_no_default():
    """torch's dispatcher drops trailing arguments equal to their defaults before a Python kernel; torch 2.11's
    in-place bookkeeping then indexed the written argument past the end (IndexError on a GPU). Without a default it
    is always passed."""
    schema = str(torch.ops.epx.low_latency_dispatch.default._schema)
    assert "? cumulative_local_expert_recv_stats," in schema, schema


def test_the_dispatch_op_takes_outputs_of_their_own_not_the_extensions_blocks(monkeypatch):
    """The torch extension packs a dispatch's outputs into two allocations, which a custom op may not return:
    the op takes the Buffer's Python path, one allocation per output."""
    import epx.buffer as buffer_module

    made, _ = install_stub(MAX_TOKENS, HIDDEN, NUM_EXPERTS, monkeypatch, extension=True, num_topk=NUM_TOPK)
    monkeypatch.setattr(buffer_module.torch_calls, "low_latency_dispatch",
                        lambda *args: pytest.fail("the op called the extension"))
    key = epx.ops.register(made)
    x, ids, _ = inputs()
    outputs = torch.ops.epx.low_latency_dispatch(key, x, ids, MAX_TOKENS, NUM_EXPERTS, None, True)
    storages = {t.untyped_storage().data_ptr() for t in outputs if t.numel() > 0}
    assert len(storages) == len([t for t in outputs if t.numel() > 0])
    epx.ops.unregister(key)
