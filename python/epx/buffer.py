"""epx.Buffer: the torch layer over the C++ runtime (allocates outputs with torch, orders streams, names
results). DeepEP V1's interface is in epx.compat.deep_ep, a thin layer over this one."""

from __future__ import annotations

import contextlib
import operator
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from ._ext import _epx, torch_calls
from ._util import (
    EpxError,
    array_view,
    check,
    check_tensor,
    current_stream,
    current_stream_handle,
    device_view,
    element_size,
    error,
    event_handle,
    fast_empty_strided,
    maybe_stream,
    pointer,
    record_stream,
    StreamSwitch,
    torch,
)
from .config import Config, config_fields, native_config
from .event import EventOverlap
from .results import (
    CombineResult,
    DispatchHandle,
    DispatchLayout,
    DispatchResult,
    LowLatencyCombineResult,
    LowLatencyDispatchResult,
    LowLatencyHandle,
    RecvHook,
)
from .tokens import as_topk_idx, split_tokens

# BF16 [T, H] (or any dtype with 16-byte rows, moved as bytes), or (FP8 [T, H], float32 / int32 scales [T, S]).
Tokens = Union[Any, Tuple[Any, Any]]


def group_bootstrap(group: Any) -> Tuple[int, int, Callable[[bytes], List[bytes]], Callable[[], None]]:
    """(rank, num_ranks, all_gather, barrier) over a torch.distributed process group, through
    all_gather_object (works with the NCCL and Gloo backends)."""
    import torch.distributed as dist

    num_ranks = dist.get_world_size(group)

    def all_gather(payload: bytes) -> List[bytes]:
        gathered: List[Any] = [None] * num_ranks
        dist.all_gather_object(gathered, payload, group=group)
        return gathered

    def barrier() -> None:
        dist.all_gather_object([None] * num_ranks, None, group=group)

    return dist.get_rank(group), num_ranks, all_gather, barrier


def _require_cuda_runtime() -> None:
    if not _epx.WITH_CUDA:
        raise EpxError("epx was built without CUDA (EPX_WITH_CUDA=OFF): only size hints, layouts and the "
                       "CPU reference are available")


