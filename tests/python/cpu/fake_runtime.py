"""A stand-in for the CUDA half of epx._epx, so the torch layer (epx.Buffer, epx.compat.deep_ep, epx.training)
can run end to end on the CPU with one rank: every call is answered by the CPU reference, reading and writing
the CPU tensors behind the addresses the layer passes. It checks the layer's plumbing (arguments, output shapes,
dtypes, strides, handles, events, hooks, autograd), not the kernels: the GPU tests do that."""

from types import SimpleNamespace

import numpy as np

import epx
import epx_tools.reference as ref
from epx import _epx


class Struct:
    """Plays the binding's plain structs: attributes are set one by one."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


class BoundStruct(Struct):
    """Plays one struct of the binding with exactly its fields and defaults: a field the torch layer sets that the
    binding does not have fails here, as it would on the GPU."""

    defaults = {}  # field name -> default, made once by bound_struct

    def __init__(self, **fields):
        for name, value in self.defaults.items():
            object.__setattr__(self, name, value)
        for name, value in fields.items():
            setattr(self, name, value)

    @classmethod
    def fields(cls):
        return sorted(cls.defaults)

    def __setattr__(self, name, value):
        if name not in self.defaults:
            raise AttributeError(f"{type(self).__name__} has no field {name!r} in the binding")
        object.__setattr__(self, name, value)


def _struct(zeros, flags="", **others):
    """Fields and defaults: `zeros` (pointers as ints, counts) 0, `flags` False, `others` as given."""
    return {**dict.fromkeys(zeros.split(), 0), **dict.fromkeys(flags.split(), False), **others}


# The call structs of the binding's CUDA runtime part (python/src/runtime.cpp), which a build without CUDA
# (EPX_WITH_CUDA=OFF) lacks: their fields and defaults as include/epx/normal.hpp and low_latency.hpp declare them.
# bound_struct falls back to these; test_torch_layer checks them against a CUDA build's binding.
STAND_IN_STRUCTS = {
    "DispatchLayoutOutput": _struct("num_tokens_per_rank num_tokens_per_expert is_token_in_rank "
                                    "num_tokens_per_rdma_rank"),
    "DispatchInput": _struct("x x_scales num_scales num_tokens hidden topk_idx topk_weights num_topk num_experts "
                             "is_token_in_rank num_tokens_per_expert num_tokens_per_rank num_worst_tokens",
                             format="bf16", expert_alignment=1),
    "DispatchOutput": _struct("recv_x recv_x_scales recv_topk_idx recv_topk_weights"),
    "CombineInput": _struct("x topk_weights num_topk bias0 bias1 hidden"),
    "CombineOutput": _struct("combined_x combined_topk_weights"),
    "LowLatencyDispatchInput": _struct("x topk_idx num_tokens num_topk hidden num_max_dispatch_tokens_per_rank "
                                       "num_experts cumulative_local_expert_recv_stats "
                                       "dispatch_wait_recv_cost_stats topk_weights",
                                       "round_scale use_ue8m0 return_recv_hook", use_fp8=True),
    "LowLatencyDispatchOutput": _struct("recv_x recv_x_scales recv_count recv_src_info recv_topk_pos "
                                        "recv_layout_range recv_token_listings"),
    "LowLatencyCombineInput": _struct("x topk_idx topk_weights num_tokens num_topk combine_wait_recv_cost_stats",
                                      "use_logfmt logfmt_within_node pre_reduce zero_copy return_recv_hook"),
}


def native_defaults(native):
    """The fields of the compiled struct `native` (its properties) with the defaults of native()."""
    instance = native()
    return {field: getattr(instance, field) for field, value in vars(native).items() if isinstance(value, property)}


def bound_struct(name):
    """The fake of the binding's struct `name`, with the compiled struct's fields and defaults, or, in a build
    without the CUDA runtime part, those of its stand-in (STAND_IN_STRUCTS)."""
    native = getattr(_epx, name, None)
    defaults = native_defaults(native) if native is not None else dict(STAND_IN_STRUCTS[name])
    return type(name, (BoundStruct,), {"defaults": defaults})


class FakeEvent:
    """Plays an epx Event (handle); as previous_event it passes its cuda_event (as a torch.cuda.Event does)."""

    def __init__(self, valid):
        self.valid = valid
        self.waits = 0
        self.handle = self.cuda_event = id(self)

    def wait_on(self, stream):
        self.waits += 1


class FakeHook:
    """Runs the deferred receive (writes the outputs) when called, once."""

    def __init__(self, receive):
        self.valid = True
        self.done = False
        self._receive = receive

    def __call__(self, stream):
        if self.done:
            raise epx.EpxError("invalid hook = already run: a receive hook runs once")
        self._receive()
        self.done = True


NO_HOOK = SimpleNamespace(valid=False, done=False)


def copy_config(config):
    names = ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
             "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens")
    return _epx.Config(*(getattr(config, name) for name in names))


class FakeRuntime:
    """What epx.Buffer keeps as .runtime. Like _epx.Buffer, `config` reads a copy and takes a checked
    _epx.Config; num_sms is its SM budget."""

    def __init__(self):
        self._config = _epx.Config()
        self.configs_set = 0
        self.comm_stream = 0
        self.num_nvl_bytes = 1 << 20
        self.num_nvl_output_bytes = 0
        self.num_nvl_staging_bytes = 0
        self.nvl_output_window = 0
        self.num_rdma_bytes = 1 << 20
        self.is_destroyed = False
        self.ranks_per_node = 1
        self.spans_nodes = False
        self.enable_shrink = False
        self.device = 0
        self.dispatch_count_wait_ns = 0

    @property
    def config(self):
        return copy_config(self._config)

    @config.setter
    def config(self, config):
        if not isinstance(config, _epx.Config):
            raise TypeError(f"config must be an _epx.Config, not {type(config).__name__}")
        _epx.validate_config(config)
        self._config = copy_config(config)
        self.configs_set += 1

    @property
    def num_sms(self):
        return self._config.num_sms

    @num_sms.setter
    def num_sms(self, num_sms):
        config = self.config
        config.num_sms = num_sms
        self.config = config

    def destroy(self):
        self.is_destroyed = True

    # The failure protocol of _epx.Buffer: fail() plays a device wait that gave up.
    failure = None
    resets = 0

    def fail(self, message):
        self.failure = message

    @property
    def is_aborted(self):
        return self.failure is not None

    def check(self):
        if self.failure is not None:
            raise epx.EpxError(self.failure)

    def reset(self):
        self.failure = None
        self.resets += 1


def write_bf16(tensor, bits):
    import torch

    tensor.view(torch.int16).copy_(torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).reshape(tensor.shape))


def write(tensor, values):
    import torch

    tensor.copy_(torch.from_numpy(np.ascontiguousarray(values)).reshape(tensor.shape))


class FakeBinding:
    """Replaces epx.buffer._epx: one rank, answers from the reference."""

    EpxError = epx.EpxError
    WITH_CUDA = True
    WITH_NVSHMEM = False
    TokenFormat = SimpleNamespace(BF16="bf16", FP8="fp8")
    DispatchOverlap = SimpleNamespace(NONE="none", LAUNCH_RECEIVE="launch receive",
                                      HANDLE_BEFORE_RECEIVE="handle before receive")
    StreamOrder = Struct
    DispatchLayoutOutput = bound_struct("DispatchLayoutOutput")
    DispatchInput = bound_struct("DispatchInput")
    DispatchOutput = bound_struct("DispatchOutput")
    DispatchOutputGuess = Struct
    CombineInput = bound_struct("CombineInput")
    CombineOutput = bound_struct("CombineOutput")
    LowLatencyDispatchInput = bound_struct("LowLatencyDispatchInput")
    LowLatencyDispatchOutput = bound_struct("LowLatencyDispatchOutput")
    LowLatencyCombineInput = bound_struct("LowLatencyCombineInput")

    def __init__(self):
        self.registry = {}
        self.orders = []
        self.overlaps = []
        self.guesses = []
        self.cancelled = 0
        self.cleaned = 0

    def pointer(self, tensor):
        """Stands in for epx.buffer.pointer: remembers which tensor an address belongs to."""
        if tensor is None:
            return 0
        self.registry[tensor.data_ptr()] = tensor
        return tensor.data_ptr()

    def tensor(self, address):
        return self.registry[address] if address else None

    def host(self, address):
        tensor = self.tensor(address)
        return None if tensor is None else tensor.detach().numpy()

    # ---- Normal mode ----

    def get_dispatch_layout(self, runtime, topk_idx, num_tokens, num_topk, num_experts, out, order):
        self.orders.append(order)
        ids = self.host(topk_idx)
        num_ranks = self.tensor(out.num_tokens_per_rank).numel()  # 1, unless a test makes the group wider
        per_rank, per_expert, in_rank = ref.dispatch_layout(ids, num_experts, num_ranks)
        write(self.tensor(out.num_tokens_per_rank), per_rank)
        write(self.tensor(out.num_tokens_per_expert), per_expert)
        write(self.tensor(out.is_token_in_rank), in_rank)
        if out.num_tokens_per_rdma_rank:
            write(self.tensor(out.num_tokens_per_rdma_rank),
                  ref.tokens_per_node(ids, num_experts, num_ranks, runtime.ranks_per_node))
        return FakeEvent(order.async_finish)

    def dispatch_notify(self, runtime, inp, order, cached, overlap="none", guess=None):
        self.orders.append(order)
        self.overlaps.append(overlap)
        self.guesses.append(guess)
        fp8 = inp.format == "fp8"
        item = ref.NormalRankInput()
        x = self.tensor(inp.x)
        if fp8:
            # The kernels move scale words without reading them (dispatch_receive gathers them): the reference
            # gets placeholders of its one layout, [T, hidden / 128] floats.
            item.x_fp8, item.x_scales = ref.fp8_bytes(x), np.zeros((inp.num_tokens, inp.hidden // 128), np.float32)
        else:
            item.x = ref.bf16_bits(x)
        if cached is not None:
            item.is_token_in_rank = cached.in_rank
        elif inp.topk_idx:
            item.topk_idx, item.topk_weights = self.host(inp.topk_idx), self.host(inp.topk_weights)
        else:
            item.is_token_in_rank = self.host(inp.is_token_in_rank)
        outputs, handle = ref.normal_dispatch([item], num_ranks=1, num_experts=inp.num_experts, hidden=inp.hidden,
                                              fp8=fp8, expert_alignment=inp.expert_alignment,
                                              num_worst_tokens=inp.num_worst_tokens)
        in_rank = ref.dispatch_layout(item.topk_idx, inp.num_experts, 1)[2] if item.topk_idx is not None \
            else item.is_token_in_rank
        native = Struct(reference=handle, output=outputs[0], in_rank=in_rank,
                        num_recv_per_rank=list(outputs[0].num_recv_tokens_per_rank))
        self.add_handle_arrays(native, np.asarray(in_rank, dtype=bool).reshape(-1), runtime.config.num_sms // 2,
                               outputs[0].recv_src_token_idx)
        # As the C++ dispatch_notify: a guess is used by a launched receive of a dispatch with a host wait.
        rows_in_guess = (guess is not None and overlap == self.DispatchOverlap.LAUNCH_RECEIVE and cached is None
                         and inp.num_worst_tokens == 0 and outputs[0].num_rows <= guess.rows)
        return Struct(num_recv_rows=outputs[0].num_rows,
                      num_recv_tokens_per_expert=outputs[0].num_recv_tokens_per_expert_list, handle=native,
                      rows_in_guess=rows_in_guess)

    def add_handle_arrays(self, native, in_rank, num_channels, recv_src_idx):
        """The device arrays of a C++ handle, for one rank: channel c carries tokens [c * ceil(T / C), ...)."""
        import torch

        num_tokens = len(in_rank)
        per_channel = -(-num_tokens // num_channels) if num_tokens else 0
        kept_before = np.concatenate([[0], np.cumsum(in_rank)]).astype(np.int32)
        begins = [min(c * per_channel, num_tokens) for c in range(num_channels)] + [num_tokens]
        offsets = kept_before[begins]
        send_head = np.full((num_tokens, 1), -1, dtype=np.int32)
        for token in np.flatnonzero(in_rank):
            channel = token // per_channel
            send_head[token, 0] = kept_before[token] - kept_before[begins[channel]]
        # DeepEP's matrices as the notify kernel writes them (src/kernels/deep_ep_matrices.hpp), for one rank:
        # rank_prefix_matrix [[rows]], channel_prefix_matrix -1, recv_channel_prefix_matrix.
        matrices = np.concatenate([[offsets[-1]], np.full(num_channels, -1), offsets[:-1] - offsets[0]])
        arrays = {"recv_channel_offset": torch.from_numpy(offsets),
                  "deep_ep_matrices": torch.from_numpy(matrices.astype(np.int32)),
                  "send_head": torch.from_numpy(send_head),
                  "is_token_in_rank": torch.from_numpy(in_rank.astype(np.uint8).reshape(num_tokens, 1)),
                  "recv_src_idx": torch.from_numpy(np.asarray(recv_src_idx, dtype=np.int32).copy())}
        native.arrays = arrays  # keeps them alive
        native.num_channels = num_channels
        native.num_nodes, native.num_forward_records = 1, 0  # one rank: one node
        for name, tensor in arrays.items():
            setattr(native, name, self.pointer(tensor))

    def device_view(self, address, num_bytes, dtype, shape, owner, device):
        """Stands in for epx._util.device_view over the CPU tensors the fake handles own."""
        return self.registry[address].view(dtype).view(shape)

    def array_view(self, address, dtype, shape, owner, device):
        """Stands in for epx._util.array_view (the same views)."""
        return self.device_view(address, None, dtype, shape, owner, device)

    def dispatch_cancel(self, runtime, plan):
        self.cancelled += 1

    def dispatch_receive(self, runtime, plan, inp, out, order):
        import torch

        expected = plan.handle.output

        def rows(address):  # a guess's outputs hold more rows than were received
            return self.tensor(address)[:expected.num_rows]

        if inp.format == "fp8":
            write(rows(out.recv_x).view(torch.uint8), expected.recv_x_fp8)
            source = np.asarray(expected.recv_src_token_idx)
            scales = self.host(inp.x_scales)[np.maximum(source, 0)]
            write(rows(out.recv_x_scales), np.where((source >= 0)[:, None], scales, 0).astype(scales.dtype))
        else:
            write_bf16(rows(out.recv_x), expected.recv_x)
        if out.recv_topk_idx:
            write(rows(out.recv_topk_idx), expected.recv_topk_idx)
            write(rows(out.recv_topk_weights), expected.recv_topk_weights)
        return FakeEvent(order.async_finish)

    def combine(self, runtime, handle, inp, out, order):
        self.orders.append(order)
        weights = self.host(inp.topk_weights)
        bias0 = None if not inp.bias0 else [ref.bf16_bits(self.tensor(inp.bias0))]
        bias1 = None if not inp.bias1 else [ref.bf16_bits(self.tensor(inp.bias1))]
        combined, combined_weights = ref.normal_combine(
            handle.reference, [ref.bf16_bits(self.tensor(inp.x))],
            topk_weights=None if weights is None else [weights], bias0=bias0, bias1=bias1)[0]
        write_bf16(self.tensor(out.combined_x), combined)
        if out.combined_topk_weights:
            write(self.tensor(out.combined_topk_weights), combined_weights)
        return FakeEvent(order.async_finish)

    # ---- Low-latency mode ----

    def low_latency_dispatch_sizes(self, runtime, inp):
        columns = 0 if not inp.use_fp8 else (inp.hidden // 128 + 3) // 4 if inp.use_ue8m0 else inp.hidden // 128
        return Struct(num_local_experts=inp.num_experts, num_rows_per_expert=inp.num_max_dispatch_tokens_per_rank,
                      num_scale_columns=columns)

    def low_latency_dispatch(self, runtime, inp, out, order):
        import torch

        self.orders.append(order)
        params = ref.low_latency_params(num_ranks=1, num_experts=inp.num_experts, hidden=inp.hidden,
                                        num_topk=inp.num_topk,
                                        num_max_dispatch_tokens_per_rank=inp.num_max_dispatch_tokens_per_rank)
        x, ids = ref.bf16_bits(self.tensor(inp.x)), self.host(inp.topk_idx)

        def receive():
            (got,) = ref.low_latency_dispatch([x], [ids], params, use_fp8=inp.use_fp8, round_scale=inp.round_scale,
                                              use_ue8m0=inp.use_ue8m0)
            recv_x = self.tensor(out.recv_x)
            if inp.use_fp8:
                write(recv_x.view(torch.uint8), got.recv_x)
                scales = self.tensor(out.recv_x_scales)
                write(scales, got.recv_x_scales.view(np.int32) if inp.use_ue8m0 else got.recv_x_scales)
            else:
                write_bf16(recv_x, got.recv_x)
            write(self.tensor(out.recv_count), got.recv_count)
            stats = self.tensor(inp.cumulative_local_expert_recv_stats)
            if stats is not None:
                stats += torch.from_numpy(got.recv_count)

        handle = Struct(num_tokens=len(ids), num_topk=inp.num_topk, hidden=inp.hidden,
                        num_max_dispatch_tokens_per_rank=inp.num_max_dispatch_tokens_per_rank,
                        num_experts=inp.num_experts, params=params)
        if inp.return_recv_hook:
            return Struct(handle=handle, event=FakeEvent(False), hook=FakeHook(receive))
        receive()
        return Struct(handle=handle, event=FakeEvent(order.async_finish), hook=NO_HOOK)

    def low_latency_combine(self, runtime, handle, inp, combined_x, order):
        self.orders.append(order)
        expert_out = ref.bf16_bits(self.tensor(inp.x))
        ids, weights = self.host(inp.topk_idx), self.host(inp.topk_weights)

        def receive():
            (combined,) = ref.low_latency_combine([expert_out], [ids], [weights], handle.params,
                                                  use_logfmt=inp.use_logfmt,
                                                  logfmt_within_node=inp.logfmt_within_node)
            write_bf16(self.tensor(combined_x), combined)

        if inp.return_recv_hook:
            return Struct(event=FakeEvent(False), hook=FakeHook(receive))
        receive()
        return Struct(event=FakeEvent(order.async_finish), hook=NO_HOOK)

    def clean_low_latency_buffer(self, runtime, num_max_dispatch_tokens_per_rank, hidden, num_experts, order):
        self.cleaned += 1

    # ---- Rank masks: the bits live here, as in the Buffer's device words ----

    mask = 0

    def low_latency_update_mask_buffer(self, runtime, rank_to_mask, mask, order):
        self.orders.append(order)
        bit = 1 << rank_to_mask
        self.mask = self.mask | bit if mask else self.mask & ~bit

    def low_latency_query_mask_buffer(self, runtime, mask_status, order):
        self.orders.append(order)
        status = self.tensor(mask_status)
        for r in range(status.numel()):
            status[r] = self.mask >> r & 1

    def low_latency_clean_mask_buffer(self, runtime, order):
        self.orders.append(order)
        self.mask = 0

    def read_low_latency_mask(self, runtime):
        return self.mask, 0


def _patch(setattr, binding, check_on_cpu):
    """Points epx.buffer (and the helpers it shares) at `binding`, CPU tensors and stream 0."""
    import epx._util as util
    import epx.buffer as buffer_module
    import epx.tokens as tokens_module

    stream = SimpleNamespace(cuda_stream=0)
    setattr(buffer_module, "_epx", binding)
    # The torch extension calls the real binding: with a fake one, every call takes the Python path.
    setattr(buffer_module, "torch_calls", None)
    setattr(buffer_module, "pointer", binding.pointer)
    for module in (buffer_module, util):
        if hasattr(module, "current_stream"):
            setattr(module, "current_stream", lambda device=None: stream)
        if hasattr(module, "current_stream_handle"):
            setattr(module, "current_stream_handle", lambda device_index=None: 0)
    setattr(util, "device_view", binding.device_view)
    for module in (buffer_module, util):
        if hasattr(module, "array_view"):
            setattr(module, "array_view", binding.array_view)
    for module in (buffer_module, tokens_module):
        setattr(module, "check_tensor", check_on_cpu)
    setattr(buffer_module, "record_stream", lambda tensors, stream: None)


def _fake_buffer():
    import torch

    import epx.buffer as buffer_module

    buffer = object.__new__(buffer_module.Buffer)
    buffer.runtime = FakeRuntime()
    buffer.rank, buffer.num_ranks = 0, 1
    buffer.group = None
    buffer.device = torch.device("cpu")
    buffer.comm_stream = None
    buffer._comm_stream_handle = 0  # the cudaStream_t the torch extension would take
    buffer.low_latency_mode = True
    if hasattr(buffer, "_init_call_state"):
        buffer._init_call_state()
    return buffer


def install(monkeypatch):
    """Patches epx.buffer to run on the CPU against FakeBinding; returns (epx.Buffer, binding)."""
    import epx._util as util

    import torch

    binding = FakeBinding()
    real_check = util.check_tensor
    cpu_check = lambda *a, **k: real_check(*a, **{**k, "cuda": False})  # noqa: E731
    _patch(monkeypatch.setattr, binding, cpu_check)
    # The layer also passes addresses as tensor.data_ptr(): each is remembered too, as binding.pointer does.
    real_data_ptr = torch.Tensor.data_ptr

    def data_ptr(tensor):
        address = real_data_ptr(tensor)
        binding.registry[address] = tensor
        return address

    monkeypatch.setattr(torch.Tensor, "data_ptr", data_ptr)
    return _fake_buffer(), binding


# ---- Stubbed native calls: what the torch layer itself costs ----


class _NoEvent:
    valid = False
    handle = cuda_event = 0


class StubHook:
    valid = True
    done = False

    def __call__(self, stream):
        pass


class StubBinding(FakeBinding):
    """FakeBinding whose calls return at once, without the reference: a profile of a call through it is the
    torch layer's own host cost (bench/python_host_overhead.py --stub). Its structs are the compiled binding's
    (what the layer pays to fill them on a GPU; FakeBinding's stand-ins in a build without the CUDA runtime part);
    pointer and device_view are the layer's own. One rank; every token goes to it."""

    def __init__(self, num_tokens, hidden, num_experts, num_channels):
        super().__init__()
        import epx._util as util

        for name in ("StreamOrder", "DispatchLayoutOutput", "DispatchInput", "DispatchOutput", "DispatchOutputGuess",
                     "CombineInput", "CombineOutput", "LowLatencyDispatchInput", "LowLatencyDispatchOutput",
                     "LowLatencyCombineInput", "TokenFormat", "DispatchOverlap"):
            if hasattr(_epx, name):  # a build without the CUDA runtime part keeps FakeBinding's stand-ins
                setattr(self, name, getattr(_epx, name))
        native = Struct(num_recv_per_rank=[num_tokens])
        self.add_handle_arrays(native, np.ones(num_tokens, dtype=bool), num_channels, np.arange(num_tokens))
        self.pointer = util.pointer  # after the handle's arrays are registered for device_view
        if hasattr(util, "array_view"):  # the layer's own (DLPack works on CPU memory too); an older layer's
            self.device_view, self.array_view = util.device_view, util.array_view  # views need CUDA: the fake's
        self.no_event = _NoEvent()
        self.plan = Struct(num_recv_rows=num_tokens, num_recv_tokens_per_expert=[num_tokens] * num_experts,
                           handle=native, rows_in_guess=False)
        self.guess_plan = Struct(**{**self.plan.__dict__, "rows_in_guess": True})
        self.ll_result = Struct(handle=Struct(), event=self.no_event, hook=StubHook())
        self.ll_sizes = {}

    def get_dispatch_layout(self, runtime, topk_idx, num_tokens, num_topk, num_experts, out, order):
        return self.no_event

    def dispatch_notify(self, runtime, inp, order, cached, overlap="none", guess=None):
        fits = guess is not None and guess.rows >= self.plan.num_recv_rows
        return self.guess_plan if fits else self.plan

    def dispatch_receive(self, runtime, plan, inp, out, order):
        return self.no_event

    def combine(self, runtime, handle, inp, out, order):
        return self.no_event

    def low_latency_dispatch_sizes(self, runtime, inp):
        key = (inp.num_experts, inp.num_max_dispatch_tokens_per_rank, inp.hidden, inp.use_fp8, inp.use_ue8m0)
        if key not in self.ll_sizes:
            self.ll_sizes[key] = FakeBinding.low_latency_dispatch_sizes(self, runtime, inp)
        return self.ll_sizes[key]

    def low_latency_dispatch(self, runtime, inp, out, order):
        return self.ll_result

    def low_latency_combine(self, runtime, handle, inp, combined_x, order):
        return self.ll_result


class StubTorchCalls:
    """A stand-in for the torch extension epx._epx_torch whose calls return results made once, shaped as the
    extension's: with it a profile of a call is the Python the extension's path runs on a GPU (deep_ep, epx.Buffer,
    the handles and results), without the extension's C++ (python_host_overhead.py --stub --stub-extension). One
    rank; every token goes to it."""

    def __init__(self, binding, num_tokens, hidden, num_experts, num_topk, num_channels):
        import torch

        self.binding = binding
        rows = num_tokens
        self.views = (torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, num_channels, dtype=torch.int32),
                      torch.zeros(1, num_channels, dtype=torch.int32), torch.zeros(rows, dtype=torch.int32),
                      torch.zeros(rows, 1, dtype=torch.bool), torch.zeros(rows, 1, dtype=torch.int32),
                      torch.zeros(1, 1, dtype=torch.int32))
        self.recv_x = torch.zeros(rows, hidden, dtype=torch.bfloat16)
        self.recv_idx = torch.zeros(rows, num_topk, dtype=torch.int64)
        self.recv_weights = torch.zeros(rows, num_topk)
        self.per_expert = [rows] * num_experts
        self.layout = (torch.zeros(1, dtype=torch.int32), None, torch.zeros(num_experts, dtype=torch.int32),
                       torch.zeros(num_tokens, 1, dtype=torch.bool), binding.no_event)
        self.combined = torch.zeros(num_tokens, hidden, dtype=torch.bfloat16)
        self.combined_weights = torch.zeros(num_tokens, num_topk)
        self.ll = {}  # (tokens, hidden, experts) -> the low-latency dispatch's tensors

    def get_dispatch_layout(self, *arguments):
        return self.layout

    def dispatch(self, *arguments):
        plan = self.binding.plan
        return (self.recv_x, None, self.recv_idx, self.recv_weights, plan.handle, plan.num_recv_rows,
                self.per_expert, self.binding.no_event, self.views)

    def dispatch_cached(self, *arguments):
        return self.recv_x, None, self.binding.no_event

    def combine(self, *arguments):
        return self.combined, self.combined_weights, self.binding.no_event

    def low_latency_dispatch(self, runtime, device, num_ranks, x, topk_idx, num_max_tokens, num_experts, *rest):
        import torch

        key = (num_max_tokens, x.shape[1], num_experts)
        if key not in self.ll:
            num_rows = num_ranks * num_max_tokens
            local = num_experts // num_ranks
            self.ll[key] = (torch.zeros(local, num_rows, x.shape[1], dtype=torch.uint8),
                            torch.zeros(local, num_rows, x.shape[1] // 128), torch.zeros(local, dtype=torch.int32),
                            torch.zeros(local, num_rows, dtype=torch.int32),
                            torch.zeros(local, num_rows, dtype=torch.int32),
                            torch.zeros(local, num_ranks, dtype=torch.int64), None, self.binding.ll_result)
        return self.ll[key]

    def low_latency_combine(self, runtime, device, handle, x, num_local, num_rows, topk_idx, topk_weights,
                            num_tokens, hidden, *rest):
        return self.combined, self.binding.ll_result


def install_stub(num_tokens, hidden, num_experts, monkeypatch=None, extension=False, num_topk=8):
    """epx.buffer patched to run on the CPU against a StubBinding, through monkeypatch (a test) or for good (a
    script), and with `extension` against a StubTorchCalls too; returns (epx.Buffer, binding)."""
    import functools

    import epx._util as util

    buffer = _fake_buffer()
    num_channels = buffer.runtime.config.num_sms // 2
    binding = StubBinding(num_tokens, hidden, num_experts, num_channels)
    set_attribute = setattr if monkeypatch is None else monkeypatch.setattr
    _patch(set_attribute, binding, functools.partial(util.check_tensor, cuda=False))
    if extension:  # the torch extension's path, its calls stubbed (StubTorchCalls)
        import epx.buffer as buffer_module

        calls = StubTorchCalls(binding, num_tokens, hidden, num_experts, num_topk, num_channels)
        set_attribute(buffer_module, "torch_calls", calls)
        buffer._device_index = 0
    return buffer, binding


def deep_ep_wrapper(buffer):
    """A deep_ep.Buffer over the fake epx.Buffer `buffer`, without its constructor's collectives."""
    import epx.compat.deep_ep as deep_ep

    wrapper = object.__new__(deep_ep.Buffer)
    wrapper.rank, wrapper.group_size, wrapper.group = 0, 1, None
    wrapper.explicitly_destroy = True
    wrapper.runtime = buffer
    return wrapper


def sample_tokens(hidden, num_topk, num_tokens=6, seed=0):
    """BF16 tokens [T, hidden], top-2 ids over 4 experts (with -1s, one token routed nowhere) and weights."""
    import torch

    x = ref.native.random_bf16_tokens(seed, num_tokens, hidden, 0).reshape(num_tokens, hidden)
    ids = np.array([[0, 1], [2, -1], [-1, -1], [3, 0], [1, 2], [-1, 3]], dtype=np.int64)[:num_tokens]
    weights = ref.native.random_topk_weights(seed, num_tokens, num_topk).reshape(num_tokens, num_topk)
    return ref.to_torch_bf16(x), torch.from_numpy(ids), torch.from_numpy(weights)
