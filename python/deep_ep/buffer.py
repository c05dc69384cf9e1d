"""``deep_ep.buffer``: the Buffer, as DeepEP's module exports it."""

from epx.compat.deep_ep import Buffer, Config, EventHandle, EventOverlap

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap"]
