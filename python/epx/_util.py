"""Small helpers shared by the torch layer: the lazy torch import, argument checks that raise EpxError in the
C++ message style, stream/event handles and tensor views of device memory the Buffer owns."""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterable, Optional

from ._ext import _epx

EpxError = _epx.EpxError


_torch_module = None  # torch, once imported
_tensor_type: Any = None  # torch.Tensor, once torch is imported
_raw_stream: Any = None  # device index -> the cudaStream_t of torch's current stream there, as an int


# What a torch-facing call says when torch is not installed (a bare ModuleNotFoundError names no remedy).
TORCH_MISSING = ("torch is not installed: epx's torch layer (epx.Buffer, epx.training, epx.compat.deep_ep) needs "
                 "PyTorch with CUDA; install a CUDA build of torch (pip install torch, or the command for your "
                 "CUDA version at https://pytorch.org/get-started/locally/)")


def torch():
    """The torch module, imported on first use (the package itself needs no torch). Without torch installed:
    EpxError(TORCH_MISSING)."""
    global _torch_module, _tensor_type
    if _torch_module is None:
        try:
            import torch as _torch
        except ModuleNotFoundError as missing:
            if missing.name != "torch":  # torch is there but something it imports is not: its own message
                raise
            raise EpxError(TORCH_MISSING) from missing

        _tensor_type = _torch.Tensor
        _torch_module = _torch
    return _torch_module


def error(name: str, value: Any, rule: str) -> Exception:
    """EpxError("invalid NAME = VALUE: RULE") (the C++ EPX_CHECK wording), for `raise error(...)` where a
    check's message is built only once it fails."""
    return EpxError(f"invalid {name} = {value}: {rule}")


def check(condition: bool, name: str, value: Any, rule: str) -> None:
    """Raises EpxError("invalid NAME = VALUE: RULE") unless condition holds (the C++ EPX_CHECK wording). Its
    arguments are evaluated on every call: on a per-call path, pass no formatted string (use
    ``if not condition: raise error(...)`` there)."""
    if not condition:
        raise error(name, value, rule)


def check_tensor(
    tensor: Any,
    name: str,
    *,
    dtype: Any = None,
    ndim: Optional[int] = None,
    shape: Optional[tuple] = None,
    cuda: bool = True,
    contiguous: bool = True,
) -> None:
    """Checks type, device, dtype, rank, shape (None entries match anything) and contiguity of an argument.

    A passing check costs its comparisons: the message (naming the argument, its value and the rule) is built
    only when one fails."""
    if _tensor_type is None:
        torch()
    if (
        isinstance(tensor, _tensor_type)
        and (not cuda or tensor.is_cuda)
        and (dtype is None or tensor.dtype == dtype)
        and (ndim is None or tensor.dim() == ndim)
        and (shape is None or _shape_matches(tensor.shape, shape))
        and (not contiguous or tensor.is_contiguous())
    ):
        return
    _raise_tensor_error(tensor, name, dtype, ndim, shape, cuda, contiguous)


def _shape_matches(sizes: Any, shape: tuple) -> bool:
    if sizes == shape:  # a full shape (the common case): one comparison in C
        return True
    for axis, expected in enumerate(shape):
        if expected is not None and (axis >= len(sizes) or sizes[axis] != expected):
            return False
    return True


def _raise_tensor_error(tensor: Any, name: str, dtype: Any, ndim: Optional[int], shape: Optional[tuple],
                        cuda: bool, contiguous: bool) -> None:
    """The checks of check_tensor one by one, in order, raising the first that fails with its message."""
    check(isinstance(tensor, _tensor_type), name, type(tensor).__name__, "must be a torch.Tensor")
    if cuda:
        check(tensor.is_cuda, f"{name}.device", tensor.device, "must be a CUDA device")
    if dtype is not None:
        check(tensor.dtype == dtype, f"{name}.dtype", tensor.dtype, f"must be {dtype}")
    if ndim is not None:
        check(tensor.dim() == ndim, f"{name}.dim()", tensor.dim(), f"must be {ndim}")
    if shape is not None:
        for axis, expected in enumerate(shape):
            if expected is not None:
                check(
                    tensor.size(axis) == expected,
                    f"{name}.shape",
                    tuple(tensor.shape),
                    f"must have size {expected} in dimension {axis} (expected {_describe_shape(shape)})",
                )
    if contiguous:
        check(tensor.is_contiguous(), name, "a non-contiguous tensor", "must be contiguous")


def _describe_shape(shape: tuple) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