class Buffer:
    """Communication buffers of one rank for MoE dispatch/combine, built collectively by every rank of a
    process group on the current CUDA device.

    Args:
        group: a torch.distributed process group (default: the world group). All its ranks construct the
            Buffer together.
        num_nvl_bytes: normal-mode NVLink buffer bytes: the largest Config.get_nvl_buffer_size_hint of the
            configs its calls use (it does not depend on the number of tokens).
        num_rdma_bytes: low-latency buffer bytes (see get_low_latency_rdma_size_hint).
        low_latency_mode: kept as the attribute of that name (DeepEP's signature); any Buffer with
            num_rdma_bytes > 0 serves low-latency calls, so the runtime does not need it.
        num_sms: SM budget of the normal-mode kernels. A call given a Config makes it the Buffer's config (SM
            budget and chunk sizes) from then on; calls without one use the current config. Until a Config is
            given, combines within one node send in the recommended combine chunks for the group, the SM budget
            and the GPU kind (``runtime.combine_send_chunk``), not the dispatch's.
        wait_timeout_s: bound of every device-side wait (the environment's EPX_WAIT_TIMEOUT_S overrides it);
            a timeout raises EpxError naming the rank, peer and phase.
        ranks_per_node: ranks per NVLink node (0: detect: the ranks of one host whose GPUs reach each other
            form a node, so one host is one node). A smaller value (it must divide the detected size) splits
            the group into nodes of consecutive ranks; low-latency traffic between nodes goes through NVSHMEM
            (epx.WITH_NVSHMEM). On one host this makes virtual nodes. The environment's EPX_RANKS_PER_NODE
            overrides it; every rank must end up with the same value.
        enable_shrink: low-latency mode: a device wait that times out on a peer masks that peer (see
            low_latency_update_mask_buffer) and the call completes without its traffic, instead of aborting
            the group (DeepEP's enable_shrink).
        num_nvl_output_bytes: of num_nvl_bytes, the tail kept as an output window (0: none; every rank the
            same). With the torch extension, normal-mode dispatch outputs come from it while it has room
            (torch's caching allocator over it; the sources store rows straight into them, no queue); without
            room they come from torch's allocator as usual. Tensors from it must not outlive destroy().
            normal_nvl_output_bytes_hint sizes it.
        num_nvl_staging_bytes: of num_nvl_bytes, the part before the output window kept as the combine's
            staging area (0: none; every rank the same). Within one node each peer's copy engine then returns
            the combine's rows into it, so the combine's SMs only reduce (a combine at 8 or 16 SMs runs at
            the link's rate); pairs whose rows do not fit a slot use the queues. normal_nvl_staging_bytes_hint
            sizes it.
        bootstrap: instead of a group, (rank, num_ranks, all_gather, barrier) callables: all_gather(bytes)
            returns every rank's bytes in rank order (for frameworks other than torch.distributed).

    Every call is collective: all ranks make the same sequence of calls. Call destroy() (collective) to
    free the memory at a known point. A Buffer collected without destroy() frees only this rank's memory,
    meeting no peer (a collective from a finalizer could hang); memory reached through NVSHMEM then stays
    until the process ends.
    """

    # Rows of the last dispatch that exchanged counts: sizes the next one's guess (DispatchOutputGuess).
    _last_recv_rows: Optional[int] = None
    # The output window's pool (the torch extension's), or None.
    _window: Any = None

    def __init__(self, group: Any = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, *, num_sms: int = 20, wait_timeout_s: float = 30.0,
                 ranks_per_node: int = 0, enable_shrink: bool = False, num_nvl_output_bytes: int = 0,
                 num_nvl_staging_bytes: int = 0,
                 bootstrap: Optional[Tuple[int, int, Callable, Callable]] = None) -> None:
        _require_cuda_runtime()
        t = torch()
        if bootstrap is None:
            import torch.distributed as dist

            if group is None:
                group = dist.group.WORLD
            bootstrap = group_bootstrap(group)
        rank, num_ranks, all_gather, barrier = bootstrap
        self.group = group
        self.device = t.device("cuda", t.cuda.current_device())  # also initialises torch's CUDA context
        # A stream of torch's pool (never destroyed, as DeepEP's): outputs recorded on it stay safe to free
        # after destroy().
        self.comm_stream = t.cuda.Stream(device=self.device)
        self._comm_stream_handle = self.comm_stream.cuda_stream  # its cudaStream_t, for the torch extension
        options = _epx.BufferOptions(num_nvl_bytes=int(num_nvl_bytes), num_rdma_bytes=int(num_rdma_bytes),
                                     num_sms=int(num_sms), wait_timeout_s=float(wait_timeout_s),
                                     ranks_per_node=int(ranks_per_node), comm_stream=self.comm_stream.cuda_stream,
                                     enable_shrink=bool(enable_shrink))
        options.num_nvl_output_bytes = int(num_nvl_output_bytes)
        options.num_nvl_staging_bytes = int(num_nvl_staging_bytes)
        self.runtime = _epx.Buffer(rank, num_ranks, all_gather, barrier, options)
        # The output window as a torch memory pool (the extension's capsule), or None.
        window_bytes = self.runtime.num_nvl_output_bytes
        self._window = torch_calls.window_pool(self.device.index, self.runtime.nvl_output_window, window_bytes) \
            if torch_calls is not None and window_bytes > 0 else None
        self.rank = rank
        self.num_ranks = num_ranks
        self.low_latency_mode = bool(low_latency_mode)
        self._init_call_state()

    def _init_call_state(self) -> None:
        """What the calls keep between calls so that a call repeats no work: the device index (for the current
        stream), StreamOrders without a previous event by (stream, async_finish), low-latency sizes by shape, and
        the config last given to the runtime."""
        self._device_index = self.device.index
        self._orders: Dict[Tuple[int, bool], Any] = {}
        self._stream_objects: Dict[int, Any] = {}  # stream handle -> its torch.cuda.Stream
        self._ll_sizes: Dict[Tuple[Any, ...], Tuple[int, int, int]] = {}
        # The fields of the config this Buffer last set as the runtime's config; None: not known. Every path
        # through which this Buffer changes the runtime's config keeps it current.
        self._config_set: Optional[Tuple[Any, ...]] = None
        self._on_comm_stream = StreamSwitch(self.comm_stream)  # `with` it: the comm stream is current
        self._fast_empty = fast_empty_strided(self.device)  # allocates on the current device
        self._current_device = getattr(torch()._C, "_cuda_getDevice", None) if self.device.type == "cuda" else None
        # Whether the group spans nodes: fixed for the runtime's life (read per call otherwise, a binding call).
        runtime = getattr(self, "runtime", None)
        self._spans_nodes = bool(runtime.spans_nodes) if runtime is not None else False

    def _empty(self) -> Callable[[tuple, tuple, Any], Any]:
        """This call's allocator, f(sizes, strides, dtype) on the Buffer's device and the current stream: the fast
        one (fast_empty_strided) when the current device is the Buffer's, else torch.empty_strided."""
        fast = self._fast_empty
        if fast is not None and (self._current_device is None or self._current_device() == self._device_index):
            return fast
        device = self.device
        return lambda sizes, strides, dtype: torch().empty_strided(sizes, strides, dtype=dtype, device=device)

    # ---- Life cycle and properties ----

    def destroy(self) -> None:
        """Frees the buffers now (collective). Calls after it raise EpxError. After an abort it meets no peer
        (peers may be gone): it frees this rank's memory and returns."""
        if self._window is not None:
            alive = torch_calls.window_release(self._window)
            self._window = None
            if alive > 0:
                warnings.warn(f"epx.Buffer.destroy: {alive} bytes of dispatch outputs in the output window are "
                              "still referenced; they must not be used after destroy() (the window is freed)",
                              RuntimeWarning, stacklevel=2)
        self.runtime.destroy()

    # ---- Failures (docs/RELIABILITY.md) ----

    def check(self) -> None:
        """Raises EpxError (rank, peer, phase, expected and seen values) when a device wait of this rank, or
        of a peer, gave up. Call it after a torch.cuda.synchronize() or an event sync: calls that return before
        their kernels finish report a failure only at the next EPX call or here. Once raised, every call
        raises the same error until reset() or destroy()."""
        self.runtime.check()

    @property
    def is_aborted(self) -> bool:
        """True once a failure was raised; calls are refused until reset() or destroy()."""
        return bool(self.runtime.is_aborted)

    @property
    def dispatch_count_wait_us(self) -> float:
        """Microseconds this rank's host spent in dispatch waiting for its counts (a dispatch without a cached
        handle or num_worst_tokens waits for them: the outputs are sized by them), summed since construction
        or reset(): the part of those calls' host time that is the GPU's count exchange (and the stream's work
        queued before it), not host work."""
        return self.runtime.dispatch_count_wait_ns / 1e3

    def reset(self) -> None:
        """Collective (every rank calls it): after an abort, waits for this rank's kernels (every wait is
        bounded), clears the abort and re-synchronizes both buffers' queue counters and signals. The Buffer
        then runs calls again (hooks of earlier low-latency calls become stale). The CUDA context and the
        caller's tensors were never lost."""
        self.runtime.reset()

    @property
    def is_destroyed(self) -> bool:
        return self.runtime.is_destroyed

    @property
    def num_sms(self) -> int:
        return self.runtime.num_sms

    @num_sms.setter
    def num_sms(self, value: int) -> None:
        self._config_set = None
        self.runtime.num_sms = int(value)

    @property
    def config(self) -> Config:
        """The config of the normal-mode calls (a copy): the last one a call was given, or the constructor's
        num_sms with, within one node, the recommended dispatch chunks for the group size (at 2 ranks a send
        chunk of 48 tokens; the queues are Config's), across nodes a network send chunk of 16
        (epx::across_nodes_config). Assign a Config to change it."""
        return Config.from_native(self.runtime.config)

    @config.setter
    def config(self, value: Config) -> None:
        self._config_set = None
        self.runtime.config = native_config(value)

    @property
    def num_nvl_bytes(self) -> int:
        return self.runtime.num_nvl_bytes

    @property
    def num_rdma_bytes(self) -> int:
        return self.runtime.num_rdma_bytes

    # DeepEP's runtime queries (deep_ep.Buffer.runtime is this object). DeepEP's "RDMA ranks" are the nodes:
    # groups of ranks_per_node consecutive ranks (EPX_RANKS_PER_NODE / ranks_per_node, else one per host).

    def get_num_rdma_ranks(self) -> int:
        """Nodes the group spans: 1 within one NVLink node."""
        return -(-self.num_ranks // self.runtime.ranks_per_node)

    def get_rdma_rank(self) -> int:
        """This rank's node."""
        return self.rank // self.runtime.ranks_per_node

    def get_local_device_id(self) -> int:
        """The CUDA device (index) the Buffer lives on."""
        return int(self.runtime.device)

    def is_available(self) -> bool:
        """Whether the buffers are usable (not destroyed)."""
        return not self.runtime.is_destroyed

    def local_buffer_tensor(self, dtype: Any, size: Optional[Sequence[int]] = None, offset_bytes: int = 0,
                            use_rdma_buffer: bool = False) -> Any:
        """A tensor view of this rank's NVLink buffer (or low-latency buffer) from byte offset_bytes on, shaped
        `size` (default: as many elements as fit). It keeps the Buffer alive."""
        base = self.runtime.symmetric_buffer if use_rdma_buffer else self.runtime.nvl_buffer
        total = self.runtime.num_rdma_bytes if use_rdma_buffer else self.runtime.num_nvl_bytes
        check(0 <= offset_bytes <= total, "offset", offset_bytes, f"must be in [0, {total}] bytes")
        element_bytes = element_size(dtype)
        available = (total - offset_bytes) // element_bytes
        num_elements = available
        if size is not None:
            num_elements = 1
            for extent in size:
                num_elements *= int(extent)
            check(num_elements <= available, "size", tuple(size), f"must fit in the buffer ({available} elements)")
        shape = tuple(size) if size is not None else (num_elements,)
        return device_view(base + offset_bytes, num_elements * element_bytes, dtype, shape, self, self.device)

    # ---- Stream handling shared by the calls ----
    #
    # Per-call paths read torch's current stream as a handle (current_stream_handle: no torch.cuda.Stream object)
    # and build no error text unless a check fails (check_tensor's fast path, `if not ...: raise error(...)`).

    def _order(self, previous_event: Any, async_finish: bool) -> Any:
        stream = current_stream_handle(self._device_index)
        if previous_event is None:
            # A StreamOrder is a plain value: one per (stream, async_finish) serves every call made so.
            order = self._orders.get((stream, async_finish))
            if order is None:
                if len(self._orders) >= 256:  # many streams come and go (external streams): start over
                    self._orders.clear()
                order = _epx.StreamOrder(compute_stream=stream, previous_event=0, async_finish=bool(async_finish))
                self._orders[(stream, async_finish)] = order
            return order
        return _epx.StreamOrder(compute_stream=stream, previous_event=event_handle(previous_event),
                                async_finish=bool(async_finish))

    def _current_stream_object(self) -> Any:
        """torch's current stream as a torch.cuda.Stream (what record_stream takes), one object per stream: a
        stream's handle names it for the life of the process."""
        handle = current_stream_handle(self._device_index)
        stream = self._stream_objects.get(handle)
        if stream is None:
            if len(self._stream_objects) >= 256:
                self._stream_objects.clear()
            stream = self._stream_objects[handle] = current_stream(self.device)
        return stream

    def _input_copies(self, previous_event: Any) -> Any:
        """Where the layer's own copies of inputs (column-major FP8 scales made contiguous, int32 top-k ids
        widened) run. Without previous_event the call orders the comm stream after the current stream, so copies
        made there are ordered. With one, the comm stream waits for that event only (DeepEP's rule), and a copy
        queued on the current stream after the event would race the kernels: the copies then run on the comm
        stream, after the event."""
        if previous_event is None or event_handle(previous_event) == 0:
            return _NO_CONTEXT
        return self._on_comm_stream_after(previous_event)

    @contextlib.contextmanager
    def _on_comm_stream_after(self, previous_event: Any) -> Iterator[None]:
        with self._on_comm_stream:
            EventOverlap(getattr(previous_event, "event", previous_event)).current_stream_wait()
            yield

    def _alloc_stream(self, previous_event: Any, async_finish: bool, allocate_on_comm_stream: bool) -> Any:
        if not allocate_on_comm_stream:
            return None
        # Outputs owned by the comm stream are only safe when the call is ordered by an event and the caller
        # waits for its event (DeepEP's rule).
        check(previous_event is not None, "previous_event", None, "is required with allocate_on_comm_stream")
        check(async_finish, "async_finish", async_finish, "must be True with allocate_on_comm_stream")
        return self.comm_stream

    def _finish(self, event: Any, inputs: Sequence[Any], outputs: Sequence[Any], async_finish: bool,
                allocate_on_comm_stream: bool) -> EventOverlap:
        if async_finish:
            # The comm stream still uses these after this call returns.
            record_stream(list(inputs) + list(outputs), self.comm_stream)
        if allocate_on_comm_stream:
            # The caller's stream (current again: the allocation's stream context has ended) uses the outputs.
            record_stream(outputs, self._current_stream_object())
        return EventOverlap(event if async_finish else None)

    def _apply_config(self, config: Optional[Config]) -> Any:
        """The whole config (SM budget, send chunk, queue tokens) becomes the runtime's, for this call and the
        next ones; None keeps the runtime's current config. Returns the config before (None when unchanged),
        for _restore_config. A config with the fields of the one this Buffer set last is not set again."""
        if config is None:
            return None
        # Its fields now (a Config changed in place is another config); an object that is not a config has none.
        fields = config_fields(config)
        if fields == self._config_set:
            return None
        previous = self.runtime.config
        self.runtime.config = native_config(config)
        self._config_set = fields
        return previous

    def _restore_config(self, previous: Any) -> None:
        # A rejected call leaves the Buffer as it was, its config included.
        if previous is not None:
            self._config_set = None
            self.runtime.config = previous

    # ---- Normal mode ----

    def get_dispatch_layout(self, topk_idx: Any, num_experts: int, *, previous_event: Any = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False) -> DispatchLayout:
        """Tokens per rank (a token counts once per rank), per expert, and the token-in-rank map; when the
        group spans nodes, also tokens per node (num_tokens_per_rdma_rank, a token counted once per node)."""
        if torch_calls is not None:
            made = self._layout_natively(topk_idx, num_experts, previous_event, async_finish,
                                         allocate_on_comm_stream)
            if made is not None:
                return made
        t = torch()
        with self._input_copies(previous_event):
            topk_idx = as_topk_idx(topk_idx)
        num_tokens, num_topk = topk_idx.shape
        order = self._order(previous_event, async_finish)
        num_ranks, num_nodes, empty = self.num_ranks, self.get_num_rdma_ranks(), self._empty()
        with maybe_stream(self._alloc_stream(previous_event, async_finish, allocate_on_comm_stream)):
            per_rank = empty((num_ranks,), (1,), t.int32)
            per_node = empty((num_nodes,), (1,), t.int32) if num_nodes > 1 else None
            per_expert = empty((max(operator.index(num_experts), 0),), (1,), t.int32)
            in_rank = empty((num_tokens, num_ranks), (num_ranks, 1), t.bool)
        out = _epx.DispatchLayoutOutput(num_tokens_per_rank=per_rank.data_ptr(),
                                        num_tokens_per_expert=per_expert.data_ptr(),
                                        is_token_in_rank=in_rank.data_ptr(), num_tokens_per_rdma_rank=pointer(per_node))
        event = _epx.get_dispatch_layout(self.runtime, topk_idx.data_ptr(), num_tokens, num_topk, num_experts, out,
                                         order)
        if async_finish or allocate_on_comm_stream:
            outputs = (per_rank, per_expert, in_rank) + ((per_node,) if per_node is not None else ())
            overlap = self._finish(event, (topk_idx,), outputs, async_finish, allocate_on_comm_stream)
        else:
            overlap = EventOverlap()
        return DispatchLayout(per_rank, per_node, per_expert, in_rank, overlap)

    def _layout_natively(self, topk_idx: Any, num_experts: Any, previous_event: Any, async_finish: bool,
                         allocate_on_comm_stream: bool) -> Optional[DispatchLayout]:
        """get_dispatch_layout through the torch extension (checks, the outputs in one block, the launch in C++),
        or None where its arguments are not the plain case (int32 ids to widen, a bad argument): the Python path
        then copes or raises the named error."""
        try:
            made = torch_calls.get_dispatch_layout(
                self.runtime, self._device_index, self.num_ranks, self.get_num_rdma_ranks(), topk_idx, num_experts,
                event_handle(previous_event), async_finish, allocate_on_comm_stream, self._comm_stream_handle)
        except TypeError:
            return None
        if made is None:
            return None
        per_rank, per_node, per_expert, in_rank, event = made
        return DispatchLayout(per_rank, per_node, per_expert, in_rank, EventOverlap(event if async_finish else None))

    def dispatch(self, x: Tokens, *, handle: Optional[DispatchHandle] = None, topk_idx: Any = None,
                 topk_weights: Any = None, num_experts: Optional[int] = None, is_token_in_rank: Any = None,
                 num_tokens_per_expert: Any = None, num_tokens_per_rank: Any = None, expert_alignment: int = 1,
                 num_worst_tokens: int = 0,
                 config: Optional[Config] = None, previous_event: Any = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False,
                 after_counts: Optional[Callable[[DispatchHandle], Sequence[Any]]] = None,
                 launch_receive: bool = True) -> DispatchResult:
        """Sends each token once to every rank holding at least one of its experts.

        Routing comes from `handle` (cached: the same layout as that dispatch, no top-k outputs), or from
        is_token_in_rank and num_tokens_per_expert (get_dispatch_layout's outputs), computed here from topk_idx
        and num_experts when not given. Rows arrive ordered by source rank, then source token index.
        num_tokens_per_rank (the layout's too, optional) lets the host learn the row counts sooner; it must
        agree with is_token_in_rank (a count that does not aborts the call on every rank, naming both).

        after_counts(handle), for a dispatch that is not cached, runs once the counts are exchanged, with the
        comm stream current: torch work it queues (e.g. on handle.recv_channel_offset) is ordered like the
        receive (covered by the call's event, waited for without async_finish). The tensors it returns, which
        it allocates on the comm stream, are recorded as used by the caller's stream.

        launch_receive (default) launches the receive with the count exchange, before the host waits for the
        counts (DispatchOverlap::kLaunchReceive in C++): senders fill the peers' queues meanwhile. Ignored with
        after_counts, a cached handle or num_worst_tokens; False launches it once the outputs exist.
        """
        if launch_receive and topk_idx is None and topk_weights is None and self._native_with(handle):
            made = self._dispatch_cached_natively(x, handle, expert_alignment, config, previous_event, async_finish,
                                                  allocate_on_comm_stream)
            if made is not None:
                recv_x, recv_scales, event = made
                return DispatchResult(recv_x, recv_scales, None, None, list(handle.num_recv_tokens_per_expert_list),
                                      handle, event)
        elif torch_calls is not None and handle is None and after_counts is None and is_token_in_rank is not None \
                and num_tokens_per_expert is not None:
            made = self._dispatch_tuple(x, topk_idx, topk_weights, num_experts, is_token_in_rank,
                                        num_tokens_per_expert, num_tokens_per_rank, expert_alignment,
                                        num_worst_tokens, config, previous_event, async_finish,
                                        allocate_on_comm_stream, launch_receive)
            if made is not None:
                return DispatchResult(*made[:7])
        return self._dispatch_in_python(x, handle, topk_idx, topk_weights, num_experts, is_token_in_rank,
                                        num_tokens_per_expert, num_tokens_per_rank, expert_alignment,
                                        num_worst_tokens, config, previous_event, async_finish,
                                        allocate_on_comm_stream, after_counts, launch_receive)

    def _dispatch_in_python(self, x: Tokens, handle: Optional[DispatchHandle], topk_idx: Any, topk_weights: Any,
                            num_experts: Optional[int], is_token_in_rank: Any, num_tokens_per_expert: Any,
                            num_tokens_per_rank: Any, expert_alignment: int, num_worst_tokens: int,
                            config: Optional[Config], previous_event: Any, async_finish: bool,
                            allocate_on_comm_stream: bool,
                            after_counts: Optional[Callable[[DispatchHandle], Sequence[Any]]],
                            launch_receive: bool) -> DispatchResult:
        """dispatch's Python path (checks, outputs and the result in Python, the native calls through _epx):
        what dispatch runs where the torch extension is not loaded or the call is not its plain case, and
        deep_ep.Buffer's fallback after its own try of the extension (so the extension is not asked twice)."""
        t = torch()
        with self._input_copies(previous_event):
            tokens = split_tokens(x)
            if handle is None and topk_idx is not None:
                topk_idx = as_topk_idx(topk_idx, shape=(tokens.data.size(0), None))
        x, x_scales, fp8 = tokens.data, tokens.scales, tokens.fp8
        num_tokens, hidden = x.shape
        num_ranks = self.num_ranks
        alloc_stream = self._alloc_stream(previous_event, async_finish, allocate_on_comm_stream)
        cached = handle is not None
        if cached:
            if not isinstance(handle, DispatchHandle):
                raise error("handle", type(handle).__name__, "must be the handle of a dispatch")
            check(handle.buffer_id == id(self), "handle", "from another Buffer", "must come from this Buffer")
            check(topk_idx is None and topk_weights is None, "topk_idx/topk_weights", "given",
                  "must be None with a cached handle (the handle fixes the routing)")
            if num_tokens != handle.num_tokens:
                raise error("x.shape[0]", num_tokens, f"must equal the cached dispatch's token count "
                                                      f"({handle.num_tokens})")
            num_experts = handle.num_experts
            num_topk = 0
        else:
            if topk_idx is not None:
                num_topk = topk_idx.size(1)
                check(topk_weights is not None, "topk_weights", None, "are required with topk_idx")
                check_tensor(topk_weights, "topk_weights", dtype=t.float32, shape=(num_tokens, num_topk))
            else:
                check(topk_weights is None, "topk_weights", "given", "need topk_idx as well")
                num_topk = 0
            if num_tokens_per_expert is not None:
                check_tensor(num_tokens_per_expert, "num_tokens_per_expert", dtype=t.int32, ndim=1)
                if num_experts is not None and num_experts != num_tokens_per_expert.numel():
                    raise error("num_experts", num_experts,
                                f"must equal num_tokens_per_expert.numel() ({num_tokens_per_expert.numel()})")
                num_experts = num_tokens_per_expert.numel()
            # The per-expert counts come from num_tokens_per_expert: compute the layout when either is missing.
            if is_token_in_rank is None or (topk_idx is not None and num_tokens_per_expert is None):
                check(topk_idx is not None, "is_token_in_rank", None,
                      "is required without topk_idx or a cached handle")
                check(num_experts is not None, "num_experts", None,
                      "is required to compute the layout (or pass is_token_in_rank and num_tokens_per_expert)")
                layout = self.get_dispatch_layout(topk_idx, num_experts, previous_event=previous_event)
                previous_event = None  # the layout ran in order after it
                is_token_in_rank = layout.is_token_in_rank
                num_tokens_per_expert = layout.num_tokens_per_expert
                num_tokens_per_rank = layout.num_tokens_per_rank
            check_tensor(is_token_in_rank, "is_token_in_rank", dtype=t.bool, shape=(num_tokens, num_ranks))
            if num_tokens_per_rank is not None:
                check_tensor(num_tokens_per_rank, "num_tokens_per_rank", dtype=t.int32, shape=(num_ranks,))
            num_experts = 0 if num_experts is None else num_experts

        previous_config = self._apply_config(config)
        native_in = _epx.DispatchInput(
            x=x.data_ptr(), format=_epx.TokenFormat.FP8 if fp8 else _epx.TokenFormat.BF16, x_scales=pointer(x_scales),
            num_scales=tokens.num_scales, num_tokens=num_tokens, hidden=hidden, topk_idx=pointer(topk_idx),
            topk_weights=pointer(topk_weights), num_topk=num_topk, num_experts=num_experts,
            is_token_in_rank=0 if cached else pointer(is_token_in_rank),
            num_tokens_per_expert=0 if cached else pointer(num_tokens_per_expert),
            num_tokens_per_rank=0 if cached else pointer(num_tokens_per_rank),
            expert_alignment=int(expert_alignment), num_worst_tokens=int(num_worst_tokens))
        order = self._order(previous_event, async_finish)

        # launch_receive: the receive goes out with the count exchange, before the host waits for the counts
        # (only allocations happen in between; after_counts queues work that must come first, so it rules
        # this out).
        launches = launch_receive and after_counts is None
        # after_counts reads the handle's arrays before the receive: they must be written first.
        overlap = _epx.DispatchOverlap.LAUNCH_RECEIVE if launches else \
            _epx.DispatchOverlap.HANDLE_BEFORE_RECEIVE if after_counts is not None else _epx.DispatchOverlap.NONE
        scales_dtype = x_scales.dtype if fp8 else None
        # The receive writes into outputs allocated now, for the last dispatch's rows plus a margin, when the
        # rows fit (DispatchOutputGuess): then nothing crosses from the host to the receive after the counts.
        guess: Optional[Tuple[Any, ...]] = None
        native_guess = None
        guess_rows = self._guess_rows(launches and not cached, num_worst_tokens)
        if guess_rows > 0:
            with maybe_stream(alloc_stream):
                guess = _dispatch_outputs(t, self._empty(), guess_rows, hidden, x.dtype, tokens.num_scales,
                                          scales_dtype, num_topk)
            native_guess = _epx.DispatchOutputGuess()
            native_guess.outputs = _native_outputs(guess)
            native_guess.rows = guess_rows
        try:
            plan = _epx.dispatch_notify(self.runtime, native_in, order, handle.native if cached else None, overlap,
                                        native_guess)
        except Exception:
            self._restore_config(previous_config)
            raise
        rows = plan.num_recv_rows
        if not cached and not num_worst_tokens:
            self._last_recv_rows = rows
        per_expert_list = list(plan.num_recv_tokens_per_expert)
        if cached:
            new_handle = handle
        else:
            new_handle = DispatchHandle(plan.handle, id(self), num_tokens, rows, hidden, num_experts, num_topk,
                                        int(num_worst_tokens), per_expert_list, num_ranks, self)
        derived: Sequence[Any] = ()
        if after_counts is not None and not cached:
            with self._on_comm_stream:
                derived = after_counts(new_handle)
        try:
            if plan.rows_in_guess:
                outputs = tuple(None if g is None else g.narrow(0, 0, rows) for g in guess)
                native_out = native_guess.outputs
            else:
                with maybe_stream(alloc_stream):
                    outputs = _dispatch_outputs(t, self._empty(), rows, hidden, x.dtype, tokens.num_scales,
                                                scales_dtype, num_topk)
                native_out = _native_outputs(outputs)
        except BaseException:
            _epx.dispatch_cancel(self.runtime, plan)  # the launched receive drains instead of waiting
            raise
        recv_x, recv_scales, recv_idx, recv_weights = outputs
        event = _epx.dispatch_receive(self.runtime, plan, native_in, native_out, order)

        if derived:
            record_stream(derived, self._current_stream_object())  # comm-stream tensors the caller reads
        if async_finish or allocate_on_comm_stream:
            inputs = (x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert)
            overlap = self._finish(event, inputs, outputs, async_finish, allocate_on_comm_stream)
        else:
            overlap = EventOverlap()
        return DispatchResult(tokens.recv_view(recv_x), recv_scales, recv_idx, recv_weights, per_expert_list,
                              new_handle, overlap)

    def _guess_rows(self, launches: bool, num_worst_tokens: int) -> int:
        """Rows of the outputs a receive launched with the count exchange writes into when the rows fit
        (DispatchOutputGuess): the last dispatch's rows plus a margin. 0, no guess: the receive is not launched
        early, worst-case mode, no dispatch yet, or across nodes (where the receive always follows the host's
        wait)."""
        last = self._last_recv_rows
        if not launches or num_worst_tokens or last is None or self._spans_nodes:
            return 0
        return last + last // 16 + 64

    def _call_natively(self, config: Optional[Config], call: Callable[..., Any], *args: Any) -> Any:
        """The torch extension's `call`(*args) (checks, outputs and the launch in C++) with `config` applied for it:
        its result, or None where the arguments are not the plain case (the extension's None, or the TypeError of
        its argument conversion): the caller's Python path then raises the named error or copes. The config is
        restored unless the call ran."""
        previous_config = self._apply_config(config)
        try:
            made = call(*args)
        except TypeError:
            made = None
        except BaseException:
            self._restore_config(previous_config)
            raise
        if made is None:
            self._restore_config(previous_config)
        return made

    def _dispatch_tuple(self, x: Tokens, topk_idx: Any, topk_weights: Any, num_experts: Optional[int],
                        is_token_in_rank: Any, num_tokens_per_expert: Any, num_tokens_per_rank: Any,
                        expert_alignment: int, num_worst_tokens: int, config: Optional[Config],
                        previous_event: Any, async_finish: bool, allocate_on_comm_stream: bool,
                        launch_receive: bool = True) -> Optional[Tuple]:
        """A dispatch given its layout, through the torch extension (checks, outputs, the count exchange, the
        receive and the handle in C++), as DispatchResult's fields in order (deep_ep.Buffer's per-call path takes
        them without the result object) and the first tensor of DeepEP's handle tuple (None across nodes), or None
        where its arguments are not the plain case: dispatch's Python then raises or copes. The same steps as that
        Python: a launched receive (launch_receive) writes into outputs sized from the last dispatch's rows when
        they fit."""
        data, scales = x if isinstance(x, (tuple, list)) and len(x) == 2 else (x, None)
        numel = getattr(num_tokens_per_expert, "numel", None)
        if numel is None or torch_calls is None or is_token_in_rank is None:
            return None  # no extension, no layout, or not a tensor: dispatch's Python computes it or names it
        num_experts_given = num_experts
        num_experts = numel()
        if num_experts_given is not None and num_experts_given != num_experts:
            return None  # the Python names the mismatch
        guess_rows = self._guess_rows(launch_receive, num_worst_tokens)
        made = self._call_natively(
            config, torch_calls.dispatch, self.runtime, self._device_index, self.num_ranks, data, scales, topk_idx,
            topk_weights, is_token_in_rank, num_tokens_per_expert, num_tokens_per_rank, expert_alignment,
            num_worst_tokens, launch_receive, guess_rows, event_handle(previous_event), async_finish,
            allocate_on_comm_stream, self._comm_stream_handle, self._window)
        if made is None:
            return None
        recv_x, recv_scales, recv_idx, recv_weights, native_handle, rows, per_expert_list, event, views = made
        if not num_worst_tokens:
            self._last_recv_rows = rows
        num_tokens, hidden = data.shape
        handle = DispatchHandle(native_handle, id(self), num_tokens, rows, hidden, num_experts,
                                0 if topk_idx is None else topk_idx.size(1), int(num_worst_tokens), per_expert_list,
                                self.num_ranks, self)
        tuple_head = None
        if views is not None:  # the handle's views, made with the call (what DispatchHandle would make on first use)
            fields = handle.__dict__
            fields["deep_ep_matrices"] = views[:3]
            fields["recv_src_idx"], fields["is_token_in_rank"], fields["send_head"], tuple_head = views[3:]
        return (recv_x, recv_scales, recv_idx, recv_weights, per_expert_list, handle,
                EventOverlap(event if async_finish else None), tuple_head)

    def _native_with(self, handle: Any) -> bool:
        """Whether a call with `handle` may take the torch extension's path: the extension loaded and the handle a
        dispatch handle of this Buffer (anything else takes the Python path, which names the error)."""
        return torch_calls is not None and isinstance(handle, DispatchHandle) and handle.buffer_id == id(self)

    def _dispatch_cached_tuple(self, x: Tokens, handle: DispatchHandle, expert_alignment: int,
                               config: Optional[Config], previous_event: Any, async_finish: bool,
                               allocate_on_comm_stream: bool) -> Tuple:
        """A cached dispatch's (recv_x, recv_x_scales, event), for deep_ep.Buffer's per-call path: positional
        arguments and no result object."""
        if self._native_with(handle):
            made = self._dispatch_cached_natively(x, handle, expert_alignment, config, previous_event, async_finish,
                                                  allocate_on_comm_stream)
            if made is not None:
                return made
        result = self.dispatch(x, handle=handle, expert_alignment=expert_alignment, config=config,
                               previous_event=previous_event, async_finish=async_finish,
                               allocate_on_comm_stream=allocate_on_comm_stream)
        return result.recv_x, result.recv_x_scales, result.event

    def _dispatch_cached_natively(self, x: Tokens, handle: DispatchHandle, expert_alignment: int,
                                  config: Optional[Config], previous_event: Any, async_finish: bool,
                                  allocate_on_comm_stream: bool) -> Optional[Tuple]:
        """A cached dispatch through the torch extension (checks, outputs and the call in C++) as (recv_x,
        recv_x_scales, event), or None where its arguments are not the plain case: dispatch's Python then raises
        or copes."""
        data, scales = x if isinstance(x, tuple) and len(x) == 2 else (x, None)
        made = self._call_natively(
            config, torch_calls.dispatch_cached, self.runtime, self._device_index, handle.native, data, scales,
            handle.num_tokens, handle.num_recv_rows, handle.num_experts, expert_alignment,
            event_handle(previous_event), async_finish, allocate_on_comm_stream, self._comm_stream_handle,
            self._window)
        if made is None:
            return None
        recv_x, recv_scales, event = made
        return recv_x, recv_scales, EventOverlap(event if async_finish else None)

    def combine(self, x: Any, handle: DispatchHandle, *, topk_weights: Any = None,
                bias: Union[None, Any, Tuple[Any, ...]] = None, config: Optional[Config] = None,
                previous_event: Any = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> CombineResult:
        """Sums, without weights, the copies of each token that come back from the ranks it was dispatched to,
        then adds up to two BF16 biases [T, H]. topk_weights [N, K] are summed the same way."""
        if not isinstance(handle, DispatchHandle):
            raise error("handle", type(handle).__name__, "must be the handle of a dispatch")
        check(handle.buffer_id == id(self), "handle", "from another Buffer", "must come from this Buffer")
        if torch_calls is not None:
            made = self._combine_natively(x, handle, topk_weights, bias, config, previous_event, async_finish,
                                          allocate_on_comm_stream)
            if made is not None:
                return CombineResult(*made)
        t = torch()
        # x's hidden may differ from the dispatch's (as in DeepEP): the C++ combine sizes its records from it.
        check_tensor(x, "x", dtype=t.bfloat16, ndim=2, shape=(handle.num_recv_rows, None))
        hidden = x.size(1)
        num_tokens = handle.num_tokens
        if topk_weights is not None:
            check_tensor(topk_weights, "topk_weights", dtype=t.float32, ndim=2, shape=(handle.num_recv_rows, None))
        biases = _biases(bias)
        for i, b in enumerate(biases):
            check_tensor(b, f"bias[{i}]", dtype=t.bfloat16, shape=(num_tokens, hidden))
        previous_config = self._apply_config(config)
        order = self._order(previous_event, async_finish)
        with maybe_stream(self._alloc_stream(previous_event, async_finish, allocate_on_comm_stream)):
            empty = self._empty()
            combined_x = empty((num_tokens, hidden), (hidden, 1), t.bfloat16)
            combined_weights = None
            if topk_weights is not None:
                num_topk = topk_weights.size(1)
                combined_weights = empty((num_tokens, num_topk), (num_topk, 1), t.float32)
        num_biases = len(biases)
        native_in = _epx.CombineInput(x=x.data_ptr(), topk_weights=pointer(topk_weights),
                                      num_topk=0 if topk_weights is None else topk_weights.size(1), hidden=hidden,
                                      bias0=pointer(biases[0]) if num_biases > 0 else 0,
                                      bias1=pointer(biases[1]) if num_biases > 1 else 0)
        out = _epx.CombineOutput(combined_x=combined_x.data_ptr(), combined_topk_weights=pointer(combined_weights))
        try:
            event = _epx.combine(self.runtime, handle.native, native_in, out, order)
        except Exception:
            self._restore_config(previous_config)
            raise
        if async_finish or allocate_on_comm_stream:
            overlap = self._finish(event, (x, topk_weights, *biases), (combined_x, combined_weights), async_finish,
                                   allocate_on_comm_stream)
        else:
            overlap = EventOverlap()
        return CombineResult(combined_x, combined_weights, overlap)

    def _combine_tuple(self, x: Any, handle: DispatchHandle, topk_weights: Any, bias: Any, config: Optional[Config],
                       previous_event: Any, async_finish: bool, allocate_on_comm_stream: bool) -> Tuple:
        """combine's result as a plain tuple (combined_x, combined_topk_weights, event), for deep_ep.Buffer's per-call
        path: positional arguments and no result object (about 1.5 us of Python less per call)."""
        if self._native_with(handle):
            made = self._combine_natively(x, handle, topk_weights, bias, config, previous_event, async_finish,
                                          allocate_on_comm_stream)
            if made is not None:
                return made
        result = self.combine(x, handle, topk_weights=topk_weights, bias=bias, config=config,
                              previous_event=previous_event, async_finish=async_finish,
                              allocate_on_comm_stream=allocate_on_comm_stream)
        return result.combined_x, result.combined_topk_weights, result.event

    def _combine_natively(self, x: Any, handle: DispatchHandle, topk_weights: Any, bias: Any,
                          config: Optional[Config], previous_event: Any, async_finish: bool,
                          allocate_on_comm_stream: bool) -> Optional[Tuple]:
        """combine through the torch extension (checks, outputs and the call in C++) as (combined_x,
        combined_topk_weights, event), or None where its arguments are not the plain case: combine's Python then
        raises or copes."""
        try:
            biases = _biases(bias)
        except EpxError:
            return None  # combine's Python raises it, after the checks that come first
        bias0, bias1 = (biases + [None, None])[:2]
        made = self._call_natively(
            config, torch_calls.combine, self.runtime, self._device_index, handle.native, x, handle.num_recv_rows,
            handle.num_tokens, topk_weights, bias0, bias1, event_handle(previous_event), async_finish,
            allocate_on_comm_stream, self._comm_stream_handle)
        if made is None:
            return None
        combined_x, combined_weights, event = made
        return combined_x, combined_weights, EventOverlap(event if async_finish else None)

    # ---- Low-latency mode ----

    def low_latency_dispatch(self, x: Any, topk_idx: Any, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             *, cumulative_local_expert_recv_stats: Any = None,
                             dispatch_wait_recv_cost_stats: Any = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False, topk_weights: Any = None) -> LowLatencyDispatchResult:
        """Dispatch into the fixed per-expert layout [L, R*M, H] (CUDA-graph capturable, no CPU sync).

        topk_weights (float32 [T, K], optional; every rank passes them or none does) travel with the tokens,
        so that low_latency_combine(..., pre_reduce=True) can sum each token's rows on the expert side.

        At most two low-latency results may be pending at once (double buffering): a third call raises
        EpxError until an earlier one's hook has run.
        """
        return LowLatencyDispatchResult(*self._low_latency_dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
            dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook,
            topk_weights, True)[:6])

    def _low_latency_dispatch(self, x: Any, topk_idx: Any, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                              cumulative_local_expert_recv_stats: Any, dispatch_wait_recv_cost_stats: Any,
                              use_fp8: bool, round_scale: bool, use_ue8m0: bool, async_finish: bool,
                              return_recv_hook: bool, topk_weights: Any, handle_keeps_src_info: bool,
                              separate_outputs: bool = False) -> Tuple:
        """low_latency_dispatch's work, for it and deep_ep.Buffer: (recv_x, recv_x_scales, recv_count, handle,
        event, hook, recv_src_info). handle_keeps_src_info=False leaves recv_src_info out of the handle (deep_ep's
        tuple holds it, and the handle is attached to it: holding it back would make a reference cycle).
        separate_outputs: each output in an allocation of its own (the Python path), for epx.ops, whose outputs
        may not share storage; the torch extension packs them into two blocks."""
        if torch_calls is not None and not separate_outputs:
            try:  # called directly, not through _call_natively (no config here): the per-step path of decoding
                made = torch_calls.low_latency_dispatch(
                    self.runtime, self._device_index, self.num_ranks, x, topk_idx, num_max_dispatch_tokens_per_rank,
                    num_experts, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                    round_scale, use_ue8m0, async_finish, return_recv_hook, topk_weights)
            except TypeError:  # an argument of another type: the Python below names it
                made = None
            if made is not None:
                recv_x, recv_scales, recv_count, src_info, topk_pos, layout_range, listings, result = made
                return self._low_latency_dispatched(
                    result, x, topk_idx, recv_x, recv_scales, recv_count, src_info, topk_pos, layout_range, listings,
                    num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
                    dispatch_wait_recv_cost_stats, topk_weights, async_finish, return_recv_hook,
                    handle_keeps_src_info)
        t = torch()
        check_tensor(x, "x", dtype=t.bfloat16, ndim=2)
        num_tokens, hidden = x.shape
        topk_idx = as_topk_idx(topk_idx, shape=(num_tokens, None))
        num_topk = topk_idx.size(1)
        num_max_dispatch_tokens_per_rank = int(num_max_dispatch_tokens_per_rank)
        num_experts = int(num_experts)
        use_fp8, use_ue8m0 = bool(use_fp8), bool(use_ue8m0)
        if topk_weights is not None:
            check_tensor(topk_weights, "topk_weights", dtype=t.float32, ndim=2, shape=(num_tokens, num_topk))
        native_in = _epx.LowLatencyDispatchInput(
            x=x.data_ptr(), topk_idx=topk_idx.data_ptr(), num_tokens=num_tokens, num_topk=num_topk, hidden=hidden,
            num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank, num_experts=num_experts,
            use_fp8=use_fp8, round_scale=bool(round_scale), use_ue8m0=use_ue8m0,
            return_recv_hook=bool(return_recv_hook),
            cumulative_local_expert_recv_stats=0 if cumulative_local_expert_recv_stats is None else
            cumulative_local_expert_recv_stats.data_ptr(),
            dispatch_wait_recv_cost_stats=pointer(dispatch_wait_recv_cost_stats),
            topk_weights=0 if topk_weights is None else topk_weights.data_ptr())
        num_local, num_rows, num_scale_columns = self._low_latency_sizes(native_in)
        if cumulative_local_expert_recv_stats is not None:
            check_tensor(cumulative_local_expert_recv_stats, "cumulative_local_expert_recv_stats", dtype=t.int32,
                         shape=(num_local,), ndim=1)
        if dispatch_wait_recv_cost_stats is not None:
            check_tensor(dispatch_wait_recv_cost_stats, "dispatch_wait_recv_cost_stats", dtype=t.int64,
                         shape=(self.num_ranks,), ndim=1)
        # Outputs (sizes, strides, dtype): compact unless said otherwise.
        empty, num_ranks = self._empty(), self.num_ranks
        recv_x = empty((num_local, num_rows, hidden), (num_rows * hidden, hidden, 1),
                       t.float8_e4m3fn if use_fp8 else t.bfloat16)
        recv_scales = None
        if use_fp8:
            # [L, R*M, columns], column-major in the last two dimensions (the memory of [L, columns, R*M]).
            recv_scales = empty((num_local, num_rows, num_scale_columns), (num_scale_columns * num_rows, 1, num_rows),
                                t.int32 if use_ue8m0 else t.float32)
        recv_count = empty((num_local,), (1,), t.int32)
        src_info = empty((num_local, num_rows), (num_rows, 1), t.int32)
        topk_pos = empty((num_local, num_rows), (num_rows, 1), t.int32)
        # One int64 per (local expert, source): begin << 32 | count, DeepEP's packed recv_layout_range.
        layout_range = empty((num_local, num_ranks), (num_ranks, 1), t.int64)
        listings = None
        if topk_weights is not None:
            max_tokens = num_max_dispatch_tokens_per_rank
            listings = empty((num_ranks, max_tokens, num_topk, 2), (max_tokens * num_topk * 2, num_topk * 2, 2, 1),
                             t.int32)
        out = _epx.LowLatencyDispatchOutput(
            recv_x=recv_x.data_ptr(), recv_x_scales=0 if recv_scales is None else recv_scales.data_ptr(),
            recv_count=recv_count.data_ptr(), recv_src_info=src_info.data_ptr(), recv_topk_pos=topk_pos.data_ptr(),
            recv_layout_range=layout_range.data_ptr(), recv_token_listings=pointer(listings))
        result = _epx.low_latency_dispatch(self.runtime, native_in, out, self._order(None, async_finish))
        return self._low_latency_dispatched(
            result, x, topk_idx, recv_x, recv_scales, recv_count, src_info, topk_pos, layout_range, listings,
            num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
            dispatch_wait_recv_cost_stats, topk_weights, async_finish, return_recv_hook, handle_keeps_src_info)

    def _low_latency_sizes(self, native_in: Any) -> Tuple[int, int, int]:
        """(local experts, rows per expert, scale columns) of a low-latency dispatch's outputs for the shape of
        native_in (an _epx.LowLatencyDispatchInput; its pointers are not read). They depend on the shape alone:
        asked once per shape (the first ask validates it)."""
        key = (native_in.num_max_dispatch_tokens_per_rank, native_in.hidden, native_in.num_experts,
               native_in.num_topk, native_in.use_fp8, native_in.use_ue8m0)
        sizes = self._ll_sizes.get(key)
        if sizes is None:
            native_sizes = _epx.low_latency_dispatch_sizes(self.runtime, native_in)
            sizes = (native_sizes.num_local_experts, native_sizes.num_rows_per_expert, native_sizes.num_scale_columns)
            self._ll_sizes[key] = sizes
        return sizes

    def _low_latency_dispatched(self, result: Any, x: Any, topk_idx: Any, recv_x: Any, recv_scales: Any,
                                recv_count: Any, src_info: Any, topk_pos: Any, layout_range: Any, listings: Any,
                                num_max_dispatch_tokens_per_rank: int, num_experts: int,
                                cumulative_local_expert_recv_stats: Any, dispatch_wait_recv_cost_stats: Any,
                                topk_weights: Any, async_finish: bool, return_recv_hook: bool,
                                handle_keeps_src_info: bool) -> Tuple:
        """_low_latency_dispatch's result from the native call's `result` and the tensors it filled."""
        num_tokens, hidden = x.shape
        handle = LowLatencyHandle(result.handle, id(self), src_info if handle_keeps_src_info else None, topk_pos,
                                  layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts, num_tokens,
                                  topk_idx.shape[1], listings)
        if return_recv_hook or async_finish:
            tensors = (x, topk_idx, recv_x, recv_scales, recv_count, src_info, topk_pos, layout_range,
                       cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, topk_weights, listings)
            hook = RecvHook(result.hook, tensors, self._device_index) if return_recv_hook else None
            # Without async_finish the call finished in stream order (no event; see _finish).
            event = EventOverlap(result.event, tensors) if async_finish else EventOverlap()
        else:
            hook, event = None, EventOverlap()
        return recv_x, recv_scales, recv_count, handle, event, hook, src_info

    def low_latency_combine(self, x: Any, topk_idx: Any, topk_weights: Any, handle: LowLatencyHandle, *,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Any = None,
                            combine_wait_recv_cost_stats: Any = None,
                            pre_reduce: bool = False, logfmt_within_node: bool = False) -> LowLatencyCombineResult:
        """Weighted combine of the expert outputs x [L, R*M, H] (in the dispatch's layout) back to each token's
        rank: combined_x[t] = sum over k of topk_weights[t, k] * output of (t, k). With zero_copy, x is (or the
        rows were written to) get_next_low_latency_combine_buffer(handle).

        use_logfmt: LogFMT-10 on the links between nodes: rows that cross to another node go packed, 0.64x
        BF16's bytes, for arithmetic on both sides (one H200, 128 tokens of hidden 7168: 44 us more than
        BF16). That pays on links slower than about 120 GB/s (a network), not over NVLink, so rows within
        the node travel as BF16 (exact) and a Buffer within one node runs the BF16 combine.
        logfmt_within_node: with use_logfmt, code the rows within the node as well (the same numerics on
        every link, at LogFMT's cost). Every rank passes the same values.

        pre_reduce: each rank first sums a token's rows over its own experts with the weights its dispatch
        carried (the dispatch needs topk_weights; topk_weights here may be None) and sends one row per
        (token, rank); the token's rank adds those in ascending rank order (reference:
        LowLatencyCombineOptions.pre_reduce). Every rank passes the same value."""
        if not isinstance(handle, LowLatencyHandle):
            raise error("handle", type(handle).__name__, "must be the handle of a low_latency_dispatch")
        return LowLatencyCombineResult(*self._low_latency_combine(
            x, topk_idx, topk_weights, handle, handle.recv_src_info, use_logfmt, zero_copy, async_finish,
            return_recv_hook, out, combine_wait_recv_cost_stats, pre_reduce, logfmt_within_node))

    def _low_latency_combine(self, x: Any, topk_idx: Any, topk_weights: Any, handle: LowLatencyHandle,
                             recv_src_info: Any, use_logfmt: bool, zero_copy: bool, async_finish: bool,
                             return_recv_hook: bool, out: Any, combine_wait_recv_cost_stats: Any, pre_reduce: bool,
                             logfmt_within_node: bool) -> Tuple[Any, EventOverlap, Optional[RecvHook]]:
        """low_latency_combine's work, for it and deep_ep.Buffer: (combined_x, event, hook). `handle` is a
        LowLatencyHandle; recv_src_info is its dispatch's (kept alive while the call may still read it)."""
        check(handle.buffer_id == id(self), "handle", "from another Buffer", "must come from this Buffer")
        num_tokens, hidden, num_topk = handle.num_tokens, handle.hidden, handle.num_topk
        if pre_reduce and handle.recv_token_listings is None:
            raise error("pre_reduce", True, "needs a handle from a low_latency_dispatch given topk_weights")
        made = None
        if torch_calls is not None:
            try:  # as in _low_latency_dispatch
                made = torch_calls.low_latency_combine(
                    self.runtime, self._device_index, handle.native, x, handle.num_experts // self.num_ranks,
                    self.num_ranks * handle.num_max_dispatch_tokens_per_rank, topk_idx, topk_weights, num_tokens,
                    hidden, num_topk, self.num_ranks, combine_wait_recv_cost_stats, out, use_logfmt,
                    logfmt_within_node, pre_reduce, zero_copy, async_finish, return_recv_hook)
            except TypeError:
                made = None
        if made is not None:
            out, result = made
            return self._low_latency_combined(result, out, x, topk_idx, topk_weights, handle, recv_src_info,
                                              combine_wait_recv_cost_stats, async_finish, return_recv_hook)
        t = torch()
        if x is not None:
            num_rows = self.num_ranks * handle.num_max_dispatch_tokens_per_rank
            check_tensor(x, "x", dtype=t.bfloat16, ndim=3,
                         shape=(handle.num_experts // self.num_ranks, num_rows, hidden))
        elif not zero_copy:
            raise error("x", None, "is required without zero_copy")
        topk_idx = as_topk_idx(topk_idx, shape=(num_tokens, num_topk))
        if topk_weights is not None or not pre_reduce:
            check_tensor(topk_weights, "topk_weights", dtype=t.float32, ndim=2, shape=(num_tokens, num_topk))
        if combine_wait_recv_cost_stats is not None:
            check_tensor(combine_wait_recv_cost_stats, "combine_wait_recv_cost_stats", dtype=t.int64, ndim=1,
                         shape=(self.num_ranks,))
        if out is None:
            out = self._empty()((num_tokens, hidden), (hidden, 1), t.bfloat16)
        else:
            check_tensor(out, "out", dtype=t.bfloat16, shape=(num_tokens, hidden), ndim=2)
        # With zero_copy the rows are already in the Buffer: a caller's x (DeepEP callers pass their own) only
        # has its shape checked, as DeepEP does.
        native_in = _epx.LowLatencyCombineInput(
            x=0 if zero_copy else x.data_ptr(), topk_idx=topk_idx.data_ptr(),
            topk_weights=0 if topk_weights is None else topk_weights.data_ptr(),
            num_tokens=num_tokens, num_topk=num_topk, use_logfmt=bool(use_logfmt),
            logfmt_within_node=bool(logfmt_within_node), pre_reduce=bool(pre_reduce), zero_copy=bool(zero_copy),
            return_recv_hook=bool(return_recv_hook), combine_wait_recv_cost_stats=pointer(combine_wait_recv_cost_stats))
        result = _epx.low_latency_combine(self.runtime, handle.native, native_in, out.data_ptr(),
                                          self._order(None, async_finish))
        return self._low_latency_combined(result, out, x, topk_idx, topk_weights, handle, recv_src_info,
                                          combine_wait_recv_cost_stats, async_finish, return_recv_hook)

    def _low_latency_combined(self, result: Any, out: Any, x: Any, topk_idx: Any, topk_weights: Any,
                              handle: LowLatencyHandle, recv_src_info: Any, combine_wait_recv_cost_stats: Any,
                              async_finish: bool, return_recv_hook: bool
                              ) -> Tuple[Any, EventOverlap, Optional[RecvHook]]:
        """_low_latency_combine's result from the native call's `result`."""
        if return_recv_hook or async_finish:
            tensors = (x, topk_idx, topk_weights, out, recv_src_info, handle.recv_topk_pos, handle.recv_layout_range,
                       handle.recv_token_listings, combine_wait_recv_cost_stats)
            hook = RecvHook(result.hook, tensors, self._device_index) if return_recv_hook else None
            event = EventOverlap(result.event, tensors) if async_finish else EventOverlap()
        else:
            hook, event = None, EventOverlap()
        return out, event, hook

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Resets the low-latency signals of every rank (collective over the unmasked ranks). Needed to recover
        after an error, and before a rank that was masked takes part again; the mask is kept."""
        _epx.clean_low_latency_buffer(self.runtime, num_max_dispatch_tokens_per_rank, hidden, num_experts,
                                      self._order(None, False))

    # ---- Rank masks (low-latency mode; docs/RELIABILITY.md) ----

    @property
    def enable_shrink(self) -> bool:
        return bool(self.runtime.enable_shrink)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """mask=True masks rank_to_mask in this rank's low-latency calls (nothing is sent to it, nothing of it
        is awaited, its experts' contributions are left out of combine); False unmasks it. Stream ordered on
        the current stream; the kernels read the mask when they run, so it also changes CUDA graph replays."""
        check(isinstance(rank_to_mask, int) and not isinstance(rank_to_mask, bool), "rank_to_mask",
              repr(rank_to_mask), "must be an int")
        _epx.low_latency_update_mask_buffer(self.runtime, rank_to_mask, bool(mask), self._order(None, False))

    def low_latency_query_mask_buffer(self, mask_status: Any) -> None:
        """Writes the mask into mask_status, torch.int32 [num_ranks]: 1 = masked, 0 = not (a CPU tensor is
        filled after a synchronizing copy)."""
        t = torch()
        check_tensor(mask_status, "mask_status", dtype=t.int32, ndim=1, shape=(self.num_ranks,), cuda=False)
        if mask_status.is_cuda:
            _epx.low_latency_query_mask_buffer(self.runtime, pointer(mask_status), self._order(None, False))
            return
        status = t.empty(self.num_ranks, dtype=t.int32, device=self.device)
        _epx.low_latency_query_mask_buffer(self.runtime, pointer(status), self._order(None, False))
        mask_status.copy_(status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmasks every rank."""
        _epx.low_latency_clean_mask_buffer(self.runtime, self._order(None, False))

    def low_latency_masked_ranks(self) -> Tuple[List[int], List[int]]:
        """(masked ranks, ranks masked by a timed-out wait with enable_shrink), read now from the device
        (host-synchronous; it does not wait for calls in flight: synchronize first)."""
        masked, by_timeout = _epx.read_low_latency_mask(self.runtime)
        return ([r for r in range(self.num_ranks) if masked >> r & 1],
                [r for r in range(self.num_ranks) if by_timeout >> r & 1])

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> Any:
        """The BF16 [L, R*M, H] view (in the Buffer) the next zero-copy combine with this handle sends from."""
        if not isinstance(handle, LowLatencyHandle):
            raise error("handle", type(handle).__name__, "must be the handle of a low_latency_dispatch")
        address = _epx.next_low_latency_combine_buffer(self.runtime, handle.native)
        num_local = handle.num_experts // self.num_ranks
        shape = (num_local, self.num_ranks * handle.num_max_dispatch_tokens_per_rank, handle.hidden)
        return array_view(address, torch().bfloat16, shape, self, self.device)


_NO_CONTEXT = contextlib.nullcontext()  # stateless: one serves every `with`


def _dispatch_outputs(t: Any, empty: Callable[[tuple, tuple, Any], Any], rows: int, hidden: int, dtype: Any,
                      num_scales: int, scales_dtype: Any, num_topk: int) -> Tuple[Any, Any, Any, Any]:
    """(recv_x, recv_x_scales or None, recv_topk_idx or None, recv_topk_weights or None) for `rows` rows, from
    `empty` (Buffer._empty)."""
    recv_x = empty((rows, hidden), (hidden, 1), dtype)
    recv_scales = empty((rows, num_scales), (num_scales, 1), scales_dtype) if scales_dtype is not None else None
    recv_idx = recv_weights = None
    if num_topk > 0:
        recv_idx = empty((rows, num_topk), (num_topk, 1), t.int64)
        recv_weights = empty((rows, num_topk), (num_topk, 1), t.float32)
    return recv_x, recv_scales, recv_idx, recv_weights


def _native_outputs(outputs: Tuple[Any, Any, Any, Any]) -> Any:
    recv_x, recv_scales, recv_idx, recv_weights = outputs
    return _epx.DispatchOutput(recv_x=recv_x.data_ptr(), recv_x_scales=pointer(recv_scales),
                               recv_topk_idx=pointer(recv_idx), recv_topk_weights=pointer(recv_weights))


def _biases(bias: Any) -> List[Any]:
    if bias is None:
        return []
    if isinstance(bias, (tuple, list)):
        biases = [b for b in bias if b is not None]
        if len(biases) > 2:
            raise error("bias", f"{len(biases)} tensors", "must be at most 2 tensors")
        return biases
    return [bias]
