"""Named results of the epx.Buffer calls, and the handles dispatch returns for combine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

from . import _util
from .event import EventOverlap


class _view_once:
    """A property computed on first use and kept in the instance (the next reads find it there, with no call):
    functools.cached_property without its lock."""

    def __init__(self, compute: Callable[[Any], Any]) -> None:
        self.compute = compute
        self.name = compute.__name__
        self.__doc__ = compute.__doc__

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        value = self.compute(instance)
        instance.__dict__[self.name] = value
        return value


@dataclass
class DispatchLayout:
    """What get_dispatch_layout computes for this rank's tokens."""

    num_tokens_per_rank: Any  # int32 [R]: tokens with at least one expert on rank r (once per rank)
    num_tokens_per_rdma_rank: Optional[Any]  # int32 [nodes]: tokens per node (once per node); None within one node
    num_tokens_per_expert: Any  # int32 [E]
    is_token_in_rank: Any  # bool [T, R]
    event: EventOverlap


@dataclass(eq=False)
class DispatchHandle:
    """What combine and a cached dispatch need from a normal-mode dispatch (opaque to most users).

    ``native`` is the C++ handle (it owns the device arrays); the fields describe the dispatch it came from.
    """

    native: Any
    buffer_id: int  # id() of the epx.Buffer it came from
    num_tokens: int  # T: tokens this rank dispatched (rows of the combine output)
    num_recv_rows: int  # N: rows of recv_x (num_worst_tokens in worst-case mode)
    hidden: int
    num_experts: int
    num_topk: int  # 0 when dispatched without top-k
    num_worst_tokens: int
    num_recv_tokens_per_expert_list: List[int] = field(default_factory=list)
    num_ranks: int = 0  # R of the Buffer
    # Keeps the Buffer's views (recv_src_idx) valid.
    _owner: Any = field(default=None, repr=False)

    @property
    def num_recv_per_rank(self) -> List[int]:
        """Rows received from each source rank (empty in worst-case mode)."""
        return list(self.native.num_recv_per_rank)

    # Device views of the handle's arrays (they keep the handle's memory alive), each made once per handle on
    # first use. The dispatch writes them on the comm stream: read them in stream order after it (after its event
    # with async_finish).

    def _view(self, address: int, dtype_name: str, shape: tuple) -> Any:
        t = _util.torch()
        device = self._owner.device if self._owner is not None else t.device("cuda", t.cuda.current_device())
        return _util.array_view(address, getattr(t, dtype_name), shape, self.native, device)

    @_view_once
    def recv_src_idx(self) -> Any:
        """int32 [N]: the source token index of each received row (-1 for padding rows)."""
        return self._view(self.native.recv_src_idx, "int32", (self.num_recv_rows,))

    @property
    def num_channels(self) -> int:
        """Channels (num_sms / 2 of the dispatch's config) its tokens were split into."""
        return self.native.num_channels

    @_view_once
    def recv_channel_offset(self) -> Any:
        """int32 [R * C + 1]: first received row of each (source rank, channel), source-major; last: the rows."""
        return self._view(self.native.recv_channel_offset, "int32", (self.num_ranks * self.num_channels + 1,))

    @_view_once
    def send_head(self) -> Any:
        """int32 [T, R]: position of token t in its channel's stream to rank r, -1 where it was not sent. Across
        nodes [T, N]: its entry in its channel's stream to node n, -1 where it went to none of n's ranks."""
        columns = self.num_nodes if self.num_nodes > 1 else self.num_ranks
        return self._view(self.native.send_head, "int32", (self.num_tokens, columns))

    # Across nodes (num_nodes > 1): what the rail peers delivered to this rank, which it forwards over NVLink.

    @property
    def num_nodes(self) -> int:
        """Nodes the dispatch spanned (1 within one node)."""
        return self.native.num_nodes

    @property
    def num_forward_records(self) -> int:
        """Across nodes: records this rank forwards as the rail peer of their sources (its own node's included);
        0 within one node."""
        return self.native.num_forward_records

    @_view_once
    def node_channel_offset(self) -> Any:
        """Across nodes: int32 [N * C + 1], the first of those records from each (source node, channel),
        node-major, then their count; None within one node."""
        if self.num_nodes <= 1:
            return None
        return self._view(self.native.node_channel_offset, "int32", (self.num_nodes * self.num_channels + 1,))

    @_view_once
    def forward_mask(self) -> Any:
        """Across nodes: uint8 [num_forward_records], the local ranks each record went to (bit l: local rank l),
        written by the dispatch (read it after the call's event); None within one node."""
        if self.num_nodes <= 1:
            return None
        return self._view(self.native.forward_mask, "uint8", (self.num_forward_records,))

    @_view_once
    def deep_ep_matrices(self) -> Optional[Tuple[Any, Any, Any]]:
        """Within one node, DeepEP's (rank_prefix_matrix [R, R], channel_prefix_matrix [R, C],
        recv_channel_prefix_matrix [R, C]) of this dispatch, int32, written by its count exchange (epx.compat's
        handle tuple, where they are described); None across nodes."""
        address = self.native.deep_ep_matrices
        if self.num_nodes > 1 or not address:
            return None
        num_ranks, num_channels = self.num_ranks, self.num_channels
        cells = num_ranks * num_channels
        block = self._view(address, "int32", (num_ranks * num_ranks + 2 * cells,))
        rank_prefix, channel_prefix, recv_channel_prefix = block.split((num_ranks * num_ranks, cells, cells))
        return (rank_prefix.view(num_ranks, num_ranks), channel_prefix.view(num_ranks, num_channels),
                recv_channel_prefix.view(num_ranks, num_channels))

    @_view_once
    def is_token_in_rank(self) -> Any:
        """bool [T, R]: whether token t went to rank r."""
        return self._view(self.native.is_token_in_rank, "bool", (self.num_tokens, self.num_ranks))


