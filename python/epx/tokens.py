"""Token and routing inputs as callers produce them, made into what the kernels move.

The kernels move rows of raw bytes (16-byte accesses) and 4-byte scale words, so the torch layer accepts more
than their fixed layouts: any token dtype whose rows are a multiple of 16 bytes (moved as BF16-sized units and
viewed back), FP8 scales of any strides (column-major or TMA-aligned from DeepGEMM-style casts: made
contiguous here), any number of scale columns (per 128 channels, per token [T, 1], UE8M0 bytes packed into
int32 [T, ceil(H / 512)]), and int32 top-k ids (widened to int64 here).
"""

from __future__ import annotations

from typing import Any, Optional

from ._util import check_tensor, error, torch


class SplitTokens:
    """A dispatch's tokens in the kernels' terms, and how to give the caller back its own dtype."""

    __slots__ = ("data", "scales", "fp8", "caller_dtype", "num_scales")

    def __init__(self, data: Any, scales: Optional[Any], fp8: bool, caller_dtype: Any) -> None:
        self.data = data  # [T, hidden] contiguous: BF16 (or another dtype viewed as BF16), or 1-byte FP8 rows
        self.scales = scales  # FP8: float32 or int32 [T, num_scales], contiguous; else None
        self.fp8 = fp8
        self.caller_dtype = caller_dtype  # the dtype recv_x is viewed back as
        self.num_scales = 0 if scales is None else scales.size(1)

    def recv_view(self, recv_x: Any) -> Any:
        """recv_x [N, hidden] in the kernels' dtype, viewed as the caller's dtype."""
        return recv_x if recv_x.dtype == self.caller_dtype else recv_x.view(self.caller_dtype)


def split_tokens(x: Any) -> SplitTokens:
    """A BF16 tensor, a tensor of another dtype with 16-byte rows, or an (FP8 data, scales) pair, checked."""
    t = torch()
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise error("x", f"a tuple of {len(x)}", "must be a tensor or an (FP8 x, scales) pair")
        data, scales = x
        check_tensor(data, "x[0]", ndim=2)
        num_tokens = data.size(0)
        if (data.size(1) * data.element_size()) % 16 != 0:
            raise error("x[0].shape", tuple(data.shape),
                        f"rows must be a multiple of 16 bytes ({data.element_size()}-byte elements)")
        check_tensor(scales, "x[1]", ndim=2, shape=(num_tokens, None), contiguous=False)
        if scales.dtype != t.float32 and scales.dtype != t.int32:
            raise error("x[1].dtype", scales.dtype,
                        "must be torch.float32 (scales) or torch.int32 (UE8M0 scales packed four per word)")
        if scales.size(1) < 1:
            raise error("x[1].shape", tuple(scales.shape), "must have at least one scale per token")
        # The kernels read [T, num_scales] words row by row: column-major or padded scales are copied.
        scales = scales.contiguous()
        moved = data if data.element_size() == 1 else data.view(t.uint8)
        return SplitTokens(moved, scales, True, data.dtype)
    check_tensor(x, "x", ndim=2)
    if x.dtype == t.bfloat16:
        return SplitTokens(x, None, False, x.dtype)
    if (x.size(1) * x.element_size()) % 16 != 0:
        raise error("x.shape", tuple(x.shape),
                    f"rows must be a multiple of 16 bytes to be moved as raw bytes ({x.dtype}); pass BF16, or an "
                    "(FP8 x, scales) pair")
    return SplitTokens(x.view(t.bfloat16), None, False, x.dtype)


def as_topk_idx(topk_idx: Any, name: str = "topk_idx", shape: Optional[tuple] = None) -> Any:
    """topk_idx as int64 [T, K]; int32 ids (DeepEP built with 32-bit topk_idx_t) are widened."""
    t = torch()
    check_tensor(topk_idx, name, ndim=2, shape=shape)
    dtype = topk_idx.dtype
    if dtype == t.int64:
        return topk_idx
    if dtype != t.int32:
        raise error(f"{name}.dtype", dtype, "must be torch.int64 or torch.int32")
    return topk_idx.to(t.int64)
