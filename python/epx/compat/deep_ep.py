"""DeepEP V1 (v1.2.1 and the later V1 line) interface over EPX: ``import epx.compat.deep_ep as deep_ep``, or
the top-level package ``deep_ep`` that EPX ships (a re-export of this module, so code written for DeepEP runs
unchanged).

Same names, signatures, defaults and return tuples as DeepEP's ``deep_ep`` module (Buffer, Config,
EventOverlap, EventHandle, topk_idx_t), running on EPX's runtime. Differences a caller may notice:

- Handles are DeepEP's tuples (intranode, or internode's 10 elements when the Buffer spans nodes), with
  placeholders where EPX keeps no equivalent (deep_ep_handles.py says which).
- Any hidden size whose rows are a multiple of 16 bytes (128 channels in low-latency mode) and any top-k up to 16
  work; FP8 scales of any strides and columns, int32 topk_idx, and a combine hidden other than the dispatch's.
- Config means what DeepEP's does: num_sms / 2 channels; num_max_nvl_chunked_send_tokens records per published
  chunk; num_max_nvl_chunked_recv_tokens records per queue (one per source, destination and channel). So
  Config.get_nvl_buffer_size_hint grows with num_sms and the queue tokens, never with the number of tokens,
  and sizing as DeepEP callers do (the largest hint of get_dispatch_config and get_combine_config) fits every
  call that uses those configs (for DeepEP's recommended configs the hint is below DeepEP's). The RDMA chunk
  sizes size the network queues of normal mode across nodes (Config.get_rdma_buffer_size_hint). Config rules are
  EPX's: send chunk <= queue tokens, at most 128 channels.
- A call whose rows do not fit its config's queues in num_nvl_bytes (a Buffer sized for FP8 rows combining BF16,
  as SGLang's is) runs with the longest queues that fit; EpxError only when not even one-record queues fit.
- get_dispatch_config / get_combine_config list DeepEP v1.2.1's rank counts and raise EpxError for others (DeepEP
  asserts). dispatch / combine without a config in a group of another size use Config(Buffer.num_sms) where
  DeepEP would assert.
- num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl and use_fabric are accepted and ignored: EPX
  moves data over NVLink within a node, mapping memory with CUDA IPC.
- enable_shrink is passed to EPX (a low-latency wait that times out on a peer masks that peer instead of
  aborting). The mask calls (low_latency_update_mask_buffer, _query_, _clean_) work with or without it (DeepEP
  asserts without it); low_latency_query_mask_buffer also fills a CPU tensor.
- EventOverlap.current_stream_wait() without an event does nothing (DeepEP asserts).
- Errors are epx.EpxError (a RuntimeError) naming the argument, its value and the rule, where DeepEP asserts.
"""

from __future__ import annotations

import os

from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from ..buffer import Buffer as _EpxBuffer, _require_cuda_runtime
from ..config import Config, config_fields, get_low_latency_rdma_size_hint as _ll_size_hint
from ..event import EventHandle, EventOverlap
from .._ext import _epx
from .._util import EpxError, check
from .deep_ep_handles import (
    NormalHandleBuilder,
    low_latency_handle,
    low_latency_handle_tuple,
    normal_handle,
    normal_handle_tuple,
)

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "EpxError"]  # and topk_idx_t (see __getattr__)

# The DeepEP release whose interface this module follows (deep_ep.__version__ reports it, with EPX's version as
# a local label).
DEEP_EP_VERSION = "1.2.1"

