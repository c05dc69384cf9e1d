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
Normal mode across nodes (the Buffer spans nodes), DeepEP's internode order (N nodes, C channels, T tokens):
  0 is_token_in_rank                 bool [T, R] (EPX's copy of the dispatch's; carries EPX's handle).
  1 rdma_channel_prefix_matrix       int32 [N, C]: [n][c] = tokens of channels 0..c that go to node n (a token
                                     counted once per node).
  2 gbl_channel_prefix_matrix        int32 [R, C]: [r][c] = tokens of channels 0..c that go to rank r.
  3 recv_rdma_channel_prefix_matrix  int32 [N, C]: [n][c] = records this rank received (as the rail peer) from
                                     node n on channels 0..c.
  4 recv_rdma_rank_prefix_sum        int32 [N]: records received from nodes 0..n.
  5 recv_gbl_channel_prefix_matrix   int32 [R, C]: [r][c] = first row of source r's channel c in recv_x.
  6 recv_gbl_rank_prefix_sum         int32 [R]: rows received from ranks 0..r (DeepEP's tests read it).
  7 recv_src_meta                    uint8 [rows, 8]: two int32 per row, the source rank's node (DeepEP's
                                     src_rdma_rank) and -1 (placeholder: DeepEP's bits of the local ranks that got
                                     the token, which the receiver of an EPX dispatch does not learn).
  8 send_rdma_head                   int32 [T, N]: token t's entry in its channel's stream to node n, -1 where
                                     it went to none of n's ranks (DeepEP: its slot in the channel's ring).
  9 send_nvl_head                    int32 [records, 8]: placeholder, all -1, with one row per record this rank
                                     forwards (DeepEP's shape: its rows count the tokens received over the
                                     network). EPX keeps each record's bitmask of local ranks instead
                                     (DispatchHandle.forward_mask, written by the dispatch itself).
  Elements 1-7 and 9 are made on the comm stream right after the count exchange, so the call's event covers them.
