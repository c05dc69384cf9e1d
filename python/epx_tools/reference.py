"""The CPU reference of EPX through the binding: the oracle the tests compare the GPU against, with numpy
arrays shaped like the GPU outputs. BF16 values are carried as uint16 bits, FP8 e4m3 as uint8 bytes.

Every function simulates all R ranks in one process: inputs are per-rank lists, outputs are per destination
rank. ``native`` is the raw binding (epx._epx.reference) with the seeded test-data generators.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from epx._ext import _epx

native = _epx.reference

# ---- BF16 bits <-> float32, and torch bridges ----


def bf16_to_float(bits: np.ndarray) -> np.ndarray:
    """float32 values of BF16 bits (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def float_to_bf16(values: np.ndarray) -> np.ndarray:
    """BF16 bits of float32 values, rounded to nearest even (NaN stays NaN)."""
    bits = np.asarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(values, dtype=np.float32))
    return np.where(nan, np.uint16(0x7FC0), rounded)


def to_torch_bf16(bits: np.ndarray, device: Any = None) -> Any:
    """A torch.bfloat16 tensor with these bits."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(bits, dtype=np.uint16).view(np.int16)).view(torch.bfloat16).to(device)


def bf16_bits(tensor: Any) -> np.ndarray:
    """The uint16 bits of a torch.bfloat16 tensor (copied to the host)."""
    import torch

    return tensor.detach().contiguous().view(torch.int16).cpu().numpy().view(np.uint16)


def to_torch_fp8(data: np.ndarray, device: Any = None) -> Any:
    """A torch.float8_e4m3fn tensor with these bytes."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8)).view(torch.float8_e4m3fn).to(device)


def fp8_bytes(tensor: Any) -> np.ndarray:
    """The bytes of a torch.float8_e4m3fn tensor (copied to the host)."""
    import torch

    return tensor.detach().contiguous().view(torch.uint8).cpu().numpy()


# ---- Layout ----


