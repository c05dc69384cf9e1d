"""megatron-core's fused_dispatch / fused_combine (megatron/core/transformer/moe/fused_a2a.py), unchanged, over
EPX's deep_ep on the CPU: one rank, the CUDA binding replaced by the reference (fake_runtime.py). It checks what
Megatron passes and reads (Buffer(group, num_nvl_bytes, num_rdma_bytes), the recommended configs and their size
hints, EventOverlap(EventHandle()) as previous_event, the async events it waits on, the handle it keeps for
backward) through forward and backward against dense torch math. The GPU test (tests/python/gpu) runs the same
functions on several ranks against the reference. Skipped without torch or megatron-core."""

import pytest

torch = pytest.importorskip("torch")

import epx.compat.deep_ep as compat  # noqa: E402
from fake_runtime import FakeEvent, install  # noqa: E402
from megatron_util import import_fused_a2a  # noqa: E402

HIDDEN = 256
NUM_EXPERTS = 4
NUM_TOPK = 2


class Group:
    """What Megatron reads of a process group: rank() and size(). It reports 2 ranks (a size DeepEP has
    recommended configs for) while the fake runtime serves one."""

    def rank(self):
        return 0

    def size(self):
        return 2


@pytest.fixture
def megatron(monkeypatch):
    """(fused_a2a, the fake epx.Buffer, the binding, events recorded by EventHandle) with Megatron's buffer cache
    reset and deep_ep.Buffer built over the fake runtime."""
    import epx.event as event_module

    fused_a2a = import_fused_a2a()
    buffer, binding = install(monkeypatch)
    built = []

    # Keyword options deep_ep.Buffer forwards (num_sms, enable_shrink, bootstrap, ...) do not matter here.
    def fake_epx_buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, **options):
        built.append((num_nvl_bytes, num_rdma_bytes, low_latency_mode))
        return buffer

    monkeypatch.setattr(compat, "_EpxBuffer", fake_epx_buffer)
    recorded = []

    def record():
        recorded.append(FakeEvent(True))
        return recorded[-1]

    monkeypatch.setattr(event_module, "_record_on_current_stream", record)
    monkeypatch.setattr(fused_a2a, "_buffer", None)
    return fused_a2a, binding, built, recorded


def small_integer_tokens(num_tokens, seed):
    """BF16 tokens and gradients of small integers (sums are exact in any order), routing with -1 slots and a
    token routed nowhere, float32 probabilities."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(-4, 5, (num_tokens, HIDDEN), generator=generator).to(torch.bfloat16)
    ids = torch.randint(0, NUM_EXPERTS, (num_tokens, NUM_TOPK), generator=generator)
    ids[:, 1] = (ids[:, 0] + 1 + torch.randint(0, NUM_EXPERTS - 1, (num_tokens,), generator=generator)) % NUM_EXPERTS
    ids[::3, 1] = -1
    ids[2] = -1
    probs = torch.rand(num_tokens, NUM_TOPK, generator=generator)
    return x, ids, probs


@pytest.mark.parametrize("async_finish,allocate_on_comm_stream", [(False, False), (True, False), (True, True)])
def test_fused_dispatch_and_combine_forward_backward(megatron, async_finish, allocate_on_comm_stream):
    fused_a2a, binding, built, recorded = megatron
    group = Group()
    x0, ids, probs0 = small_integer_tokens(12, seed=5)
    x = x0.clone().requires_grad_()
    probs = probs0.clone().requires_grad_()

    recv_x, recv_ids, recv_probs, tokens_per_expert, handle = fused_a2a.fused_dispatch(
        x, ids, probs, NUM_EXPERTS, group, async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream)
    # Megatron sized the Buffer with the recommended configs' hints for its hidden bytes.
    hidden_bytes = HIDDEN * 2
    configs = (compat.Buffer.get_dispatch_config(2), compat.Buffer.get_combine_config(2))
    assert built == [(max(c.get_nvl_buffer_size_hint(hidden_bytes, 2) for c in configs),
                      max(c.get_rdma_buffer_size_hint(hidden_bytes, 2) for c in configs), False)]
    sent = (ids >= 0).any(dim=1)
    assert torch.equal(recv_x, x0[sent]) and torch.equal(recv_ids, ids[sent])
    assert torch.equal(recv_probs, torch.where(ids[sent] >= 0, probs0[sent], 0))
    assert tokens_per_expert.tolist() == [int((ids == e).sum()) for e in range(NUM_EXPERTS)]
    assert isinstance(handle, tuple)

    expert_out = recv_x * 2
    combined, none = fused_a2a.fused_combine(expert_out, group, handle, async_finish=async_finish,
                                             allocate_on_comm_stream=allocate_on_comm_stream)
    assert none is None
    assert torch.equal(combined, (x0.float() * 2 * sent[:, None]).to(torch.bfloat16))
    assert fused_a2a._buffer is not None and len(built) == 1  # the cached Buffer served both calls

    generator = torch.Generator().manual_seed(9)
    grad_out = torch.randint(-4, 5, (12, HIDDEN), generator=generator).float()
    grad_probs = torch.randint(-4, 5, tuple(recv_probs.shape), generator=generator).float()
    ((combined.float() * grad_out).sum() + (recv_probs * grad_probs).sum()).backward()
    # Backward of combine is a cached dispatch, backward of dispatch a combine with the probabilities' grads.
    assert torch.equal(x.grad, (grad_out * 2 * sent[:, None]).to(torch.bfloat16))
    expected_probs_grad = torch.zeros(12, NUM_TOPK)
    expected_probs_grad[sent] = grad_probs
    assert torch.equal(probs.grad, expected_probs_grad)
    assert len(built) == 1

    # Calls in order: layout, dispatch, combine; backward: the cached dispatch, then the combine. Asynchronous,
    # each is ordered after an EventHandle recorded on the current stream (the dispatch after the layout's
    # event), and Megatron waits for each one's event.
    orders = binding.orders
    assert len(orders) == 5 and all(order.async_finish == async_finish for order in orders)
    if async_finish:
        handles = [event.handle for event in recorded]
        assert len(handles) == 4
        assert [orders[i].previous_event for i in (0, 2, 3, 4)] == handles
        assert orders[1].previous_event != 0
    else:
        assert not recorded and all(order.previous_event == 0 for order in orders)


def test_fused_dispatch_rebuilds_the_buffer_for_wider_tokens(megatron):
    fused_a2a, _, built, _ = megatron
    group = Group()
    x, ids, probs = small_integer_tokens(6, seed=1)
    fused_a2a.fused_dispatch(x, ids, probs, NUM_EXPERTS, group)
    wide = torch.cat([x, x], dim=1)
    fused_a2a.fused_dispatch(wide, ids, probs, NUM_EXPERTS, group)
    # Megatron builds a new Buffer when the hint for the wider rows exceeds the current num_nvl_bytes.
    assert len(built) == 2 and built[1][0] > built[0][0]
