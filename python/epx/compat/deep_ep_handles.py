"""DeepEP's handles as tuples over EPX's handles.

DeepEP returns its handles as tuples of tensors, which callers pass back unchanged and which tests and some
frameworks read. EPX builds the same tuples, with DeepEP's element meanings where EPX has the data, and finds
its own handle again from the tuple's first tensor (an attribute on it), so a tuple rebuilt from the same
tensors also works.

Normal mode (intranode), DeepEP's order:
  0 rank_prefix_matrix          int32 [R, R]: [i][j] = rows rank j receives from ranks 0..i. Only this rank's
                                column is known here (EPX's count exchange tells each rank its own receive
                                counts, and DeepEP's kernels and tests read only that column): the other
                                entries are -1.
  1 channel_prefix_matrix       int32 [R, C]: placeholder, all -1 (EPX keeps no per-channel send counts; the
                                send side uses send_head).
  2 recv_channel_prefix_matrix  int32 [R, C]: [r][c] = first row of source r's channel c, counted from source
                                r's first row.
  3 recv_src_idx                int32 [N]: source token index of each received row.
  4 is_token_in_rank            bool [T, R].
  5 send_head                   int32 [T, R]: position of token t in its channel's stream to rank r, -1 where it
                                was not sent (DeepEP: its slot in the channel's ring, -1 likewise).
Low-latency mode: (recv_src_info int32 [L, R*M], recv_layout_range int64 [L, R] as begin << 32 | count,
num_max_dispatch_tokens_per_rank, hidden, num_experts).
"""

from __future__ import annotations

import dataclasses

from typing import Any, List, Tuple

from ..results import DispatchHandle, LowLatencyHandle
from .._util import EpxError, torch

# Attribute on a handle tuple's first tensor that holds EPX's handle.
_ATTRIBUTE = "_epx_handle"


def _attach(tensor: Any, handle: Any) -> Any:
    setattr(tensor, _ATTRIBUTE, handle)
    return tensor


def _find(handle: Any, kind: type, call: str) -> Any:
    if isinstance(handle, kind):
        return handle  # EPX's own handle, as epx.Buffer returns it
    if isinstance(handle, (tuple, list)) and len(handle) > 0:
        found = getattr(handle[0], _ATTRIBUTE, None)
        if isinstance(found, kind):
            return found
    raise EpxError(f"invalid handle = {type(handle).__name__}: must be the handle tuple {call} returned (its first "
                   "tensor carries EPX's handle)")


# ---- Normal mode ----


class NormalHandleBuilder:
    """after_counts for epx.Buffer.dispatch: queues the derived matrices on the comm stream right after the count
    exchange (so the call's event covers them), then builds the tuple once the dispatch returns."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.matrices: List[Any] = []

    def __call__(self, handle: DispatchHandle) -> List[Any]:
        t = torch()
        num_ranks, num_channels = handle.num_ranks, handle.num_channels
        offsets = handle.recv_channel_offset  # [R * C + 1] absolute first rows, source-major
        device = offsets.device
        rank_prefix = t.empty(num_ranks, num_ranks, dtype=t.int32, device=device).fill_(-1)
        # Rows from ranks 0..i end where source i + 1 begins.
        rank_prefix[:, self.rank] = offsets[num_channels::num_channels]
        starts = offsets[: num_ranks * num_channels].view(num_ranks, num_channels)
        recv_channel_prefix = starts - starts[:, :1]
        channel_prefix = t.empty(num_ranks, num_channels, dtype=t.int32, device=device).fill_(-1)
        self.matrices = [rank_prefix, channel_prefix, recv_channel_prefix]
        return self.matrices

    def tuple_for(self, handle: DispatchHandle) -> Tuple[Any, ...]:
        rank_prefix, channel_prefix, recv_channel_prefix = self.matrices
        return (_attach(rank_prefix, handle), channel_prefix, recv_channel_prefix, handle.recv_src_idx,
                handle.is_token_in_rank, handle.send_head)


def normal_handle(handle: Any) -> DispatchHandle:
    """EPX's handle behind a normal-mode handle tuple (or an EPX handle itself)."""
    return _find(handle, DispatchHandle, "dispatch")


# ---- Low-latency mode ----


def low_latency_handle_tuple(handle: LowLatencyHandle) -> Tuple[Any, ...]:
    # The attached copy leaves recv_src_info out: a tensor holding a handle that holds the tensor would be a
    # reference cycle, freed only by the garbage collector.
    detached = dataclasses.replace(handle, recv_src_info=None)
    return (_attach(handle.recv_src_info, detached), handle.recv_layout_range,
            handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts)


def low_latency_handle(handle: Any) -> LowLatencyHandle:
    """EPX's handle behind a low-latency handle tuple (or an EPX handle itself)."""
    found = _find(handle, LowLatencyHandle, "low_latency_dispatch")
    if found.recv_src_info is None:
        found = dataclasses.replace(found, recv_src_info=handle[0])
    return found