def dispatch_layout(topk_idx: np.ndarray, num_experts: int,
                    num_ranks: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(num_tokens_per_rank int32 [R], num_tokens_per_expert int32 [E], is_token_in_rank bool [T, R]) of one
    rank's top-k ids [T, K]."""
    ids = np.ascontiguousarray(topk_idx, dtype=np.int64)
    num_tokens, num_topk = ids.shape
    layout = native.get_dispatch_layout(ids.reshape(-1), num_tokens, num_topk, num_experts, num_ranks)
    in_rank = layout.is_token_in_rank.reshape(num_tokens, num_ranks).astype(bool)
    return layout.num_tokens_per_rank, layout.num_tokens_per_expert, in_rank


def tokens_per_node(topk_idx: np.ndarray, num_experts: int, num_ranks: int, ranks_per_node: int) -> np.ndarray:
    """num_tokens_per_rdma_rank int32 [num_ranks / ranks_per_node] of one rank's top-k ids [T, K]: tokens with
    at least one expert on each node (once per node); empty when the ranks form one node."""
    ids = np.ascontiguousarray(topk_idx, dtype=np.int64)
    num_tokens, num_topk = ids.shape
    return native.get_dispatch_layout(ids.reshape(-1), num_tokens, num_topk, num_experts, num_ranks,
                                      ranks_per_node).num_tokens_per_rdma_rank


# ---- Normal mode ----


@dataclass
class NormalRankInput:
    """One source rank's dispatch input (numpy; None = not given)."""

    x: Optional[np.ndarray] = None  # BF16 bits [T, H]
    x_fp8: Optional[np.ndarray] = None  # uint8 [T, H]
    x_scales: Optional[np.ndarray] = None  # float32 [T, H / 128]
    topk_idx: Optional[np.ndarray] = None  # int64 [T, K]
    topk_weights: Optional[np.ndarray] = None  # float32 [T, K]
    is_token_in_rank: Optional[np.ndarray] = None  # bool [T, R] (required without top-k)
    num_tokens_per_expert: Optional[np.ndarray] = None  # int32 [E]


@dataclass
class NormalRankOutput:
    """What one destination rank receives, shaped."""

    num_recv_tokens: int
    num_rows: int
    recv_x: Optional[np.ndarray]  # BF16 bits [rows, H]
    recv_x_fp8: Optional[np.ndarray]  # uint8 [rows, H]
    recv_x_scales: Optional[np.ndarray]  # float32 [rows, H / 128]
    recv_topk_idx: Optional[np.ndarray]  # int64 [rows, K] local ids
    recv_topk_weights: Optional[np.ndarray]  # float32 [rows, K]
    num_recv_tokens_per_expert_list: List[int]
    recv_src_rank: np.ndarray  # int32 [rows]
    recv_src_token_idx: np.ndarray  # int32 [rows]
    num_recv_tokens_per_rank: np.ndarray  # int32 [R]


def normal_dispatch(inputs: Sequence[NormalRankInput], *, num_ranks: int, num_experts: int, hidden: int,
                    fp8: bool = False, expert_alignment: int = 1, num_worst_tokens: int = 0
                    ) -> Tuple[List[NormalRankOutput], Any]:
    """Normal-mode dispatch of every rank's tokens: (per destination rank outputs, handle for
    normal_combine). Top-k routing is used when inputs carry topk_idx."""
    with_topk = inputs[0].topk_idx is not None
    num_topk = np.asarray(inputs[0].topk_idx).shape[1] if with_topk else 0
    params = native.NormalDispatchParams(
        num_ranks=num_ranks, num_experts=num_experts, hidden=hidden,
        format=native.PayloadFormat.FP8 if fp8 else native.PayloadFormat.BF16, with_topk=with_topk,
        num_topk=num_topk, expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens)
    native_inputs = []
    for rank_input in inputs:
        data = rank_input.x_fp8 if fp8 else rank_input.x
        item = native.NormalDispatchRankInput(num_tokens=int(np.asarray(data).shape[0]))
        for name in ("x", "x_fp8", "x_scales", "topk_idx", "topk_weights", "num_tokens_per_expert"):
            value = getattr(rank_input, name)
            if value is not None:
                setattr(item, name, np.asarray(value).reshape(-1))
        if rank_input.is_token_in_rank is not None:
            item.is_token_in_rank = np.asarray(rank_input.is_token_in_rank, dtype=np.uint8).reshape(-1)
        native_inputs.append(item)
    result = native.normal_dispatch(params, native_inputs)
    outputs = []
    for out in result.ranks:
        rows = out.num_rows
        outputs.append(NormalRankOutput(
            num_recv_tokens=out.num_recv_tokens, num_rows=rows,
            recv_x=None if fp8 else out.recv_x.reshape(rows, hidden),
            recv_x_fp8=out.recv_x_fp8.reshape(rows, hidden) if fp8 else None,
            recv_x_scales=out.recv_x_scales.reshape(rows, hidden // 128) if fp8 else None,
            recv_topk_idx=out.recv_topk_idx.reshape(rows, num_topk) if with_topk else None,
            recv_topk_weights=out.recv_topk_weights.reshape(rows, num_topk) if with_topk else None,
            num_recv_tokens_per_expert_list=[int(v) for v in out.num_recv_tokens_per_expert_list],
            recv_src_rank=out.recv_src_rank, recv_src_token_idx=out.recv_src_token_idx,
            num_recv_tokens_per_rank=out.num_recv_tokens_per_rank))
    return outputs, result.handle


def normal_combine(handle: Any, x: Sequence[np.ndarray], *, topk_weights: Optional[Sequence[np.ndarray]] = None,
                   bias0: Optional[Sequence[np.ndarray]] = None, bias1: Optional[Sequence[np.ndarray]] = None,
                   ranks_per_node: Optional[int] = None) -> List[Tuple[np.ndarray, Optional[np.ndarray]]]:
    """Normal-mode combine: per rank (combined_x BF16 bits [T, H], combined_topk_weights [T, K] or None).
    x[r] is rank r's [rows, H] BF16 bits in its dispatch output order. With ranks_per_node, the reduction
    order across nodes of that many ranks (src/reference/internode.hpp: each node's partial rounded to BF16
    once, then the nodes in order, then the biases)."""
    num_topk = np.asarray(topk_weights[0]).shape[1] if topk_weights is not None else 0
    num_biases = (bias0 is not None) + (bias1 is not None)
    params = native.NormalCombineParams(num_topk=num_topk, num_biases=num_biases)
    native_inputs = []
    for r in range(handle.num_ranks):
        item = native.NormalCombineRankInput(x=np.asarray(x[r]).reshape(-1))
        if topk_weights is not None:
            item.topk_weights = np.asarray(topk_weights[r]).reshape(-1)
        if bias0 is not None:
            item.bias0 = np.asarray(bias0[r]).reshape(-1)
        if bias1 is not None:
            item.bias1 = np.asarray(bias1[r]).reshape(-1)
        native_inputs.append(item)
    outputs = []
    combined = native.normal_combine(handle, params, native_inputs) if ranks_per_node is None else \
        native.internode_combine(handle, ranks_per_node, params, native_inputs)
    for r, out in enumerate(combined):
        tokens = handle.num_tokens[r]
        weights = out.combined_topk_weights.reshape(tokens, num_topk) if num_topk > 0 else None
        outputs.append((out.combined_x.reshape(tokens, handle.hidden), weights))
    return outputs


# ---- Low-latency mode ----


@dataclass
class LowLatencyRankOutput:
    """What one rank receives in low-latency dispatch, shaped like the GPU outputs."""

    recv_x: np.ndarray  # [L, R*M, H]: BF16 bits, or FP8 bytes with use_fp8
    recv_x_scales: Optional[np.ndarray]  # [L, R*M, G]: float32, or uint32 words with UE8M0 (a transposed view)
    recv_count: np.ndarray  # int32 [L]
    recv_src_rank: np.ndarray  # int32 [L, R*M], -1 unused
    recv_src_token_idx: np.ndarray  # int32 [L, R*M], -1 unused


def low_latency_params(*, num_ranks: int, num_experts: int, hidden: int, num_topk: int,
                       num_max_dispatch_tokens_per_rank: int, masked_ranks: Sequence[int] = ()) -> Any:
    """masked_ranks: ranks every other rank masked (rank masks): they take no part, their experts receive
    nothing and combine leaves them out."""
    params = native.LowLatencyParams(num_ranks=num_ranks, num_experts=num_experts, hidden=hidden,
                                     num_topk=num_topk,
                                     num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank)
    params.masked_ranks = [int(r) for r in masked_ranks]
    return params


def low_latency_dispatch(x: Sequence[np.ndarray], topk_idx: Sequence[np.ndarray], params: Any, *,
                         use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                         cumulative_local_expert_recv_stats: Optional[List[np.ndarray]] = None
                         ) -> List[LowLatencyRankOutput]:
    """Low-latency dispatch of every rank's BF16 tokens x[r] [T_r, H] with top-k ids [T_r, K]."""
    options = native.LowLatencyDispatchOptions(use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0)
    inputs = [native.LowLatencyDispatchRankInput(num_tokens=int(np.asarray(xr).shape[0]),
                                                 x=np.asarray(xr).reshape(-1), topk_idx=np.asarray(ir).reshape(-1))
              for xr, ir in zip(x, topk_idx)]
    outputs = native.low_latency_dispatch(params, options, inputs, cumulative_local_expert_recv_stats)
    num_local = params.num_experts // params.num_ranks
    rows = params.num_ranks * params.num_max_dispatch_tokens_per_rank
    hidden = params.hidden
    shaped = []
    for out in outputs:
        if not use_fp8:
            recv_x, scales = out.recv_x.reshape(num_local, rows, hidden), None
        elif use_ue8m0:
            words = native.ll_num_ue8m0_words(hidden)
            recv_x = out.recv_x_fp8.reshape(num_local, rows, hidden)
            scales = out.recv_x_scales_ue8m0.reshape(num_local, words, rows).transpose(0, 2, 1)
        else:
            recv_x = out.recv_x_fp8.reshape(num_local, rows, hidden)
            scales = out.recv_x_scales.reshape(num_local, hidden // 128, rows).transpose(0, 2, 1)
        shaped.append(LowLatencyRankOutput(recv_x, scales, out.recv_count,
                                           out.recv_src_rank.reshape(num_local, rows),
                                           out.recv_src_token_idx.reshape(num_local, rows)))
    return shaped


def low_latency_combine(x: Sequence[np.ndarray], topk_idx: Sequence[np.ndarray], topk_weights: Sequence[np.ndarray],
                        params: Any, *, use_logfmt: bool = False, pre_reduce: bool = False,
                        logfmt_within_node: bool = False, ranks_per_node: int = 0) -> List[np.ndarray]:
    """Weighted low-latency combine: per rank combined_x BF16 bits [T_r, H]. x[r] is rank r's expert outputs
    [L, R*M, H] (BF16 bits) in its dispatch layout. pre_reduce: the order of the pre-reduced combine.
    use_logfmt codes the rows between nodes of ranks_per_node ranks (0: one node), and with
    logfmt_within_node every row."""
    options = native.LowLatencyCombineOptions(use_logfmt=use_logfmt)
    options.pre_reduce = pre_reduce
    options.logfmt_within_node = logfmt_within_node
    options.ranks_per_node = ranks_per_node
    inputs = [native.LowLatencyCombineRankInput(num_tokens=int(np.asarray(ir).shape[0]), x=np.asarray(xr).reshape(-1),
                                                topk_idx=np.asarray(ir).reshape(-1),
                                                topk_weights=np.asarray(wr).reshape(-1))
              for xr, ir, wr in zip(x, topk_idx, topk_weights)]
    return [out.combined_x.reshape(-1, params.hidden) for out in native.low_latency_combine(params, options, inputs)]
