"""Loads the compiled extension ``epx._epx``.

When torch is installed it is imported first: torch wheels ship their own CUDA runtime, and loading it before
the extension makes both share that one copy (the dynamic loader reuses a library already loaded under the
same soname) instead of pinning the possibly older toolkit runtime the extension was linked against.
Set ``EPX_NO_TORCH_PRELOAD=1`` to skip this (e.g. to use only the CPU parts without paying torch's import).
"""

import importlib.util
import os

if os.environ.get("EPX_NO_TORCH_PRELOAD", "0") in ("", "0") and importlib.util.find_spec("torch") is not None:
    import torch  # noqa: F401  (see the module docstring)

try:
    from . import _epx
except ImportError as error:  # pragma: no cover - depends on how the package was installed
    raise ImportError(
        "epx: the compiled extension epx._epx was not found or failed to load "
        f"({error}). Build it with `cmake -DEPX_BUILD_PYTHON=ON` and put <build>/python on PYTHONPATH next to "
        "python/, or `pip install --no-build-isolation ./python`."
    ) from error

__all__ = ["_epx"]
