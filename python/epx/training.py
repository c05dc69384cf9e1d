"""Training helpers: dispatch and combine as autograd functions, and permute/unpermute between the
dispatch layout (one row per received token) and expert-major rows (one row per (token, local expert)).

The backward of dispatch is a combine with the same handle (gradients of the copies of a token sum up on
its rank); the backward of combine is a dispatch with the cached handle (the gradient of each token goes
back to every rank that sent a copy).

    result = epx.training.dispatch(buffer, x, topk_idx, topk_weights, num_experts)
    rows, probs, info = epx.training.permute(result.recv_x, result.recv_topk_idx, num_local_experts,
                                             result.recv_topk_weights)
    expert_out = ...  # per-expert MLP over rows, info.num_tokens_per_expert rows each
    y = epx.training.unpermute(expert_out, info, probs)  # weighted, back to the received rows
    out = epx.training.combine(buffer, y, result.handle)  # [T, H], differentiable
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

from ._util import check
from .buffer import Buffer
from .config import Config
from .results import DispatchHandle, DispatchResult


class DispatchFunction(torch.autograd.Function):
    """recv_x, recv_topk_idx, recv_topk_weights = dispatch(x, topk_weights); differentiable in x (BF16) and
    topk_weights. The full DispatchResult is left in holder["result"]."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, topk_weights: torch.Tensor, buffer: Buffer, topk_idx: torch.Tensor,
                num_experts: int, expert_alignment: int, num_worst_tokens: int, config: Optional[Config],
                combine_config: Optional[Config], holder: dict) -> Tuple[torch.Tensor, ...]:
        result = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts,
                                 expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens,
                                 config=config)
        holder["result"] = result
        ctx.buffer = buffer
        ctx.handle = result.handle
        ctx.combine_config = combine_config
        ctx.mark_non_differentiable(result.recv_topk_idx)
        ctx.save_for_backward(result.recv_topk_idx)
        return result.recv_x, result.recv_topk_idx, result.recv_topk_weights

    @staticmethod
    def backward(ctx: Any, grad_recv_x: Optional[torch.Tensor], _grad_recv_idx: Any,
                 grad_recv_weights: Optional[torch.Tensor]) -> Tuple[Any, ...]:
        (recv_topk_idx,) = ctx.saved_tensors
        handle: DispatchHandle = ctx.handle
        if grad_recv_x is None:
            grad_recv_x = torch.zeros(handle.num_recv_rows, handle.hidden, dtype=torch.bfloat16,
                                      device=recv_topk_idx.device)
        grad_recv_x = grad_recv_x.to(torch.bfloat16).contiguous()
        weights = None
        if ctx.needs_input_grad[1]:
            if grad_recv_weights is None:
                grad_recv_weights = torch.zeros_like(recv_topk_idx, dtype=torch.float32)
            # A received weight is the constant 0 where its expert lives on another rank: no gradient there.
            weights = grad_recv_weights.float().masked_fill(recv_topk_idx < 0, 0.0).contiguous()
        result = ctx.buffer.combine(grad_recv_x, handle, topk_weights=weights, config=ctx.combine_config)
        return (result.combined_x, result.combined_topk_weights) + (None,) * 8


