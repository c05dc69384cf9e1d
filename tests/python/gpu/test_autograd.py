"""epx.training on 2 GPUs: dispatch -> permute -> per-expert linear -> unpermute -> combine, forward and
backward, against the same computation on one GPU without communication (all ranks' tokens, all experts).
Gradients reach x, the router weights (topk_weights) and the expert weights."""

import pytest

from dist_util import gpu_counts, run

HIDDEN = 256
NUM_TOPK = 2
EXPERTS_PER_RANK = 2


def make_problem(num_ranks, device):
    """Every rank's tokens, routing, weights and loss targets, plus all expert weights (seeded, the same on
    every process)."""
    import torch

    import epx_tools.reference as ref

    generator = torch.Generator().manual_seed(1234)
    num_experts = EXPERTS_PER_RANK * num_ranks
    num_tokens = [24 + 8 * r for r in range(num_ranks)]
    ids = ref.native.make_unbalanced_routing(3, num_tokens, NUM_TOPK, num_experts, num_ranks)
    problem = []
    for r in range(num_ranks):
        problem.append(dict(
            x=torch.randn(num_tokens[r], HIDDEN, generator=generator).to(torch.bfloat16).to(device),
            topk_idx=torch.from_numpy(ids[r].reshape(-1, NUM_TOPK)).to(device),
            topk_weights=torch.rand(num_tokens[r], NUM_TOPK, generator=generator).to(device),
            target=torch.randn(num_tokens[r], HIDDEN, generator=generator).to(device)))
    experts = (torch.randn(num_experts, HIDDEN, HIDDEN, generator=generator) * HIDDEN ** -0.5).to(torch.bfloat16)
    return problem, experts.to(device)


def moe_single_gpu(x, topk_idx, topk_weights, experts):
    """out[t] = sum_k w[t, k] * (x[t] @ W[e_tk]) for the ids that are not -1, in float32, rounded to BF16."""
    import torch

    out = torch.zeros(x.size(0), x.size(1), dtype=torch.float32, device=x.device)
    for e in range(experts.size(0)):
        for k in range(topk_idx.size(1)):
            rows = (topk_idx[:, k] == e).nonzero(as_tuple=True)[0]
            if rows.numel() > 0:
                y = (x.index_select(0, rows) @ experts[e]).float() * topk_weights[rows, k].unsqueeze(1)
                out = out.index_add(0, rows, y)
    return out.to(torch.bfloat16)


def grad_of(leaf):
    """A leaf's gradient, zeros when it took no part (e.g. a rank whose tokens all have -1 ids)."""
    import torch

    return leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)


def relative_error(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def autograd_worker(rank, num_ranks, group):
    import torch

    import epx
    import epx.training as training

    device = torch.device("cuda", torch.cuda.current_device())
    problem, experts = make_problem(num_ranks, device)
    num_experts = experts.size(0)
    local = slice(rank * EXPERTS_PER_RANK, (rank + 1) * EXPERTS_PER_RANK)
    buffer = epx.Buffer(group, num_nvl_bytes=epx.normal_nvl_buffer_size_hint(HIDDEN * 2, num_ranks))

    # ---- Distributed: this rank's tokens, its own experts ----
    mine = problem[rank]
    x = mine["x"].clone().requires_grad_()
    topk_weights = mine["topk_weights"].clone().requires_grad_()
    weights = experts[local].clone().requires_grad_()
    result = training.dispatch(buffer, x, mine["topk_idx"], topk_weights, num_experts)
    rows, probs, info = training.permute(result.recv_x, result.recv_topk_idx, EXPERTS_PER_RANK,
                                         result.recv_topk_weights)
    counts = info.num_tokens_per_expert.tolist()
    expert_out = torch.cat([chunk @ weights[le] for le, chunk in enumerate(rows.split(counts))])
    y = training.unpermute(expert_out, info, probs)
    out = training.combine(buffer, y, result.handle)
    loss = (out.float() * mine["target"]).sum()
    loss.backward()

    # ---- One GPU: every rank's tokens through every expert, no communication ----
    all_experts = experts.clone().requires_grad_()
    leaves = [(p["x"].clone().requires_grad_(), p["topk_weights"].clone().requires_grad_()) for p in problem]
    losses = [(moe_single_gpu(lx, p["topk_idx"], lw, all_experts).float() * p["target"]).sum()
              for (lx, lw), p in zip(leaves, problem)]
    sum(losses).backward()

    expected_out = moe_single_gpu(mine["x"], mine["topk_idx"], mine["topk_weights"], experts)
    assert relative_error(out.detach().float(), expected_out.float()) < 1e-2
    assert abs(loss.item() - losses[rank].item()) <= 2e-2 * abs(losses[rank].item()) + 1e-2
    assert relative_error(grad_of(x).float(), grad_of(leaves[rank][0]).float()) < 2e-2
    assert relative_error(grad_of(topk_weights), grad_of(leaves[rank][1])) < 2e-2
    assert relative_error(weights.grad.float(), all_experts.grad[local].float()) < 2e-2

    # ---- Worst-case rows: padding rows get no gradient ----
    x2 = mine["x"].clone().requires_grad_()
    result = training.dispatch(buffer, x2, mine["topk_idx"], mine["topk_weights"],
                               num_experts, num_worst_tokens=sum(p["x"].size(0) for p in problem))
    out2 = training.combine(buffer, result.recv_x * 2, result.handle)
    (out2.float() * mine["target"]).sum().backward()
    copies = torch.zeros(x2.size(0), device=device)
    for r in range(num_ranks):
        on_r = ((mine["topk_idx"] >= 0) & (mine["topk_idx"] // EXPERTS_PER_RANK == r)).any(dim=1)
        copies += on_r.float()
    expected_grad = (mine["target"].to(torch.bfloat16).float() * 2 * copies.unsqueeze(1))
    assert relative_error(x2.grad.float(), expected_grad) < 1e-2
    buffer.destroy()


@pytest.mark.parametrize("num_ranks", gpu_counts(2))
def test_autograd_matches_single_gpu(num_ranks):
    run(autograd_worker, num_ranks)
