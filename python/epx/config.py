"""Config and the buffer size hints."""

from __future__ import annotations

import operator
from typing import Any, Optional, Tuple

from ._ext import _epx
from ._util import check


class Config:
    """Performance settings of a normal-mode call, with DeepEP V1's fields and meanings.

    Tokens stream from each rank to each other rank through bounded queues in the receiver's NVLink buffer,
    one per (source, destination, channel):

    - ``num_sms``: the SM budget. A call runs ``num_sms / 2`` channels (at least 1), each with one sending and
      one receiving block; a rank's tokens are split into one contiguous range per channel.
    - ``num_max_nvl_chunked_send_tokens``: the most records a sender writes into a queue before it publishes
      them to the receiver (one release per chunk).
    - ``num_max_nvl_chunked_recv_tokens``: the records one queue holds (its capacity). The NVLink buffer grows
      with it and with ``num_sms``, never with the number of tokens.
    - ``num_max_rdma_chunked_send_tokens``: normal mode across nodes: the most records a sender puts into a
      network queue before it publishes them to the receiving node (one put with signal per chunk).
    - ``num_max_rdma_chunked_recv_tokens``: the records one network queue holds, one queue per (source node,
      destination node, channel) in the receiving rank's symmetric buffer. That buffer grows with it and with
      ``num_sms``, never with the number of tokens.

    Rules (checked when the config is built, by the size hints and when a call uses it; EpxError names the
    field): every field >= 1, send chunk <= queue tokens (NVLink and network), at most 128 channels
    (num_sms <= 257).

    A Buffer's NVLink memory must hold the queues of every config its calls use: size it with the largest
    ``get_nvl_buffer_size_hint`` of those configs. A call whose queues do not fit raises EpxError naming the
    bytes it needs.
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
            object.__setattr__(self, name, value)
        _epx.validate_config(self.to_native())  # the C++ rules, naming the field

    def to_native(self) -> Any:
        """This config as the binding's ``_epx.Config`` (what ``_epx.Buffer.config`` takes)."""
        return _epx.Config(*(getattr(self, name) for name in self.__slots__))

    @classmethod
    def from_native(cls, native: Any) -> "Config":
        """A Config with the fields of an ``_epx.Config``."""
        return cls(*(getattr(native, name) for name in cls.__slots__))

    def num_channels(self) -> int:
        """Channels of a call with this config: num_sms / 2, at least 1."""
        return max(self.num_sms // 2, 1)

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """NVLink buffer bytes per rank that normal-mode calls with this config need, for rows of up to
        hidden_bytes (hidden * 2 for BF16) with up to 16 top-k on num_ranks ranks: the queues of every
        (source, channel) at num_max_nvl_chunked_recv_tokens records each, plus a fixed control area; a multiple
        of 128. It grows with num_sms and the queue tokens and does not depend on the number of tokens."""
        return _epx.normal_nvl_buffer_size_hint(hidden_bytes, num_ranks, self.to_native())

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int, ranks_per_node: int = 0) -> int:
        """Symmetric (NVSHMEM) buffer bytes per rank that normal-mode calls across nodes with this config need,
        for rows of up to hidden_bytes with up to 16 top-k: a receive queue of num_max_rdma_chunked_recv_tokens
        records per (node, channel) and a send ring as large per (other node, channel), plus fixed control and
        notify areas; a multiple of 128, independent of the number of tokens. Nodes are ranks_per_node consecutive
        ranks (0: DeepEP's convention, one node up to 8 ranks and nodes of 8 above); 0 within one node. A
        Buffer that also serves low-latency calls takes the larger of this and get_low_latency_rdma_size_hint."""
        return self.to_native().get_rdma_buffer_size_hint(hidden_bytes, num_ranks, ranks_per_node)

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)}" for name in self.__slots__)
        return f"Config({fields})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and all(getattr(self, n) == getattr(other, n) for n in self.__slots__)

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, n) for n in self.__slots__))


_CONFIG_TYPES = (Config, getattr(_epx, "Config", Config))  # _epx.Config has the same field names
_read_fields = operator.attrgetter(*Config.__slots__)  # one call for all of them, in __slots__ order


def config_fields(config: Any) -> Tuple[Any, ...]:
    """The fields of a config (an epx.Config or an _epx.Config) as a tuple; None for each that an object which is
    not a config lacks. The per-call path of every normal-mode call."""
    if isinstance(config, _CONFIG_TYPES):
        return _read_fields(config)
    return tuple(getattr(config, name, None) for name in Config.__slots__)


