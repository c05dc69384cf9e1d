"""``deep_ep.utils``: EventOverlap and EventHandle, as DeepEP's module exports them."""

from epx.compat.deep_ep import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
