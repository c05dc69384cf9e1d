"""What the CPU and GPU tests of Megatron's fused_a2a share."""

import pytest


def import_fused_a2a():
    """megatron.core.transformer.moe.fused_a2a, or a skip naming why it is not importable."""
    try:
        import megatron.core.transformer.moe.fused_a2a as fused_a2a
    except Exception as error:  # ImportError, or megatron-core failing to load with this torch
        pytest.skip(f"megatron-core is not importable ({type(error).__name__}: {error}); install its wheel "
                    "(pip install megatron-core) to run Megatron's fused_a2a on EPX")
    # Megatron imports `from deep_ep import Buffer` and `from deep_ep.utils import EventHandle, EventOverlap`:
    # without them it sets HAVE_DEEP_EP = False and fused_dispatch is None.
    assert fused_a2a.HAVE_DEEP_EP, "megatron-core could not import EPX's deep_ep"
    return fused_a2a
