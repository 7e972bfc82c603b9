# -*- test-case-name: tests.gpu -*-
"""
Skip the GPU tests unless PyCUDA imports and sees at least one CUDA device.
"""

from __future__ import annotations

import functools

import pytest


@functools.cache
def gpu_unavailable_reason() -> str | None:
    """Why GPU tests cannot run here, or C{None} when they can."""
    try:
        import pycuda.driver as drv
    except ImportError as e:
        return f"PyCUDA is not importable: {e}"
    try:
        drv.init()
        if drv.Device.count() < 1:
            return "no CUDA device"
    except Exception as e:
        return f"CUDA is not usable: {type(e).__name__}: {e}"
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    reason = gpu_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
