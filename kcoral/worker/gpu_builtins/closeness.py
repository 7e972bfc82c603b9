# -*- test-case-name: tests.unit.test_gpu_builtins_cpu,tests.gpu.test_gpu_backend -*-
"""
C{builtin.check_close} and C{builtin.assert_close}: tensors compared on the
host in float64.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kcoral.errors import ExecutionError
from kcoral.worker.gpu_builtins.common import check_cfg, is_number
from kcoral.worker.tensors import to_host


def parse_tolerances(cfg: Any, what: str = "check_close") -> tuple[float, float]:
    """C{(rtol, atol)} from a cfg; defaults 1e-2 and 1e-3."""
    cfg = check_cfg(cfg, what)
    out = []
    for key, default in (("rtol", 1e-2), ("atol", 1e-3)):
        value = cfg.get(key, default)
        if not is_number(value) or not math.isfinite(value) or value < 0:
            raise ExecutionError(
                "parse", f"{what}: {key} must be a non-negative number, got {value!r}"
            )
        out.append(float(value))
    return out[0], out[1]


def _as_float64(value: Any, role: str) -> np.ndarray:
    host = to_host(value)
    if host is None:
        if isinstance(value, (list, tuple, int, float, bool)):
            host = np.asarray(value)
        else:
            raise ExecutionError(
                "runtime", f"check_close: {role} must be a tensor, got {type(value).__name__}"
            )
    try:
        return np.asarray(host).astype(np.float64)
    except (TypeError, ValueError) as e:
        raise ExecutionError(
            "runtime", f"check_close: cannot compare {role} of dtype {host.dtype}: {e}"
        ) from e


def compare_arrays(
    actual: np.ndarray, expected: np.ndarray, rtol: float, atol: float
) -> dict[str, Any]:
    """
    Elementwise C{|actual - expected| <= atol + rtol * |expected|} on host
    float64 arrays of one shape.

    Infinities must match exactly and NaN never matches.  The reported
    errors are over the elements where both are finite (so they stay
    finite); C{max_rel_err} skips elements whose expected value is zero.
    """
    if actual.shape != expected.shape:
        raise ExecutionError(
            "correctness",
            f"shapes differ: actual {list(actual.shape)} vs expected {list(expected.shape)}",
        )
    finite = np.isfinite(actual) & np.isfinite(expected)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(actual - expected)
        close = np.where(finite, diff <= atol + rtol * np.abs(expected), actual == expected)
    diff_f = diff[finite]
    exp_f = np.abs(expected[finite])
    max_abs = float(diff_f.max()) if diff_f.size else 0.0
    nonzero = exp_f > 0
    max_rel = float((diff_f[nonzero] / exp_f[nonzero]).max()) if nonzero.any() else 0.0
    mismatched = int(close.size - np.count_nonzero(close))
    return {
        "passed": mismatched == 0,
        "max_abs_err": max_abs,
        "max_rel_err": max_rel,
        "rtol": rtol,
        "atol": atol,
        "mismatched": mismatched,
        "numel": int(close.size),
    }


def check_close(actual: Any, expected: Any, cfg: Any = None) -> dict[str, Any]:
    """
    Compare two tensors (device or host) within C{rtol}/C{atol}
    (C{builtin.check_close}).
    """
    rtol, atol = parse_tolerances(cfg)
    return compare_arrays(
        _as_float64(actual, "actual"), _as_float64(expected, "expected"), rtol, atol
    )


def assert_close(actual: Any, expected: Any, cfg: Any = None) -> dict[str, Any]:
    """
    L{check_close}, failing the instruction with C{correctness} on mismatch.
    """
    result = check_close(actual, expected, cfg)
    if not result["passed"]:
        raise ExecutionError("correctness", mismatch_message(result))
    return result


def mismatch_message(result: dict[str, Any]) -> str:
    """The C{correctness} message of a failed comparison."""
    return (
        f"outputs differ: max_abs_err={result['max_abs_err']:.6g} exceeds "
        f"atol={result['atol']:g}, rtol={result['rtol']:g} "
        f"({result['mismatched']} of {result['numel']} elements mismatched)"
    )