def fast_empty_strided(device: Any) -> Optional[Callable[[tuple, tuple, Any], Any]]:
    """Inductor's allocator for `device`'s type, f(sizes, strides, dtype) on the current device and stream
    (torch._C._dynamo.guards._empty_strided_cuda / _cpu: what torch.compile's generated code calls), or None where
    this torch has none. It skips torch.empty's argument parsing: about half of a small allocation's host time."""
    guards = getattr(getattr(torch()._C, "_dynamo", None), "guards", None)
    return getattr(guards, f"_empty_strided_{device.type}", None)


def pointer(tensor: Any) -> int:
    """Device address of a tensor, 0 for None."""
    return 0 if tensor is None else tensor.data_ptr()


def current_stream(device: Any = None) -> Any:
    """torch's current CUDA stream (the caller's "compute stream") on a device (default: the current device) as a
    torch.cuda.Stream object. Per-call paths take current_stream_handle instead (no Stream object)."""
    return torch().cuda.current_stream(device)


def current_stream_handle(device_index: Optional[int] = None) -> int:
    """The cudaStream_t (an int) of torch's current stream on a device (default: the current device), read
    without building a torch.cuda.Stream: what torch.cuda.stream(...) contexts and CUDA-graph capture made
    current, as torch.cuda.current_stream(device).cuda_stream would say."""
    global _raw_stream
    if _raw_stream is None:
        _raw_stream = _raw_stream_reader()
    if device_index is None:
        device_index = torch().cuda.current_device()
    return _raw_stream(device_index)


def _raw_stream_reader() -> Any:
    t = torch()
    reader = getattr(t._C, "_cuda_getCurrentRawStream", None)  # what Inductor's generated code calls
    if reader is not None:
        return reader
    return lambda device_index: t.cuda.current_stream(device_index).cuda_stream


def event_handle(event: Any) -> int:
    """cudaEvent_t of a previous_event argument: None, an EventOverlap, an epx Event, a deep_ep EventHandle or a
    torch.cuda.Event (the last two through their ``cuda_event``)."""
    if event is None:
        return 0
    inner = getattr(event, "event", event)  # EventOverlap -> its event
    if inner is None:
        return 0
    if isinstance(inner, _epx_event_type()):
        return inner.handle
    handle = getattr(inner, "cuda_event", None)  # torch.cuda.Event or epx.EventHandle
    if handle is None:
        raise EpxError(
            f"invalid previous_event = {type(event).__name__}: must be an EventOverlap, an epx Event, an "
            "EventHandle or a torch.cuda.Event"
        )
    check(handle != 0, "previous_event", "an unrecorded torch.cuda.Event", "must have been recorded")
    return int(handle)


def _epx_event_type():
    return getattr(_epx, "Event", ())


def record_stream(tensors: Iterable[Any], stream: Any) -> None:
    """Tells torch's caching allocator that `stream` uses these tensors (None entries are skipped)."""
    for tensor in tensors:
        if tensor is not None and tensor.numel() > 0:
            tensor.record_stream(stream)


def maybe_stream(stream: Any):
    """torch.cuda.stream(stream), or nothing when stream is None."""
    return torch().cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class StreamSwitch:
    """A reusable ``with``: torch.cuda.stream(stream) for a per-call path (nothing when stream is None).

    On the stream's own device it swaps torch's current stream by its ids (torch._C's getter and setter, which
    torch.cuda.stream calls through several Stream objects), and restores the previous one on exit, so a CUDA
    graph capture or an outer torch.cuda.stream context sees what it would with torch.cuda.stream. Another current
    device, or a torch without those calls, takes torch.cuda.stream itself."""

    __slots__ = ("_stream", "_ids", "_saved")

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._ids = None if stream is None else (stream.stream_id, stream.device_index, stream.device_type)
        self._saved: list = []

    def __enter__(self) -> None:
        ids = self._ids
        if ids is None:
            return
        c = torch()._C
        if _has_raw_stream_calls(c) and c._cuda_getDevice() == ids[1]:
            previous = c._cuda_getCurrentStream(ids[1])  # (stream_id, device_index, device_type) since torch 1.13
            if isinstance(previous, tuple):
                c._cuda_setStream(*ids)
                self._saved.append(previous)
                return
        context = torch().cuda.stream(self._stream)
        context.__enter__()
        self._saved.append(context)

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        if self._ids is None:
            return
        saved = self._saved.pop()
        if isinstance(saved, tuple):
            torch()._C._cuda_setStream(*saved)
        else:
            saved.__exit__(exc_type, exc_value, traceback)


