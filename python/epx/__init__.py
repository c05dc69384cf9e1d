"""EPX: expert-parallel all-to-all (MoE dispatch / combine) for PyTorch.

    import epx
    buffer = epx.Buffer(group, num_nvl_bytes=epx.Config().get_nvl_buffer_size_hint(hidden * 2, group.size()))
    layout = buffer.get_dispatch_layout(topk_idx, num_experts)
    result = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts)
    ...
    combined = buffer.combine(expert_out, result.handle).combined_x

Submodules: epx.training (autograd dispatch/combine, permute/unpermute), epx.compat.deep_ep (DeepEP V1's
interface, also importable as the top-level package ``deep_ep``). torch is imported only when a torch-facing
part is used; the size hints and layouts work without it. The benchmark, its plots and the CPU reference over
numpy arrays are tools outside this package (python/epx_tools).
"""

import pkgutil as _pkgutil

# A development build keeps the compiled extension in <build>/python/epx/: with that folder on sys.path too
# (PYTHONPATH=python:<build>/python), the package spans both directories.
__path__ = _pkgutil.extend_path(__path__, __name__)

from ._ext import _epx  # noqa: E402
from .buffer import Buffer, group_bootstrap  # noqa: E402
from .config import (  # noqa: E402
    Config, get_low_latency_rdma_size_hint, normal_nvl_buffer_size_hint, normal_nvl_output_bytes_hint,
    normal_nvl_staging_bytes_hint)
from .event import EventHandle, EventOverlap  # noqa: E402
from .results import (  # noqa: E402
    CombineResult,
    DispatchHandle,
    DispatchLayout,
    DispatchResult,
    LowLatencyCombineResult,
    LowLatencyDispatchResult,
    LowLatencyHandle,
    RecvHook,
)

EpxError = _epx.EpxError
__version__ = _epx.__version__
WITH_CUDA = bool(_epx.WITH_CUDA)
WITH_NVSHMEM = bool(_epx.WITH_NVSHMEM)
MAX_TOPK = _epx.MAX_TOPK

__all__ = [
    "Buffer",
    "CombineResult",
    "Config",
    "DispatchHandle",
    "DispatchLayout",
    "DispatchResult",
    "EpxError",
    "EventHandle",
    "EventOverlap",
    "LowLatencyCombineResult",
    "LowLatencyDispatchResult",
    "LowLatencyHandle",
    "MAX_TOPK",
    "RecvHook",
    "WITH_CUDA",
    "WITH_NVSHMEM",
    "get_low_latency_rdma_size_hint",
    "group_bootstrap",
    "normal_nvl_buffer_size_hint",
    "normal_nvl_output_bytes_hint",
    "normal_nvl_staging_bytes_hint",
]


def __getattr__(name):
    # Submodules that import torch (training) load on first access.
    if name in ("training", "compat"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
