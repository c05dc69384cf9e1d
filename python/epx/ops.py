"""The low-latency calls as torch custom ops, for code that torch.compile traces.

    import epx.ops
    key = epx.ops.register(buffer)  # an epx.Buffer or a deep_ep.Buffer, in low-latency mode
    recv_x, recv_x_scales, recv_count, recv_src_info, recv_layout_range = torch.ops.epx.low_latency_dispatch(
        key, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats)
    combined_x = torch.ops.epx.low_latency_combine(
        key, expert_out, topk_idx, topk_weights, recv_src_info, recv_layout_range, num_max_dispatch_tokens_per_rank,
        num_experts)

The compiler sees each call as one opaque op whose outputs' shapes, strides and dtypes it knows (no graph
break, no data-dependent shape); at run time the op makes the same native call as Buffer.low_latency_dispatch /
low_latency_combine (no hooks, no async event: the work is ordered on the current stream). The dispatch's handle
rides on its recv_src_info tensor, as on deep_ep's handle tuple, so a combine takes that tensor. An op call goes
through torch's dispatcher, which adds host time, and the dispatch allocates each output on its own (the
Buffer's Python path: a custom op's outputs may not share storage): eager code calls the Buffer (or deep_ep)
directly.

recv_x_scales is an empty float32 tensor without FP8. The ops keep no reference to a registered Buffer
(register holds it weakly; unregister forgets it).
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, Optional, Tuple

import torch

from ._ext import _epx
from ._util import EpxError
from .compat.deep_ep_handles import _attach, low_latency_handle

_BUFFERS: Dict[int, "weakref.ReferenceType[Any]"] = {}
# The dispatch op's outputs (torch.library reads the annotation: a tuple, not a list, whose outputs alias nothing).
_Outputs = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def register(buffer: Any) -> int:
    """The key the ops take for `buffer` (an epx.Buffer, or a deep_ep.Buffer: its epx.Buffer is registered)."""
    live = buffer._live() if hasattr(buffer, "_live") else buffer
    key = id(live)
    _BUFFERS[key] = weakref.ref(live)
    return key


def unregister(key: int) -> None:
    _BUFFERS.pop(key, None)


def _buffer(key: int) -> Any:
    # int(): torch.compile may trace the key (any int argument) as a symbol; the key is a constant of the graph.
    key = int(key)
    ref = _BUFFERS.get(key)
    live = ref() if ref is not None else None
    if live is None:
        raise EpxError(f"buffer = {key}: not a registered Buffer (epx.ops.register(buffer) gives the key)")
    return live


def _sizes(key: int, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
           num_experts: int, use_fp8: bool, use_ue8m0: bool) -> Tuple[int, int, int, int]:
    """(ranks, local experts, rows per expert, scale columns) of a dispatch's outputs, from the shapes alone: not
    the token count, which torch.compile may trace as a symbol (a decode loop's batch varies)."""
    live = _buffer(key)
    native_in = _epx.LowLatencyDispatchInput(
        num_tokens=0, num_topk=int(topk_idx.shape[1]), hidden=int(x.shape[1]),
        num_max_dispatch_tokens_per_rank=int(num_max_dispatch_tokens_per_rank), num_experts=int(num_experts),
        use_fp8=use_fp8, use_ue8m0=use_ue8m0)
    return (live.num_ranks, *live._low_latency_sizes(native_in))


@torch.library.custom_op("epx::low_latency_dispatch", mutates_args=("cumulative_local_expert_recv_stats",))
def low_latency_dispatch(buffer: int, x: torch.Tensor, topk_idx: torch.Tensor,
                         num_max_dispatch_tokens_per_rank: int, num_experts: int,
                         cumulative_local_expert_recv_stats: Optional[torch.Tensor], use_fp8: bool = True,
                         round_scale: bool = False, use_ue8m0: bool = False) -> _Outputs:
    """(recv_x, recv_x_scales, recv_count, recv_src_info, recv_layout_range): Buffer.low_latency_dispatch's.

    cumulative_local_expert_recv_stats (the one argument the op writes) has no default, None included: torch's
    dispatcher drops trailing arguments equal to their defaults before it calls a Python kernel, and torch 2.11's
    in-place bookkeeping for a custom op then indexes past the arguments it was given."""
    # Outputs in allocations of their own: a custom op's outputs may not share storage (torch checks).
    recv_x, recv_scales, recv_count, handle, _, _, src_info = _buffer(buffer)._low_latency_dispatch(
        x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats, None,
        use_fp8, round_scale, use_ue8m0, False, False, None, False, separate_outputs=True)
    if recv_scales is None:
        recv_scales = torch.empty(0, dtype=torch.float32, device=x.device)
    # The handle rides on recv_src_info, which it does not hold (a reference cycle otherwise).
    return recv_x, recv_scales, recv_count, _attach(src_info, handle), handle.recv_layout_range


@low_latency_dispatch.register_fake
def _(buffer: int, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
      num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor], use_fp8: bool = True,
      round_scale: bool = False, use_ue8m0: bool = False) -> _Outputs:
    num_ranks, num_local, num_rows, columns = _sizes(buffer, x, topk_idx, num_max_dispatch_tokens_per_rank,
                                                     num_experts, use_fp8, use_ue8m0)
    hidden = x.shape[1]
    recv_x = x.new_empty((num_local, num_rows, hidden), dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16)
    if use_fp8:  # [L, R*M, columns], column-major in the last two dimensions (as the real call makes it)
        recv_scales = x.new_empty_strided((num_local, num_rows, columns), (columns * num_rows, 1, num_rows),
                                          dtype=torch.int32 if use_ue8m0 else torch.float32)
    else:
        recv_scales = x.new_empty(0, dtype=torch.float32)
    return (recv_x, recv_scales, x.new_empty(num_local, dtype=torch.int32),
            x.new_empty((num_local, num_rows), dtype=torch.int32),
            x.new_empty((num_local, num_ranks), dtype=torch.int64))


@torch.library.custom_op("epx::low_latency_combine", mutates_args=())
def low_latency_combine(buffer: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                        recv_src_info: torch.Tensor, recv_layout_range: torch.Tensor,
                        num_max_dispatch_tokens_per_rank: int, num_experts: int,
                        use_logfmt: bool = False) -> torch.Tensor:
    """combined_x [T, H] BF16: Buffer.low_latency_combine's for the dispatch whose recv_src_info this is."""
    native_handle, src_info = low_latency_handle((recv_src_info,))
    combined, _, _ = _buffer(buffer)._low_latency_combine(x, topk_idx, topk_weights, native_handle, src_info,
                                                          use_logfmt, False, False, False, None, None, False, False)
    return combined


@low_latency_combine.register_fake
def _(buffer: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
      recv_src_info: torch.Tensor, recv_layout_range: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
      num_experts: int, use_logfmt: bool = False) -> torch.Tensor:
    return x.new_empty((topk_idx.shape[0], x.shape[-1]), dtype=torch.bfloat16)


__all__ = ["low_latency_combine", "low_latency_dispatch", "register", "unregister"]
