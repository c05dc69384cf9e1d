"""EventOverlap: the event an asynchronous call returns, as in DeepEP."""

from __future__ import annotations

from typing import Any, Optional, Tuple

from . import _util


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

    ``event`` is an ``epx`` Event, a ``torch.cuda.Event``, or None (a call that finished synchronously); both
    methods are then no-ops.
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
        stream = _util.current_stream()
        if hasattr(self.event, "wait_on"):  # an epx Event
            self.event.wait_on(stream.cuda_stream)
        else:  # a torch.cuda.Event
            self.event.wait(stream)

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        if self.event is not None:
            self.current_stream_wait()

    def __repr__(self) -> str:
        state = "pending" if self.event is not None else "none"
        return f"EventOverlap(event={state}, extra_tensors={0 if self.extra_tensors is None else len(self.extra_tensors)})"
