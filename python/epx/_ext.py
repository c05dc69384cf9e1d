"""Loads the compiled extensions: ``epx._epx`` (the C++ API on plain values) and, where it was built and torch is
here, ``epx._epx_torch`` (the hot calls on torch tensors: outputs allocated and checks made in C++). Without the
second, or with ``EPX_TORCH_EXT=0``, epx.Buffer takes its Python path for every call (same results, more host
time).

When torch is installed it is imported first: torch wheels ship their own CUDA runtime, and loading it before
the extension makes both share that one copy (the dynamic loader reuses a library already loaded under the
same soname) instead of pinning the possibly older toolkit runtime the extension was linked against.
Set ``EPX_NO_TORCH_PRELOAD=1`` to skip this (e.g. to use only the CPU parts without paying torch's import).
"""

import importlib.util
import os

_with_torch = False
if os.environ.get("EPX_NO_TORCH_PRELOAD", "0") in ("", "0") and importlib.util.find_spec("torch") is not None:
    import torch  # noqa: F401  (see the module docstring)

    _with_torch = True

try:
    from . import _epx
except ImportError as error:  # pragma: no cover - depends on how the package was installed
    raise ImportError(
        "epx: the compiled extension epx._epx was not found or failed to load "
        f"({error}). Build it with `cmake -DEPX_BUILD_PYTHON=ON` and put <build>/python on PYTHONPATH next to "
        "python/, or `pip install --no-build-isolation ./python`."
    ) from error

# None where it was not built, does not load (a torch other than the one it was built against), or is turned off.
torch_calls = None
torch_calls_error = ""  # why it did not load, if it was there
if _with_torch and getattr(_epx, "WITH_CUDA", False) and os.environ.get("EPX_TORCH_EXT", "1") != "0":
    try:
        from . import _epx_torch as torch_calls
    except ImportError as missing:  # pragma: no cover - depends on the build
        torch_calls_error = str(missing)

__all__ = ["_epx", "torch_calls"]