Low-latency mode: (recv_src_info int32 [L, R*M], recv_layout_range int64 [L, R] as begin << 32 | count,
num_max_dispatch_tokens_per_rank, hidden, num_experts).
"""

from __future__ import annotations

from typing import Any, List, Tuple

from ..results import DispatchHandle, LowLatencyHandle
from .._util import EpxError, torch

# Attribute on a handle tuple's first tensor that holds EPX's handle.
_ATTRIBUTE = "_epx_handle"


def _attach(tensor: Any, handle: Any) -> Any:
    setattr(tensor, _ATTRIBUTE, handle)
    return tensor


def _attach_to_alias(tensor: Any, handle: Any) -> Any:
    """`tensor` as a new tensor object over the same memory, carrying `handle`: for a tensor the handle holds
    itself (one of its views), which carrying the handle would make a reference cycle (freed only by the garbage
    collector, with the handle's device arrays)."""
    return _attach(tensor.detach(), handle)


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


# DeepEP's NUM_MAX_NVL_PEERS (columns of send_nvl_head) and internode::get_source_meta_bytes() (recv_src_meta).
_NVL_PEERS = 8
_SOURCE_META_BYTES = 8


def _channel_prefix(t: Any, in_dest: Any, num_channels: int) -> Any:
    """int32 [D, C]: [d][c] = tokens of channels 0..c with in_dest[token, d] set; channel c holds tokens
    [c * ceil(T / C), (c + 1) * ceil(T / C)) (EPX's channel_token_range, DeepEP's split too)."""
    num_tokens, num_dests = in_dest.shape
    per_channel = -(-num_tokens // num_channels)
    padded = t.zeros(num_channels * per_channel, num_dests, dtype=t.int32, device=in_dest.device)
    padded[:num_tokens] = in_dest.to(t.int32)
    counts = padded.view(num_channels, per_channel, num_dests).sum(1, dtype=t.int32)
    return counts.cumsum(0, dtype=t.int32).t().contiguous()


def internode_matrices(handle: Any, ranks_per_node: int) -> List[Any]:
    """Elements 1-7 and 9 of the internode handle tuple (the module docstring says what each holds), from the
    counts and routing of `handle` (an epx DispatchHandle across nodes, or anything with its fields). Reads only
    what the count exchange wrote, so it may run right after it."""
    t = torch()
    num_ranks, num_channels, num_nodes = handle.num_ranks, handle.num_channels, handle.num_nodes
    offsets = handle.recv_channel_offset  # [R * C + 1] first received rows, source-major
    node_offsets = handle.node_channel_offset  # [N * C + 1] first forwarded records, node-major
    device = offsets.device
    in_rank = handle.is_token_in_rank
    in_node = in_rank.view(in_rank.size(0), num_nodes, ranks_per_node).any(2)
    rdma_channel_prefix = _channel_prefix(t, in_node, num_channels)
    gbl_channel_prefix = _channel_prefix(t, in_rank, num_channels)
    node_starts = node_offsets[: num_nodes * num_channels].view(num_nodes, num_channels)
    recv_rdma_channel_prefix = node_offsets[1:].view(num_nodes, num_channels) - node_starts[:, :1]
    recv_rdma_rank_prefix_sum = node_offsets[num_channels::num_channels].clone()
    recv_gbl_channel_prefix = offsets[: num_ranks * num_channels].view(num_ranks, num_channels).clone()
    recv_gbl_rank_prefix_sum = offsets[num_channels::num_channels].clone()
    rows = handle.num_recv_rows
    src_rank = t.searchsorted(recv_gbl_rank_prefix_sum, t.arange(rows, dtype=t.int32, device=device), right=True)
    meta = t.full((rows, 2), -1, dtype=t.int32, device=device)
    meta[:, 0] = (src_rank // ranks_per_node).to(t.int32)
    recv_src_meta = meta.view(t.uint8).view(rows, _SOURCE_META_BYTES)
    send_nvl_head = t.full((handle.num_forward_records, _NVL_PEERS), -1, dtype=t.int32, device=device)
    return [rdma_channel_prefix, gbl_channel_prefix, recv_rdma_channel_prefix, recv_rdma_rank_prefix_sum,
            recv_gbl_channel_prefix, recv_gbl_rank_prefix_sum, recv_src_meta, send_nvl_head]


def internode_handle_tuple(handle: Any, matrices: List[Any]) -> Tuple[Any, ...]:
    """DeepEP's 10-element internode handle over `handle`, with `matrices` from internode_matrices."""
    (rdma_channel_prefix, gbl_channel_prefix, recv_rdma_channel_prefix, recv_rdma_rank_prefix_sum,
     recv_gbl_channel_prefix, recv_gbl_rank_prefix_sum, recv_src_meta, send_nvl_head) = matrices
    return (_attach_to_alias(handle.is_token_in_rank, handle), rdma_channel_prefix, gbl_channel_prefix,
            recv_rdma_channel_prefix, recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix, recv_gbl_rank_prefix_sum,
            recv_src_meta, handle.send_head, send_nvl_head)


class NormalHandleBuilder:
    """after_counts for epx.Buffer.dispatch across nodes: queues the internode matrices on the comm stream right
    after the count exchange (so the call's event covers them), then builds DeepEP's internode tuple once the
    dispatch returns. Within one node no builder is needed (normal_handle_tuple): the count exchange writes
    DeepEP's matrices itself."""

    def __init__(self) -> None:
        self.matrices: List[Any] = []

    def __call__(self, handle: DispatchHandle) -> List[Any]:
        self.matrices = internode_matrices(handle, handle.num_ranks // handle.num_nodes)
        return self.matrices

    def tuple_for(self, handle: DispatchHandle) -> Tuple[Any, ...]:
        return internode_handle_tuple(handle, self.matrices)


def normal_handle_tuple(handle: DispatchHandle, head: Any = None) -> Tuple[Any, ...]:
    """DeepEP's 6-element intranode handle over `handle` (a dispatch within one node): views of the matrices its
    count exchange wrote (DispatchHandle.deep_ep_matrices) and of its arrays. `head`: a tensor over
    rank_prefix_matrix that the handle does not hold, made with the call (else one is made here), to carry it."""
    rank_prefix, channel_prefix, recv_channel_prefix = handle.deep_ep_matrices
    head = _attach_to_alias(rank_prefix, handle) if head is None else _attach(head, handle)
    return head, channel_prefix, recv_channel_prefix, handle.recv_src_idx, handle.is_token_in_rank, handle.send_head


def normal_handle(handle: Any) -> DispatchHandle:
    """EPX's handle behind a normal-mode handle tuple (or an EPX handle itself)."""
    return _find(handle, DispatchHandle, "dispatch")


# ---- Low-latency mode ----


def low_latency_handle_tuple(handle: LowLatencyHandle, recv_src_info: Any) -> Tuple[Any, ...]:
    """DeepEP's tuple over `handle`, a LowLatencyHandle made without recv_src_info (the tuple's first tensor,
    which carries the handle: the handle holding it too would be a reference cycle, freed only by the garbage
    collector)."""
    return (_attach(recv_src_info, handle), handle.recv_layout_range, handle.num_max_dispatch_tokens_per_rank,
            handle.hidden, handle.num_experts)


def low_latency_handle(handle: Any) -> Tuple[LowLatencyHandle, Any]:
    """(EPX's handle, its dispatch's recv_src_info) behind a low-latency handle tuple (or an EPX handle itself)."""
    found = _find(handle, LowLatencyHandle, "low_latency_dispatch")
    return found, (found.recv_src_info if found is handle else handle[0])
