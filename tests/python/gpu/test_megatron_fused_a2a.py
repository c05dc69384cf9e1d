"""megatron-core's fused_dispatch / fused_combine (megatron/core/transformer/moe/fused_a2a.py, from the PyPI
wheel) run unchanged on EPX's deep_ep, on 2 and 4 ranks (or ranks sharing one GPU): forward and backward,
synchronous and async_finish=True (with and without allocate_on_comm_stream), at 512, 4,096 and 16,384 tokens
per rank, through the one Buffer Megatron builds and caches (sized by the recommended configs' hints). Every
output and gradient is compared bit-exactly with the CPU reference (epx_tools.reference): tokens and gradients are
small integers, so the sums are exact in any order.

Skipped when megatron-core is not importable (the GPU image lacks it: install its wheel, e.g. with
pip install --target DIR megatron-core, and put DIR on PYTHONPATH)."""

import gc

import numpy as np
import pytest

from dist_util import gpu_counts, run
from megatron_util import import_fused_a2a

HIDDEN = 1024
NUM_TOPK = 4
EXPERTS_PER_RANK = 8
SEED = 7
# (async_finish, allocate_on_comm_stream) as Megatron's flex dispatcher passes them.
MODES = [(False, False), (True, False), (True, True)]


def small_integers(seed, shape):
    """Seeded integers in [-4, 4] as float32 (exact in BF16, and their sums too)."""
    return np.random.default_rng(seed).integers(-4, 5, size=shape).astype(np.float32)


class World:
    """Every rank's inputs and gradients (each process builds all of them) and the reference's answers."""

    def __init__(self, num_ranks, num_experts, num_tokens):
        import epx_tools.reference as ref

        native = ref.native
        self.num_experts = num_experts
        # Routing as a training step has it: every rank sends to and receives from every rank, one hot expert,
        # some slots dropped (-1).
        spec = native.RoutingSpec(num_tokens=num_tokens, num_topk=NUM_TOPK, num_experts=num_experts,
                                  num_ranks=num_ranks, hot_experts=[1], hot_probability=0.3, drop_probability=0.05)
        self.x, self.grad_out, self.inputs = [], [], []
        for r in range(num_ranks):
            ids = native.make_topk_idx(spec, SEED * 1000 + r).reshape(-1, NUM_TOPK)
            self.x.append(ref.float_to_bf16(small_integers(SEED * 100 + r, (num_tokens, HIDDEN))))
            self.grad_out.append(ref.float_to_bf16(small_integers(SEED * 200 + r, (num_tokens, HIDDEN))))
            probs = native.random_topk_weights(SEED * 300 + r, num_tokens, NUM_TOPK).reshape(-1, NUM_TOPK)
            self.inputs.append(ref.NormalRankInput(x=self.x[r], topk_idx=ids,
                                                   topk_weights=probs))
        # Forward: dispatch, the "expert" doubles each row, combine sums the copies.
        self.outputs, handle = ref.normal_dispatch(self.inputs, num_ranks=num_ranks, num_experts=num_experts,
                                                   hidden=HIDDEN)
        expert_out = [double(o.recv_x) for o in self.outputs]
        self.combined = [c for c, _ in ref.normal_combine(handle, expert_out)]
        # Backward: the loss is sum(combined * grad_out) + sum(recv_probs * grad_probs). combine's backward
        # dispatches grad_out along the same routing; dispatch's backward combines the rows' gradients (twice
        # the dispatched grad_out) and the probabilities' gradients.
        self.grad_probs = [small_integers(SEED * 400 + d, (o.num_rows, NUM_TOPK)) for d, o in enumerate(self.outputs)]
        grad_inputs = [ref.NormalRankInput(x=g, topk_idx=i.topk_idx, topk_weights=i.topk_weights)
                       for g, i in zip(self.grad_out, self.inputs)]
        grad_rows, _ = ref.normal_dispatch(grad_inputs, num_ranks=num_ranks, num_experts=num_experts, hidden=HIDDEN)
        self.grads = ref.normal_combine(handle, [double(o.recv_x) for o in grad_rows], topk_weights=self.grad_probs)


def double(bits):
    import epx_tools.reference as ref

    return ref.float_to_bf16(ref.bf16_to_float(bits) * 2)


def one_step(fused_a2a, world, rank, group, device, async_finish, allocate_on_comm_stream):
    """Megatron's forward and backward on this rank's inputs, checked against the reference."""
    import torch

    import epx_tools.reference as ref

    own, expected = world.inputs[rank], world.outputs[rank]
    x = ref.to_torch_bf16(own.x, device).requires_grad_()
    probs = torch.from_numpy(own.topk_weights).to(device).requires_grad_()
    ids = torch.from_numpy(own.topk_idx).to(device)

    recv_x, recv_ids, recv_probs, tokens_per_expert, handle = fused_a2a.fused_dispatch(
        x, ids, probs, world.num_experts, group, async_finish=async_finish,
        allocate_on_comm_stream=allocate_on_comm_stream)
    np.testing.assert_array_equal(ref.bf16_bits(recv_x), expected.recv_x)
    np.testing.assert_array_equal(recv_ids.cpu().numpy(), expected.recv_topk_idx)
    np.testing.assert_array_equal(recv_probs.detach().cpu().numpy(), expected.recv_topk_weights)
    assert tokens_per_expert.tolist() == expected.num_recv_tokens_per_expert_list

    combined, _ = fused_a2a.fused_combine(recv_x * 2, group, handle, async_finish=async_finish,
                                          allocate_on_comm_stream=allocate_on_comm_stream)
    np.testing.assert_array_equal(ref.bf16_bits(combined), world.combined[rank])

    grad_out = ref.to_torch_bf16(world.grad_out[rank], device).float()
    grad_probs = torch.from_numpy(world.grad_probs[rank]).to(device)
    ((combined.float() * grad_out).sum() + (recv_probs * grad_probs).sum()).backward()
    grad_x, grad_p = world.grads[rank]
    np.testing.assert_array_equal(ref.bf16_bits(x.grad), grad_x)
    np.testing.assert_array_equal(probs.grad.cpu().numpy(), grad_p)


def megatron_worker(rank, num_ranks, group, num_tokens):
    import torch

    fused_a2a = import_fused_a2a()
    device = torch.device("cuda", torch.cuda.current_device())
    world = World(num_ranks, EXPERTS_PER_RANK * num_ranks, num_tokens)
    for async_finish, allocate_on_comm_stream in MODES:
        one_step(fused_a2a, world, rank, group, device, async_finish, allocate_on_comm_stream)
    buffer = fused_a2a._buffer
    assert buffer is not None and buffer.group is group  # one cached Buffer served every call
    # Free it now, on every rank together (its teardown is collective), not at interpreter exit.
    del buffer
    fused_a2a._buffer = None
    gc.collect()


@pytest.mark.parametrize("num_tokens", [512, 4096, 16384])
@pytest.mark.parametrize("num_ranks", gpu_counts(2, 4))
def test_megatron_fused_a2a(num_ranks, num_tokens):
    import_fused_a2a()
    run(megatron_worker, num_ranks, num_tokens)