class CombineFunction(torch.autograd.Function):
    """combined_x = combine(x, handle) + bias0 + bias1; differentiable in x and the biases."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias0: Optional[torch.Tensor], bias1: Optional[torch.Tensor],
                buffer: Buffer, handle: DispatchHandle, config: Optional[Config],
                dispatch_config: Optional[Config]) -> torch.Tensor:
        result = buffer.combine(x, handle, bias=(bias0, bias1), config=config)
        ctx.buffer = buffer
        ctx.handle = handle
        ctx.dispatch_config = dispatch_config
        return result.combined_x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Any, ...]:
        handle: DispatchHandle = ctx.handle
        grad = grad.to(torch.bfloat16).contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = ctx.buffer.dispatch(grad, handle=handle, config=ctx.dispatch_config).recv_x
            if handle.num_worst_tokens > 0:
                # Padding rows took no part in the forward sum.
                grad_x = grad_x.masked_fill((handle.recv_src_idx < 0).unsqueeze(1), 0.0)
        grad_bias0 = grad if ctx.needs_input_grad[1] else None
        grad_bias1 = grad if ctx.needs_input_grad[2] else None
        return grad_x, grad_bias0, grad_bias1, None, None, None, None


def dispatch(buffer: Buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
             num_experts: int, *, expert_alignment: int = 1, num_worst_tokens: int = 0,
             config: Optional[Config] = None, combine_config: Optional[Config] = None) -> DispatchResult:
    """Buffer.dispatch that autograd can differentiate (x BF16 and topk_weights); returns the DispatchResult
    with recv_x and recv_topk_weights attached to the graph. combine_config is used by the backward."""
    check(isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16, "x",
          getattr(x, "dtype", type(x).__name__), "must be a torch.bfloat16 tensor (FP8 dispatch is not differentiable)")
    holder: dict = {}
    recv_x, recv_idx, recv_weights = DispatchFunction.apply(x, topk_weights, buffer, topk_idx, num_experts,
                                                             expert_alignment, num_worst_tokens, config,
                                                             combine_config, holder)
    result: DispatchResult = holder["result"]
    result.recv_x, result.recv_topk_idx, result.recv_topk_weights = recv_x, recv_idx, recv_weights
    return result


def combine(buffer: Buffer, x: torch.Tensor, handle: DispatchHandle, *, bias: Any = None,
            config: Optional[Config] = None, dispatch_config: Optional[Config] = None) -> torch.Tensor:
    """Buffer.combine that autograd can differentiate (x and the biases); returns combined_x [T, H].
    dispatch_config is used by the backward."""
    biases = list(bias) if isinstance(bias, (tuple, list)) else [bias]
    biases += [None] * (2 - len(biases))
    return CombineFunction.apply(x, biases[0], biases[1], buffer, handle, config, dispatch_config)


@dataclass
class PermuteInfo:
    """How permute reordered the rows (what unpermute needs)."""

    row_idx: torch.Tensor  # int64 [S]: the received row each permuted row came from
    topk_pos: torch.Tensor  # int64 [S]: which top-k entry of that row chose the expert
    num_tokens_per_expert: torch.Tensor  # int64 [L] on the device: rows of each local expert, in order
    num_rows: int  # N: rows of the dispatch output


def permute(recv_x: torch.Tensor, recv_topk_idx: torch.Tensor, num_local_experts: int,
            recv_topk_weights: Optional[torch.Tensor] = None
            ) -> Tuple[torch.Tensor, Optional[torch.Tensor], PermuteInfo]:
    """One row per (received token, local expert it chose), grouped by expert (expert 0's rows first, each
    group in received-row order). Returns (rows [S, H], their weights [S] or None, PermuteInfo).
    Differentiable in recv_x and recv_topk_weights. Finding S synchronizes with the host once."""
    selected = recv_topk_idx >= 0
    rows, positions = selected.nonzero(as_tuple=True)
    experts = recv_topk_idx[rows, positions]
    order = torch.sort(experts, stable=True).indices  # nonzero is row-major: rows stay ascending per expert
    row_idx = rows[order]
    topk_pos = positions[order]
    counts = torch.bincount(experts, minlength=num_local_experts)
    permuted = recv_x.index_select(0, row_idx)
    probs = recv_topk_weights[row_idx, topk_pos] if recv_topk_weights is not None else None
    return permuted, probs, PermuteInfo(row_idx, topk_pos, counts, recv_x.size(0))


def unpermute(expert_out: torch.Tensor, info: PermuteInfo, probs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Back to the dispatch layout: row n = sum over its experts of (probs *) expert output, accumulated in
    float32 and returned in expert_out's dtype. Differentiable in expert_out and probs."""
    values = expert_out.float()
    if probs is not None:
        values = values * probs.float().unsqueeze(1)
    out = torch.zeros(info.num_rows, expert_out.size(1), dtype=torch.float32, device=expert_out.device)
    return out.index_add(0, info.row_idx, values).to(expert_out.dtype)
