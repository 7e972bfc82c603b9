# -*- test-case-name: tests.unit.test_gpu_builtins_cpu -*-
"""Argument checks that every GPU builtin shares; no device work."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from kcoral.errors import ExecutionError


def check_cfg(cfg: Any, what: str) -> dict[str, Any]:
    """C{cfg} as a dict (C{None} is empty).

    @raise ExecutionError: C{parse} for anything but an object.
    """
    if cfg is None:
        return {}
    if not isinstance(cfg, dict):
        raise ExecutionError("parse", f"{what}: cfg must be an object, got {type(cfg).__name__}")
    return cfg


def is_number(value: Any) -> bool:
    """Whether C{value} is a Python or NumPy int or float (not a bool)."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )


def cuda_errors() -> tuple[type[BaseException], ...]:
    """PyCUDA's error class once PyCUDA is imported, else nothing to catch."""
    drv = sys.modules.get("pycuda.driver")
    return (drv.Error,) if drv is not None else ()
