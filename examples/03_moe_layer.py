"""A mixture-of-experts layer trained with EPX on 2-4 GPUs, checked against a single-GPU computation.

    router -> epx.training.dispatch -> permute -> per-expert MLP -> unpermute -> epx.training.combine

Each rank owns num_experts / num_ranks experts and a replica of the router (its gradient is all-reduced).
Every rank also holds a single-GPU copy of the whole layer (all experts, same initial values) and runs the
same training steps on every rank's tokens without any communication. The script checks, at every step, that
the summed loss agrees, and at the first step that the gradients of the router, the local experts and the
input tokens agree. It exits non-zero on a mismatch.

    python examples/03_moe_layer.py --num-gpus 4 --steps 5

Needs torch with CUDA and the epx package (pip install ./python, or PYTHONPATH=python:<build>/python).
"""

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import epx
import epx.training as training


class MoELayer(torch.nn.Module):
    """Top-k softmax router and experts of two BF16 matrices with GELU; holds experts [first, first + count)."""

    def __init__(self, hidden, ffn, num_experts, top_k, first_expert, num_local_experts, seed):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        router = torch.randn(num_experts, hidden, generator=generator) * hidden ** -0.5
        w1 = torch.randn(num_experts, hidden, ffn, generator=generator) * hidden ** -0.5
        w2 = torch.randn(num_experts, ffn, hidden, generator=generator) * ffn ** -0.5
        local = slice(first_expert, first_expert + num_local_experts)
        self.router = torch.nn.Parameter(router)  # replicated on every rank, float32
        self.w1 = torch.nn.Parameter(w1[local].to(torch.bfloat16).contiguous())
        self.w2 = torch.nn.Parameter(w2[local].to(torch.bfloat16).contiguous())
        self.num_experts, self.top_k, self.first_expert = num_experts, top_k, first_expert

    def route(self, x):
        """(topk_idx int64 [T, K], topk_weights float32 [T, K] normalised over the chosen experts)."""
        probs = torch.softmax(x.float() @ self.router.t(), dim=-1)
        weights, idx = probs.topk(self.top_k, dim=-1)
        return idx, weights / weights.sum(dim=-1, keepdim=True)

    def expert(self, local_expert, rows):
        return F.gelu(rows @ self.w1[local_expert]) @ self.w2[local_expert]

    def forward_distributed(self, x, buffer):
        """This rank's tokens [T, H] BF16 -> [T, H], experts spread over the ranks of `buffer`."""
        topk_idx, topk_weights = self.route(x)
        result = training.dispatch(buffer, x, topk_idx, topk_weights, self.num_experts)
        rows, probs, info = training.permute(result.recv_x, result.recv_topk_idx, self.w1.size(0),
                                             result.recv_topk_weights)
        chunks = rows.split(info.num_tokens_per_expert.tolist())
        expert_out = torch.cat([self.expert(le, chunk) for le, chunk in enumerate(chunks)])
        return training.combine(buffer, training.unpermute(expert_out, info, probs), result.handle)

    def forward_dense(self, x):
        """The same layer on one GPU (this module must hold every expert)."""
        topk_idx, topk_weights = self.route(x)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in range(self.num_experts):
            for k in range(self.top_k):
                rows = (topk_idx[:, k] == e).nonzero(as_tuple=True)[0]
                if rows.numel() > 0:
                    y = self.expert(e, x.index_select(0, rows)).float() * topk_weights[rows, k].unsqueeze(1)
                    out = out.index_add(0, rows, y)
        return out.to(torch.bfloat16)


def batch(rank, step, num_tokens, hidden):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(num_tokens, hidden, generator=generator).to(torch.bfloat16)
    target = torch.randn(num_tokens, hidden, generator=generator)
    return x, target


def relative_error(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def worker(rank, num_ranks, port, args):
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_ranks)
    group = dist.group.WORLD
    num_local = args.num_experts // num_ranks
    layer = MoELayer(args.hidden, args.ffn, args.num_experts, args.top_k, rank * num_local, num_local, 0).to(device)
    dense = MoELayer(args.hidden, args.ffn, args.num_experts, args.top_k, 0, args.num_experts, 0).to(device)
    # The calls use the default config: its hint fits any number of tokens.
    buffer = epx.Buffer(group, num_nvl_bytes=epx.Config().get_nvl_buffer_size_hint(args.hidden * 2, num_ranks))
    tokens_per_step = args.tokens * num_ranks
    failures = []
    for step in range(args.steps):
        # ---- Distributed step ----
        x, target = batch(rank, step, args.tokens, args.hidden)
        x, target = x.to(device).requires_grad_(), target.to(device)
        loss = F.mse_loss(layer.forward_distributed(x, buffer).float(), target, reduction="sum") / tokens_per_step
        loss.backward()
        dist.all_reduce(layer.router.grad, group=group)  # the router is replicated
        total_loss = loss.detach().clone()
        dist.all_reduce(total_loss, group=group)

        # ---- The same step on one GPU, every rank's tokens ----
        dense_loss = 0.0
        dense_x = []
        for r in range(num_ranks):
            xr, tr = batch(r, step, args.tokens, args.hidden)
            xr = xr.to(device).requires_grad_()
            dense_x.append(xr)
            dense_loss = dense_loss + F.mse_loss(dense.forward_dense(xr).float(), tr.to(device),
                                                 reduction="sum") / tokens_per_step
        dense_loss.backward()

        error = abs(total_loss.item() - dense_loss.item()) / abs(dense_loss.item())
        if rank == 0:
            print(f"step {step}: loss {total_loss.item():.6f} (single GPU {dense_loss.item():.6f}, "
                  f"relative difference {error:.1e})", flush=True)
        if error > 2e-2:
            failures.append(f"step {step}: loss differs by {error:.1e}")
        if step == 0:
            local = slice(rank * num_local, (rank + 1) * num_local)
            checks = {"router grad": (layer.router.grad, dense.router.grad),
                      "w1 grad": (layer.w1.grad, dense.w1.grad[local]),
                      "w2 grad": (layer.w2.grad, dense.w2.grad[local]),
                      "input grad": (x.grad, dense_x[rank].grad)}
            for name, (got, expected) in checks.items():
                error = relative_error(got.float(), expected.float())
                if error > 3e-2:
                    failures.append(f"rank {rank} step 0: {name} differs by {error:.1e}")

        # ---- SGD on both copies ----
        with torch.no_grad():
            for model in (layer, dense):
                for parameter in model.parameters():
                    parameter -= args.lr * parameter.grad.to(parameter.dtype)
                    parameter.grad = None

    buffer.destroy()
    dist.destroy_process_group()
    if failures:
        raise RuntimeError("; ".join(failures))
    if rank == 0:
        print(f"OK: {num_ranks} ranks, {args.steps} steps match the single-GPU computation", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-gpus", type=int, default=min(4, torch.cuda.device_count()))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per rank per step")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--num-experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()
    if torch.cuda.device_count() == 0:
        print("no GPU found: this example needs 2 to 4 GPUs", file=sys.stderr)
        return 77  # the C++ examples' "no GPU" status
    if args.num_gpus < 2:
        print(f"needs at least 2 GPUs ({torch.cuda.device_count()} visible)", file=sys.stderr)
        return 1
    if args.num_experts % args.num_gpus != 0:
        print("--num-experts must be a multiple of --num-gpus", file=sys.stderr)
        return 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("EPX_WAIT_TIMEOUT_S", "60")
    mp.spawn(worker, args=(args.num_gpus, port, args), nprocs=args.num_gpus, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
