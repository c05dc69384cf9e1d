"""Config and the buffer size hints."""

from __future__ import annotations

from ._ext import _epx
from ._util import EpxError, check


def normal_nvl_buffer_size_hint(hidden_bytes: int, num_ranks: int,
                                max_tokens_per_rank: int = _epx.DEFAULT_MAX_TOKENS_PER_RANK) -> int:
    """NVLink buffer bytes per rank for normal mode: max_tokens_per_rank tokens of hidden_bytes (hidden * 2)
    with up to 16 top-k and FP8 scales, a multiple of 2 MiB."""
    return _epx.normal_nvl_buffer_size_hint(hidden_bytes, num_ranks, max_tokens_per_rank)


def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                   num_experts: int) -> int:
    """Low-latency buffer bytes per rank (``num_rdma_bytes`` of a low-latency Buffer), a multiple of 2 MiB."""
    return _epx.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)


class Config:
    """Performance settings of a normal-mode call, with DeepEP V1's fields.

    EPX uses ``num_sms`` (the SM budget of the normal-mode kernels). Its kernels need no chunking, so the four
    chunk sizes are accepted and kept for compatibility but do not change what runs.
    """

    __slots__ = ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                 "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens")

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        values = (num_sms, num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens,
                  num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens)
        for name, value in zip(self.__slots__, values):
            check(isinstance(value, int) and not isinstance(value, bool), name, repr(value), "must be an int")
            check(value > 0, name, value, "must be > 0")
            object.__setattr__(self, name, value)

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """NVLink buffer bytes per rank for normal mode (see normal_nvl_buffer_size_hint)."""
        return normal_nvl_buffer_size_hint(hidden_bytes, num_ranks)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """RDMA buffer bytes per rank for normal mode: 0 within one NVLink domain (up to 8 ranks)."""
        check(num_ranks >= 1, "num_ranks", num_ranks, "must be >= 1")
        if num_ranks <= _epx.MAX_NVL_RANKS:
            return 0
        raise EpxError(
            f"invalid num_ranks = {num_ranks}: normal mode across NVLink domains (more than "
            f"{_epx.MAX_NVL_RANKS} ranks) is not implemented yet"
        )

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)}" for name in self.__slots__)
        return f"Config({fields})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and all(getattr(self, n) == getattr(other, n) for n in self.__slots__)

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, n) for n in self.__slots__))
