"""Small helpers shared by the torch layer: the lazy torch import, argument checks that raise EpxError in the
C++ message style, stream/event handles and tensor views of device memory the Buffer owns."""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Optional

from ._ext import _epx

EpxError = _epx.EpxError


def torch():
    """The torch module, imported on first use (the package itself needs no torch)."""
    import torch as _torch

    return _torch


def check(condition: bool, name: str, value: Any, rule: str) -> None:
    """Raises EpxError("invalid NAME = VALUE: RULE") unless condition holds (the C++ EPX_CHECK wording)."""
    if not condition:
        raise EpxError(f"invalid {name} = {value}: {rule}")


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
    """Checks type, device, dtype, rank, shape (None entries match anything) and contiguity of an argument."""
    t = torch()
    check(isinstance(tensor, t.Tensor), name, type(tensor).__name__, "must be a torch.Tensor")
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


def pointer(tensor: Any) -> int:
    """Device address of a tensor, 0 for None."""
    return 0 if tensor is None else tensor.data_ptr()


def current_stream() -> Any:
    """torch's current CUDA stream (the caller's "compute stream")."""
    return torch().cuda.current_stream()


def current_stream_handle() -> int:
    return current_stream().cuda_stream


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


def device_view(address: int, num_bytes: int, dtype: Any, shape: Optional[tuple], owner: Any, device: Any):
    """A tensor of `dtype` (and `shape`, or 1-D) over num_bytes bytes at a device address, keeping `owner`
    alive."""
    t = torch()
    element_bytes = t.empty((), dtype=dtype).element_size()
    check(num_bytes % element_bytes == 0, "num_bytes", num_bytes, f"must be a multiple of {element_bytes}")
    if num_bytes == 0:
        raw = t.empty(0, dtype=t.uint8, device=device)
    else:
        raw = t.as_tensor(_DeviceMemory(address, num_bytes, owner), device=device)
    view = raw.view(dtype)
    return view if shape is None else view.view(shape)