@dataclass
class DispatchResult:
    """Output of a normal-mode dispatch. recv_x has the input's format: BF16, or FP8 with recv_x_scales."""

    recv_x: Any  # [N, H]
    recv_x_scales: Optional[Any]  # FP8 input: [N, S] of the input scales' dtype and columns, else None
    recv_topk_idx: Optional[Any]  # int64 [N, K] local expert ids, -1 elsewhere (None in cached mode)
    recv_topk_weights: Optional[Any]  # float32 [N, K], 0 where recv_topk_idx is -1
    num_recv_tokens_per_expert_list: List[int]  # [L], aligned to expert_alignment; empty in worst-case mode
    handle: DispatchHandle
    event: EventOverlap


@dataclass
class CombineResult:
    combined_x: Any  # BF16 [T, H]: the unweighted sum of the copies of each token, plus the biases
    combined_topk_weights: Optional[Any]  # float32 [T, K] when topk_weights were given
    event: EventOverlap


class RecvHook:
    """Completes a low-latency call made with ``return_recv_hook=True``: calling it launches the receive on
    the current stream. Runs once. Keeps the call's tensors alive until it has run."""

    def __init__(self, native: Any, keep_alive: tuple, device_index: Optional[int] = None) -> None:
        self._native = native
        self._keep_alive = keep_alive
        self._device_index = device_index  # the Buffer's device (None: the current device)

    @property
    def done(self) -> bool:
        return self._native.done

    def __call__(self) -> None:
        self._native(_util.current_stream_handle(self._device_index))
        self._keep_alive = ()  # the receive is in stream order now


@dataclass(eq=False)
class LowLatencyHandle:
    """What low_latency_combine needs from its low-latency dispatch (opaque to most users)."""

    native: Any  # the C++ LowLatencyHandle (plain values and the addresses of the tensors below)
    buffer_id: int
    recv_src_info: Any  # int32 [L, R*M]
    recv_topk_pos: Any  # int32 [L, R*M]
    recv_layout_range: Any  # int64 [L, R]: begin << 32 | count of each source's rows in each expert block
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    num_tokens: int
    num_topk: int
    # int32 [R, M, K, 2] (row, weight bits) of each source token's listings, with a dispatch given topk_weights
    # (what a pre_reduce combine needs); None otherwise
    recv_token_listings: Any = None


@dataclass
class LowLatencyDispatchResult:
    recv_x: Any  # [L, R*M, H]: float8_e4m3fn with use_fp8, else bfloat16
    recv_x_scales: Optional[Any]  # float32 [L, R*M, H/128] (int32 [L, R*M, ceil(H/512)] with UE8M0), column-major
    recv_count: Any  # int32 [L]: valid rows of each expert block
    handle: LowLatencyHandle
    event: EventOverlap
    hook: Optional[Callable[[], None]]  # with return_recv_hook


@dataclass
class LowLatencyCombineResult:
    combined_x: Any  # BF16 [T, H]: the weighted sum over each token's experts
    event: EventOverlap
    hook: Optional[Callable[[], None]]