def native_config(config: Any) -> Any:
    """The ``_epx.Config`` of an epx.Config (or an ``_epx.Config`` itself)."""
    if isinstance(config, Config):
        return config.to_native()
    check(isinstance(config, _epx.Config), "config", type(config).__name__, "must be an epx.Config")
    return config


def normal_nvl_buffer_size_hint(hidden_bytes: int, num_ranks: int, config: Optional[Config] = None) -> int:
    """NVLink buffer bytes per rank for normal-mode calls with `config` (default: Config()), the same as
    ``config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks)``; independent of the number of tokens. For
    calls with several configs (DeepEP's dispatch and combine configs), take the largest."""
    native = _epx.Config() if config is None else native_config(config)
    return _epx.normal_nvl_buffer_size_hint(hidden_bytes, num_ranks, native)


# torch's caching allocator sizes its segments so (c10/cuda/CUDACachingAllocator.cpp): requests up to 1 MiB
# share 2 MiB segments, requests below 10 MiB take a 20 MiB segment, larger ones round up to 2 MiB.
_MIB = 1 << 20


def _torch_segment_bytes(nbytes: int) -> int:
    if nbytes <= 0:
        return 0
    if nbytes <= _MIB:
        return 2 * _MIB
    if nbytes < 10 * _MIB:
        return 20 * _MIB
    return -(-nbytes // (2 * _MIB)) * 2 * _MIB


def normal_nvl_output_bytes_hint(num_max_tokens_per_rank: int, hidden: int, num_ranks: int, num_topk: int = 0,
                                 fp8: bool = False, num_live: int = 1) -> int:
    """Output-window bytes per rank (``num_nvl_output_bytes``, or ``EPX_NVL_OUTPUT_BYTES`` for ``deep_ep``) that
    hold the outputs of `num_live` dispatches alive at once, each receiving at most every rank's
    `num_max_tokens_per_rank` tokens: recv_x (BF16, or FP8 with float32 scales per 128 columns) and, with
    `num_topk`, the top-k ids and weights, as torch's caching allocator sizes their segments. Outputs that do
    not fit come from torch's allocator as usual (that rank then receives through its queues)."""
    check(num_max_tokens_per_rank >= 0, "num_max_tokens_per_rank", num_max_tokens_per_rank, "must be >= 0")
    check(hidden > 0, "hidden", hidden, "must be > 0")
    check(num_ranks > 0, "num_ranks", num_ranks, "must be > 0")
    check(num_topk >= 0, "num_topk", num_topk, "must be >= 0")
    check(num_live >= 1, "num_live", num_live, "must be >= 1")
    rows = num_max_tokens_per_rank * num_ranks
    outputs = [rows * hidden * (1 if fp8 else 2)]
    if fp8:
        outputs.append(rows * -(-hidden // 128) * 4)
    if num_topk:
        outputs += [rows * num_topk * 8, rows * num_topk * 4]
    large = sum(_torch_segment_bytes(n) for n in outputs if n > _MIB)
    small = _torch_segment_bytes(sum(n for n in outputs if 0 < n <= _MIB))
    return num_live * (large + small) + 512  # the window's first segment starts 512-byte aligned


def normal_nvl_staging_bytes_hint(num_max_tokens_per_rank: int, hidden: int, num_ranks: int,
                                  num_topk: int = 0) -> int:
    """Staging-area bytes per rank (``num_nvl_staging_bytes``, or ``EPX_NVL_STAGING_BYTES`` for ``deep_ep``)
    whose slots hold every row a combine returns from each peer when every rank dispatches at most
    `num_max_tokens_per_rank` tokens: a BF16 row of `hidden` and its `num_topk` weights per token, one slot
    per peer (128-byte aligned) after 128 bytes of flags."""
    check(num_max_tokens_per_rank >= 0, "num_max_tokens_per_rank", num_max_tokens_per_rank, "must be >= 0")
    check(hidden > 0, "hidden", hidden, "must be > 0")
    check(num_ranks > 0, "num_ranks", num_ranks, "must be > 0")
    check(num_topk >= 0, "num_topk", num_topk, "must be >= 0")
    if num_ranks == 1:
        return 0
    slot = -(-num_max_tokens_per_rank * (hidden * 2 + 4 * num_topk) // 128) * 128
    return 128 + (num_ranks - 1) * slot


def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                   num_experts: int) -> int:
    """Low-latency buffer bytes per rank (``num_rdma_bytes`` of a low-latency Buffer), a multiple of 2 MiB."""
    return _epx.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
