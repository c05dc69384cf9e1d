"""``deep_ep`` as EPX ships it: DeepEP V1's Python interface (Buffer, Config, EventOverlap, EventHandle,
topk_idx_t) running on EPX, so code written for DeepEP (``from deep_ep import Buffer``) runs unchanged.

A thin re-export of ``epx.compat.deep_ep``, which holds the implementation and documents what still differs
from DeepEP. ``topk_idx_t`` (torch.int64) imports torch on first use; the rest imports without torch.
"""

from epx import __version__ as _epx_version
from epx.compat import deep_ep as _impl
from epx.compat.deep_ep import Buffer, Config, EventHandle, EventOverlap

from . import utils  # noqa: F401  (deep_ep.utils, as in DeepEP)

# DeepEP's version with EPX's as a PEP 440 local label, e.g. 1.2.1+epx0.1.0 (the metadata distribution in
# python/deep_ep_dist reports the same through importlib.metadata).
__version__ = f"{_impl.DEEP_EP_VERSION}+epx{_epx_version}"

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t"]


def __getattr__(name):
    if name == "topk_idx_t":
        return _impl.topk_idx_t  # torch.int64, resolved on first use
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
