"""EventOverlap (the event an asynchronous call returns) and EventHandle (an event recorded on the current
stream), as in DeepEP."""

from __future__ import annotations

from typing import Any, Optional, Tuple

from . import _util
from ._ext import _epx


def _record_on_current_stream() -> Any:
    """A new epx Event recorded on torch's current CUDA stream."""
    if not _epx.WITH_CUDA:
        raise _util.EpxError("epx was built without CUDA (EPX_WITH_CUDA=OFF): events need the CUDA runtime")
    return _epx.Event.record(_util.current_stream_handle())


class EventHandle:
    """DeepEP's EventHandle: constructing one records a CUDA event on the current stream
    (``torch.cuda.current_stream()``); ``current_stream_wait()`` makes the then-current stream wait for it.

    Pass it wrapped, ``EventOverlap(EventHandle())``, as ``previous_event`` to order a call after the work
    queued before it (a bare EventHandle is accepted too). ``cuda_event`` is the cudaEvent_t as an int, as on
    a torch.cuda.Event.
    """

    __slots__ = ("native",)

    def __init__(self) -> None:
        self.native = _record_on_current_stream()  # the epx Event

    @property
    def valid(self) -> bool:
        return bool(self.native.valid)

    @property
    def cuda_event(self) -> int:
        return int(self.native.handle)

    def current_stream_wait(self) -> None:
        """The current CUDA stream waits for the event."""
        self.native.wait_on(_util.current_stream_handle())

    def wait(self, stream: Any = None) -> None:
        """`stream` (default: the current stream) waits for the event, as torch.cuda.Event.wait."""
        if stream is None:
            self.current_stream_wait()
        else:
            self.native.wait_on(stream.cuda_stream)

    def __repr__(self) -> str:
        return f"EventHandle(cuda_event={self.cuda_event:#x})"


class EventOverlap:
    """Wraps the CUDA event an asynchronous call (``async_finish=True``) records on the communication stream,
    plus tensors that must stay alive until the current stream has waited for it.

    ``event.current_stream_wait()`` makes the current stream wait for the communication. Used as a context
    manager, the block runs on the current stream overlapped with the communication, and the current stream
    waits for it on exit::

        result = buffer.dispatch(..., async_finish=True)
        with result.event:
            ...  # computation independent of the dispatch
        # the dispatch's outputs are ready for the current stream here

    ``event`` is an ``epx`` Event, an EventHandle, a ``torch.cuda.Event``, or None (a call that finished
    synchronously); without one both ``current_stream_wait()`` and the context manager do nothing (DeepEP's
    ``current_stream_wait()`` asserts there).
    """

    def __init__(self, event: Any = None, extra_tensors: Optional[Tuple[Any, ...]] = None) -> None:
        if event is not None and hasattr(event, "valid") and not event.valid:
            event = None  # an empty C++ Event: the call finished in stream order
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """The current CUDA stream waits for the event (no-op without one)."""
        if self.event is None:
            return
        if isinstance(self.event, EventHandle):
            self.event.current_stream_wait()
            return
        if hasattr(self.event, "wait_on"):  # an epx Event
            self.event.wait_on(_util.current_stream_handle())
        else:  # a torch.cuda.Event
            self.event.wait(_util.current_stream())

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        if self.event is not None:
            self.current_stream_wait()

    def __repr__(self) -> str:
        state = "pending" if self.event is not None else "none"
        extra = 0 if self.extra_tensors is None else len(self.extra_tensors)
        return f"EventOverlap(event={state}, extra_tensors={extra})"