def _has_raw_stream_calls(c: Any) -> bool:
    return hasattr(c, "_cuda_setStream") and hasattr(c, "_cuda_getCurrentStream") and hasattr(c, "_cuda_getDevice")


def element_size(dtype: Any) -> int:
    """Bytes per element of a torch dtype."""
    size = getattr(dtype, "itemsize", None)  # torch >= 2.1
    return size if size is not None else torch().empty((), dtype=dtype).element_size()


# DLPack's (type code, bits) of the torch dtypes a view is made of directly; others are made of bytes and viewed.
_dlpack_types: Any = None
_DLPACK_DEVICE_TYPES = {"cpu": 1, "cuda": 2}
_BYTES = (1, 8)  # DLPack uint8


def _dlpack_type(dtype: Any) -> Any:
    global _dlpack_types
    if _dlpack_types is None:
        t = torch()
        types = {t.int8: (0, 8), t.int16: (0, 16), t.int32: (0, 32), t.int64: (0, 64), t.uint8: (1, 8),
                 t.float16: (2, 16), t.float32: (2, 32), t.float64: (2, 64), t.bfloat16: (4, 16)}
        # kDLBool (DLPack 0.8) where this torch takes it: a probe on a byte of host memory.
        probe = t.ones(1, dtype=t.uint8)
        try:
            if _from_dlpack(_epx.device_view_capsule(probe.data_ptr(), 6, 8, (1,), 1, 0, probe)).dtype == t.bool:
                types[t.bool] = (6, 8)
        except Exception:  # an older torch: bool views are bytes viewed as bool
            pass
        _dlpack_types = types
    return _dlpack_types.get(dtype)


def device_view(address: int, num_bytes: int, dtype: Any, shape: Optional[tuple], owner: Any, device: Any):
    """A tensor of `dtype` (and `shape`, or 1-D) over num_bytes bytes at a device address, keeping `owner`
    alive. Made in one call from a DLPack capsule of the binding (dtypes DLPack has no common code for, such as
    bool and FP8, as bytes viewed as `dtype`)."""
    t = torch()
    element_bytes = element_size(dtype)
    if num_bytes % element_bytes != 0:
        raise error("num_bytes", num_bytes, f"must be a multiple of {element_bytes}")
    num_elements = num_bytes // element_bytes
    if shape is None:
        shape = (num_elements,)
    if num_bytes == 0:
        return t.empty(0, dtype=t.uint8, device=device).view(dtype).view(shape)
    device_type = _DLPACK_DEVICE_TYPES.get(device.type)
    if device_type is None:
        return t.as_tensor(_DeviceMemory(address, num_bytes, owner), device=device).view(dtype).view(shape)
    code_bits = _dlpack_type(dtype)
    if code_bits is not None and math.prod(shape) == num_elements:
        return _from_dlpack(_epx.device_view_capsule(address, code_bits[0], code_bits[1], shape, device_type,
                                                     device.index or 0, owner))
    # Bytes, viewed (a shape that does not fit: torch's view names the mismatch).
    raw = _from_dlpack(_epx.device_view_capsule(address, _BYTES[0], _BYTES[1], (num_bytes,), device_type,
                                                device.index or 0, owner))
    return raw.view(dtype).view(shape)


def array_view(address: int, dtype: Any, shape: tuple, owner: Any, device: Any) -> Any:
    """device_view of a compact array of `shape` (the view a handle's arrays take)."""
    code_bits = _dlpack_type(dtype)
    device_type = _DLPACK_DEVICE_TYPES.get(device.type)
    if code_bits is None or device_type is None or not address:
        return device_view(address, math.prod(shape) * element_size(dtype), dtype, shape, owner, device)
    return _from_dlpack(_epx.device_view_capsule(address, code_bits[0], code_bits[1], shape, device_type,
                                                 device.index or 0, owner))


_from_capsule: Any = None  # torch's DLPack import, once found


def _from_dlpack(capsule: Any) -> Any:
    global _from_capsule
    if _from_capsule is None:
        t = torch()
        _from_capsule = getattr(t._C, "_from_dlpack", None) or t.utils.dlpack.from_dlpack
    return _from_capsule(capsule)


class _DeviceMemory:
    """Device memory of an owner exposed through __cuda_array_interface__; the tensors torch builds on it keep
    this object (and so the owner) alive."""

    def __init__(self, address: int, num_bytes: int, owner: Any) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (num_bytes,),
            "typestr": "|u1",
            "data": (address, False),
            "strides": None,
            "version": 2,
        }