# The recommended configs (get_dispatch_config / get_combine_config): (nvl send chunk, nvl queue tokens, rdma send
# chunk, rdma queue tokens) after Buffer.num_sms, the table of epx::recommended_config: DeepEP v1.2.1's
# (deep_ep/buffer.py), except the send chunks at 2 ranks, which EPX's measurements chose (48 and 16; DeepEP's 24
# and 10: src/buffer_map/recommended_config.cpp). DeepEP asserts for a rank count it does not list; so do
# get_dispatch_config and get_combine_config here (EpxError).
_DISPATCH_CONFIGS = {
    2: (48, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
    24: (8, 288, 32, 128), 32: (32, 288, 32, 128), 64: (20, 288, 28, 128), 128: (20, 560, 32, 128),
    144: (32, 720, 12, 128), 160: (28, 720, 12, 128),
}
_COMBINE_CONFIGS = {
    2: (16, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
    24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 64: (1, 288, 20, 128), 128: (1, 560, 12, 128),
    144: (2, 720, 8, 128), 160: (2, 720, 8, 128),
}


def __getattr__(name: str) -> Any:
    # topk_idx_t is a torch dtype: resolved on first use, so importing this module needs no torch.
    if name == "topk_idx_t":
        import torch

        return torch.int64  # DeepEP's topk_idx_t (the dtype of topk_idx)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _recommended_config(table: dict, num_ranks: int, kind: str) -> Config:
    check(num_ranks in table, "num_ranks", num_ranks,
          f"DeepEP has no recommended {kind} config for this many ranks (it lists {sorted(table)}); pass a "
          "Config explicitly")
    return Config(Buffer.num_sms, *table[num_ranks])


def _row_bytes(x: Any) -> Optional[int]:
    """Bytes of one row of a call's tokens with their FP8 scales (what a queue record holds besides top-k data),
    or None for what is not a token tensor (the call then names the argument's error)."""
    data, scales = x if isinstance(x, tuple) and len(x) == 2 else (x, None)
    try:  # a 2-D tensor; anything else is named by the call
        _, width = data.shape
        row_bytes = width * data.element_size()
    except (AttributeError, TypeError, ValueError):
        return None
    if scales is not None:
        shape, element_size = getattr(scales, "shape", None), getattr(scales, "element_size", None)
        if shape is not None and element_size is not None:
            row_bytes += (shape[-1] if len(shape) == 2 else 1) * element_size()
    return row_bytes


# Memos of Buffer._default_config and Buffer._config_that_fits (see there).
_DEFAULT_CONFIGS: Dict[Tuple[int, int, int, str], Config] = {}
_FITTED_CONFIGS: Dict[Tuple[int, ...], Optional[Config]] = {}


def _shortened_to_fit(config: Config, row_bytes: int, available: int, num_ranks: int) -> Config:
    """Buffer._config_that_fits's answer, computed."""
    row_bytes = -(-max(int(row_bytes), 16) // 16) * 16

    def shortened(queue_tokens: int) -> Config:
        return Config(config.num_sms, min(config.num_max_nvl_chunked_send_tokens, queue_tokens), queue_tokens,
                      config.num_max_rdma_chunked_send_tokens, config.num_max_rdma_chunked_recv_tokens)

    if config.get_nvl_buffer_size_hint(row_bytes, num_ranks) <= available:
        return config
    low, high = 0, config.num_max_nvl_chunked_recv_tokens - 1  # the longest queue that fits lies in [low, high]
    while low < high:
        middle = (low + high + 1) // 2
        if shortened(middle).get_nvl_buffer_size_hint(row_bytes, num_ranks) <= available:
            low = middle
        else:
            high = middle - 1
    return shortened(low) if low >= 1 else config


def _comm_bootstrap(comm: Any) -> Tuple[int, int, Callable[[bytes], List[bytes]], Callable[[], None]]:
    """(rank, num_ranks, all_gather, barrier) over an mpi4py communicator (its allgather of Python objects)."""
    missing = [name for name in ("Get_rank", "Get_size", "allgather") if not callable(getattr(comm, name, None))]
    check(not missing, "comm", type(comm).__name__,
          f"must be an mpi4py.MPI.Comm (missing {', '.join(missing)}; is mpi4py installed?)")

    def barrier() -> None:
        comm.allgather(None)

    return int(comm.Get_rank()), int(comm.Get_size()), comm.allgather, barrier


class Buffer:
    """DeepEP V1's Buffer over EPX. See epx.Buffer for the native interface with named results.

    Built collectively by every rank of `group` (a torch.distributed process group) or, with group=None, of
    `comm` (an mpi4py communicator, whose allgather exchanges the set-up data). `runtime` is the epx.Buffer.
    """

    num_sms: int = 20

    def __init__(self, group: Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, comm: Optional[Any] = None, *,
                 use_fabric: bool = False) -> None:
        if group is not None:
            self.rank = group.rank()
            self.group_size = group.size()
            self.group = group
            bootstrap = None  # epx.Buffer bootstraps over the process group
        elif comm is not None:
            bootstrap = _comm_bootstrap(comm)
            self.rank, self.group_size = bootstrap[0], bootstrap[1]
            self.group = comm
        else:
            raise EpxError("invalid group = None: either group (a torch.distributed process group) or comm (an "
                           "mpi4py communicator) must be given")
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self.use_fabric = use_fabric
        # EPX_NVL_OUTPUT_BYTES=N: N more NVLink bytes per rank as an output window (epx.Buffer's
        # num_nvl_output_bytes): dispatch outputs come from it while it has room. Every rank sets the same.
        window = int(os.environ.get("EPX_NVL_OUTPUT_BYTES", "0") or 0) if num_nvl_bytes > 0 else 0
        extra = {"num_nvl_output_bytes": window} if window > 0 else {}
        # EPX_NVL_STAGING_BYTES=N: N more NVLink bytes per rank as the combine's staging area (epx.Buffer's
        # num_nvl_staging_bytes): peers' copy engines return the combine's rows. Every rank sets the same.
        staging = int(os.environ.get("EPX_NVL_STAGING_BYTES", "0") or 0) if num_nvl_bytes > 0 else 0
        if staging > 0:
            extra["num_nvl_staging_bytes"] = staging
        self.runtime: Optional[_EpxBuffer] = _EpxBuffer(self.group, num_nvl_bytes + window + staging,
                                                         num_rdma_bytes,
                                                         low_latency_mode, num_sms=Buffer.num_sms,
                                                         enable_shrink=bool(enable_shrink), bootstrap=bootstrap,
                                                         **extra)

    # ---- Static helpers ----

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Sets the SMs the normal-mode kernels use: get_dispatch_config / get_combine_config (what dispatch and
        combine use without a config) pick it up, and so do their size hints."""
        check(new_num_sms % 2 == 0, "new_num_sms", new_num_sms, "must be even (the SM count must be even)")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on the current stream: EventOverlap(EventHandle())."""
        _require_cuda_runtime()
        return EventOverlap(EventHandle())

    @staticmethod
    def is_sm90_compiled() -> bool:
        return bool(_epx.WITH_CUDA)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        return _ll_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's recommended dispatch config for num_ranks ranks, with Buffer.num_sms."""
        return _recommended_config(_DISPATCH_CONFIGS, num_ranks, "dispatch")

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP's recommended combine config for num_ranks ranks, with Buffer.num_sms."""
        return _recommended_config(_COMBINE_CONFIGS, num_ranks, "combine")

    def _default_config(self, table: dict, recommended: Callable[[int], Config]) -> Config:
        # What a call without a config uses: the recommended one (as DeepEP), with the send chunks EPX measured
        # for this GPU's kind (epx::recommended_config: at 2 ranks on H200 the combine's follows num_sms), or
        # Config's defaults with Buffer.num_sms for a group size DeepEP has none for (DeepEP asserts there).
        # Made once per (table, group size, num_sms, GPU kind): the object stays inside this module (callers
        # get copies from get_*_config).
        kind = getattr(getattr(self.runtime, "runtime", None), "gpu_kind", "other")
        key = (id(table), self.group_size, Buffer.num_sms, kind)
        config = _DEFAULT_CONFIGS.get(key)
        if config is None:
            config = recommended(self.group_size) if self.group_size in table else Config(Buffer.num_sms)
            if self.group_size in table and kind != "other":
                op = "dispatch" if table is _DISPATCH_CONFIGS else "combine"
                native = _epx.recommended_config(op, self.group_size, Buffer.num_sms, kind)
                config.num_max_nvl_chunked_send_tokens = native.num_max_nvl_chunked_send_tokens
            _DEFAULT_CONFIGS[key] = config
        return config

    # _call_config's answers without a caller's config, per Buffer: {(table id, num_sms, group size, row bytes):
    # Config}.
    _call_configs: Optional[Dict[Tuple[int, int, int, Optional[int]], Config]] = None

    def _call_config(self, table: dict, recommended: Callable[[int], Config], config: Optional[Config],
                     x: Any) -> Config:
        """The config a normal-mode call with tokens `x` runs with: the caller's `config`, or the recommended one
        (_default_config), with queues that fit the Buffer (_config_that_fits). Without a caller's config the
        answer depends only on the table, Buffer.num_sms, the group size and the rows' bytes: kept per Buffer, one
        dictionary lookup a call. A caller's config may change in place between calls: its fields are read every
        call."""
        row_bytes = _row_bytes(x)
        if config is not None:
            return self._config_that_fits(config, row_bytes)
        memo = self._call_configs
        if memo is None:
            memo = self._call_configs = {}
        key = (id(table), Buffer.num_sms, self.group_size, row_bytes)
        fitted = memo.get(key)
        if fitted is None:
            fitted = self._config_that_fits(self._default_config(table, recommended), row_bytes)
            memo[key] = fitted
        return fitted

    def _config_that_fits(self, config: Config, row_bytes: Optional[int]) -> Config:
        """`config`, or a copy with shorter NVLink queues when its queues for records of rows of `row_bytes` do not
        fit the Buffer's NVLink memory.

        DeepEP callers size that memory for one row size and also move other ones: SGLang sizes it for its
        dispatch dtype (hidden bytes of FP8 rows) and combines BF16 rows, twice as wide. Such a call runs with the
        longest queues that fit (num_max_nvl_chunked_recv_tokens lowered, the send chunk no larger): the same
        results, more round trips. When not even one-record queues fit, the config is returned unchanged and the
        call raises EpxError naming the bytes it needs. The answer depends only on the config's fields, the row
        bytes, the memory and the group size: computed once for each."""
        runtime = self._live()
        available = runtime.num_nvl_bytes
        if row_bytes is None or available <= 0:
            return config
        key = config_fields(config) + (row_bytes, available, runtime.num_ranks)
        if key in _FITTED_CONFIGS:
            fitted = _FITTED_CONFIGS[key]
            return config if fitted is None else fitted
        fitted = _shortened_to_fit(config, row_bytes, available, runtime.num_ranks)
        if len(_FITTED_CONFIGS) >= 4096:
            _FITTED_CONFIGS.clear()
        _FITTED_CONFIGS[key] = None if fitted is config else fitted
        return fitted

    # ---- Life cycle ----

    def _live(self) -> _EpxBuffer:
        if self.runtime is None:
            raise EpxError("deep_ep.Buffer used after destroy()")
        return self.runtime

    def destroy(self) -> None:
        """Frees the buffers (collective); requires explicitly_destroy=True, as in DeepEP."""
        check(self.explicitly_destroy, "explicitly_destroy", self.explicitly_destroy,
              "must be True to call destroy() (otherwise the buffer is freed when collected)")
        self._live().destroy()
        self.runtime = None

    # ---- Failures (EPX additions; DeepEP has none) ----

    def check(self) -> None:
        """Raises EpxError naming rank, peer and phase when a device wait gave up (see epx.Buffer.check)."""
        self._live().check()

    def reset(self) -> None:
        """Collective: recovers an aborted Buffer (see epx.Buffer.reset)."""
        self._live().reset()

    def get_comm_stream(self) -> Any:
        return self._live().comm_stream

    def get_local_buffer_tensor(self, dtype: Any, size: Any = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> Any:
        """The raw buffer as a tensor of dtype, from byte `offset`; `size` (a torch.Size) takes a prefix."""
        return self._live().local_buffer_tensor(dtype, size, offset, use_rdma_buffer)

    # ---- Normal mode ----

    def get_dispatch_layout(self, topk_idx: Any, num_experts: int, previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False
                            ) -> Tuple[Any, Optional[Any], Any, Any, EventOverlap]:
        layout = self._live().get_dispatch_layout(topk_idx, num_experts, previous_event=previous_event,
                                                  async_finish=async_finish,
                                                  allocate_on_comm_stream=allocate_on_comm_stream)
        return (layout.num_tokens_per_rank, layout.num_tokens_per_rdma_rank, layout.num_tokens_per_expert,
                layout.is_token_in_rank, layout.event)

    def dispatch(self, x: Union[Any, Tuple[Any, Any]], handle: Optional[Any] = None,
                 num_tokens_per_rank: Optional[Any] = None, num_tokens_per_rdma_rank: Optional[Any] = None,
                 is_token_in_rank: Optional[Any] = None, num_tokens_per_expert: Optional[Any] = None,
                 topk_idx: Optional[Any] = None, topk_weights: Optional[Any] = None, expert_alignment: int = 1,
                 num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False
                 ) -> Tuple[Union[Tuple[Any, Any], Any], Optional[Any], Optional[Any], List[int], Any, EventOverlap]:
        config = self._call_config(_DISPATCH_CONFIGS, self.get_dispatch_config, config, x)
        is_fp8 = isinstance(x, tuple)
        if handle is not None:
            live = self._live()
            if topk_idx is None and topk_weights is None:
                recv_x, recv_scales, event = live._dispatch_cached_tuple(
                    x, normal_handle(handle), expert_alignment, config, previous_event, async_finish,
                    allocate_on_comm_stream)
                return (recv_x, recv_scales) if is_fp8 else recv_x, None, None, None, None, event
            result = live.dispatch(x, handle=normal_handle(handle), topk_idx=topk_idx, topk_weights=topk_weights,
                                   expert_alignment=expert_alignment, config=config, previous_event=previous_event,
                                   async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream)
            recv_x = (result.recv_x, result.recv_x_scales) if is_fp8 else result.recv_x
            return recv_x, None, None, None, None, result.event
        live = self._live()
        if not live._spans_nodes:
            # Within one node the count exchange writes DeepEP's matrices itself: the extension's call, then the
            # handle tuple over its views (dispatch's Python where it is not the plain case).
            made = live._dispatch_tuple(x, topk_idx, topk_weights, None, is_token_in_rank, num_tokens_per_expert,
                                        num_tokens_per_rank, expert_alignment, num_worst_tokens, config,
                                        previous_event, async_finish, allocate_on_comm_stream)
            if made is not None:
                recv_x, recv_scales, recv_idx, recv_weights, per_expert_list, handle, event, tuple_head = made
                return ((recv_x, recv_scales) if is_fp8 else recv_x), recv_idx, recv_weights, per_expert_list, \
                    normal_handle_tuple(handle, tuple_head), event
        num_experts = num_tokens_per_expert.numel() if num_tokens_per_expert is not None else None
        # Across nodes the internode tuple's matrices are queued right after the count exchange (with
        # after_counts epx.Buffer.dispatch takes its Python path); within one node the extension was tried above.
        builder = NormalHandleBuilder() if live._spans_nodes else None
        result = live._dispatch_in_python(x, None, topk_idx, topk_weights, num_experts, is_token_in_rank,
                                          num_tokens_per_expert, num_tokens_per_rank, expert_alignment,
                                          num_worst_tokens, config, previous_event, async_finish,
                                          allocate_on_comm_stream, builder, True)
        recv_x = (result.recv_x, result.recv_x_scales) if is_fp8 else result.recv_x
        handle_tuple = builder.tuple_for(result.handle) if builder is not None else normal_handle_tuple(result.handle)
        return (recv_x, result.recv_topk_idx, result.recv_topk_weights, result.num_recv_tokens_per_expert_list,
                handle_tuple, result.event)

    def combine(self, x: Any, handle: Any, topk_weights: Optional[Any] = None,
                bias: Union[Any, Tuple[Any, Any], None] = None, config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> Tuple[Any, Optional[Any], EventOverlap]:
        config = self._call_config(_COMBINE_CONFIGS, self.get_combine_config, config, x)
        return self._live()._combine_tuple(x, normal_handle(handle), topk_weights, bias, config, previous_event,
                                           async_finish, allocate_on_comm_stream)

    # ---- Low-latency mode ----

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        self._live().clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_dispatch(self, x: Any, topk_idx: Any, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[Any] = None,
                             dispatch_wait_recv_cost_stats: Optional[Any] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False
                             ) -> Tuple[Union[Tuple[Any, Any], Any], Any, Any, EventOverlap, Optional[Callable]]:
        recv_x, recv_scales, recv_count, handle, event, hook, src_info = self._live()._low_latency_dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
            dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook, None,
            False)
        return ((recv_x, recv_scales) if use_fp8 else recv_x), recv_count, \
            low_latency_handle_tuple(handle, src_info), event, hook

    def low_latency_combine(self, x: Any, topk_idx: Any, topk_weights: Any, handle: Any, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[Any] = None, combine_wait_recv_cost_stats: Optional[Any] = None
                            ) -> Tuple[Any, EventOverlap, Optional[Callable]]:
        native_handle, src_info = low_latency_handle(handle)
        return self._live()._low_latency_combine(x, topk_idx, topk_weights, native_handle, src_info, use_logfmt,
                                                 zero_copy, async_finish, return_recv_hook, out,
                                                 combine_wait_recv_cost_stats, False, False)

    def get_next_low_latency_combine_buffer(self, handle: Any) -> Any:
        return self._live().get_next_low_latency_combine_buffer(low_latency_handle(handle)[0])

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Masks (mask=True) or unmasks rank_to_mask in this rank's low-latency calls."""
        self._live().low_latency_update_mask_buffer(rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status: Any) -> None:
        """Writes the mask into mask_status, torch.int [num_ranks]: 1 = masked."""
        self._live().low_latency_query_mask_buffer(mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmasks every rank."""
        self._live().low_latency_clean_mask_buffer()
