# -*- test-case-name: tests.unit.test_worker_engine -*-
"""
Helpers that uploaded code imports inside a worker (protocol §10.1, §10.2).

Each function dispatches to the current worker's builtin registry
(L{kcoral.worker.runtime.current_builtins}), so a GPU worker answers with its
own implementations while a CPU worker raises
C{ExecutionError("unavailable", ...)}.  Outside a worker the CPU table is used.
This module imports no Twisted, Klein or treq.
"""

from __future__ import annotations

from typing import Any

from kcoral.errors import ExecutionError, GPUAccessViolation
from kcoral.worker import builtins as _registry
from kcoral.worker import runtime as _runtime


def _call(name: str, *args: Any) -> Any:
    table = _runtime.current_builtins()
    if table is None:
        table = _registry.cpu_builtins()
    try:
        function, _cpu_only = table[name]
    except KeyError:
        raise ExecutionError("runtime", f"unknown function: {name!r}") from None
    return function(*args)


def benchmark(fn: Any, *args: Any) -> dict[str, Any]:
    """Time C{fn(*args)} on the GPU; a trailing dict is the configuration."""
    return _call("builtin.benchmark", fn, *args)


def compare(a: Any, b: Any, *args: Any) -> dict[str, Any]:
    """
    Is C{b(*args)} faster than C{a(*args)}?  Their iterations interleaved in
    a random order under one lease; both medians, the ratio of B's to A's,
    its 95 % interval and a verdict (C{faster}, C{slower} or
    C{indistinguishable}); a trailing dict is the configuration.
    """
    return _call("builtin.compare", a, b, *args)


def compile_tirx(kernel: Any, bindings: Any = None) -> Any:
    """Compile a TVM TIRx kernel for CUDA; needs TVM in the worker."""
    table = _runtime.current_builtins()
    if table is not None and "builtin.compile_tirx" in table:
        function, _cpu_only = table["builtin.compile_tirx"]
        if not getattr(function, "_kcoral_placeholder", False):
            return function(kernel, bindings)
    raise ExecutionError("unavailable", "compile_tirx is unavailable: tvm is not installed")


def check_close(actual: Any, expected: Any, cfg: dict[str, Any] | None = None) -> dict[str, Any]:
    """Compare two tensors with C{rtol}/C{atol}; return the comparison dict."""
    return _call("builtin.check_close", actual, expected, *([cfg] if cfg is not None else []))


def assert_close(actual: Any, expected: Any, cfg: dict[str, Any] | None = None) -> dict[str, Any]:
    """Like L{check_close}, failing with C{correctness} on a mismatch."""
    return _call("builtin.assert_close", actual, expected, *([cfg] if cfg is not None else []))


def compile_cuda(source: Any, cfg: dict[str, Any] | None = None) -> Any:
    """Compile a CUDA function for this worker's GPU and load it."""
    return _call("builtin.compile_cuda", source, *([cfg] if cfg is not None else []))


def compile_cuda_binary(source: Any, cfg: dict[str, Any] | None = None) -> bytes:
    """Compile a CUDA function for C{cfg["arch"]}; return the image bytes."""
    return _call("builtin.compile_cuda_binary", source, *([cfg] if cfg is not None else []))


def randn(spec: dict[str, Any], *rest: Any) -> Any:
    """A new device tensor of standard normal values."""
    return _call("builtin.randn", spec, *rest)


def empty(spec: dict[str, Any], *rest: Any) -> Any:
    """A new uninitialized device tensor."""
    return _call("builtin.empty", spec, *rest)


def zeros(spec: dict[str, Any], *rest: Any) -> Any:
    """A new zero-filled device tensor."""
    return _call("builtin.zeros", spec, *rest)


__all__ = [
    "ExecutionError",
    "GPUAccessViolation",
    "assert_close",
    "benchmark",
    "check_close",
    "compile_cuda",
    "compile_cuda_binary",
    "compile_tirx",
    "empty",
    "randn",
    "zeros",
]
