# -*- test-case-name: tests.unit.test_worker_engine -*-
"""
The builtin registry: wire name (C{builtin.zeros}) to C{(callable, cpu_only)}.

A C{run} whose C{fn} is a legacy builtin name (protocol §10.2) calls the
registered callable with the resolved arguments; L{kcoral.builtins} exposes the
same functions to uploaded Python.  The CPU table below makes every builtin
fail with C{unavailable} except C{builtin.compile_cuda_binary}; a backend adds
or overrides entries through its optional C{builtins()} method.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kcoral.compilers.call import (
    COMPILE_TIMEOUT_SECONDS,
    CudaFunction,
    CudaSource,
    compile_call,
)
from kcoral.errors import ExecutionError
from kcoral.wire.program import BUILTINS, GPU_ONLY_BUILTINS

__all__ = [
    "COMPILE_TIMEOUT_SECONDS",
    "Builtin",
    "CudaFunction",
    "CudaSource",
    "compile_cuda_binary",
    "cpu_builtins",
    "registered",
    "registry_for",
]

Builtin = tuple[Callable[..., Any], bool]


def _unavailable(name: str) -> Callable[..., Any]:
    def builtin(*args: Any) -> Any:
        raise ExecutionError("unavailable", f"{name} is unavailable in CPU mode")

    builtin.__name__ = name.rpartition(".")[2]
    builtin.__qualname__ = builtin.__name__
    builtin._kcoral_placeholder = True  # type: ignore[attr-defined]
    return builtin


def compile_cuda_binary(source: Any, *rest: Any) -> bytes:
    """
    Compile CUDA source for an explicit C{arch}; return the image's bytes:
    a cubin for C{__global__} kernels, a shared library (for
    C{tvm_ffi.load_module} or a C{library} upload) when the handle names a
    host function with TVM-FFI parameters.

    C{source} is a L{CudaFunction} (or the source text); the trailing C{cfg}
    is C{{arch: str, extra_cuda_cflags?: [str], timeout_seconds?: number}},
    checked by L{kcoral.compilers.call.compile_call} (which the server's
    compile-only programs share).  The compiler lives in
    L{kcoral.compilers}; without it this is C{unavailable}.
    """
    try:
        from kcoral.compilers import compile_binary  # type: ignore[attr-defined]
    except ImportError as e:
        raise ExecutionError(
            "unavailable", f"builtin.compile_cuda_binary is unavailable: {e}"
        ) from None
    call = compile_call(source, *rest)
    return bytes(
        compile_binary(call.source, call.arch, call.flags, call.timeout, backend=call.backend)
    )


def registered(implementations: Mapping[str, Callable[..., Any]]) -> dict[str, Builtin]:
    """
    Builtin table entries for C{implementations}, with the C{cpu_only} flag
    of each name from the one table in L{kcoral.wire.program.BUILTINS}.
    """
    return {name: (function, BUILTINS[name]) for name, function in implementations.items()}


def cpu_builtins() -> dict[str, Builtin]:
    """The builtin table of a CPU worker."""
    implementations: dict[str, Callable[..., Any]] = {
        name: _unavailable(name) for name in BUILTINS if name not in GPU_ONLY_BUILTINS
    }
    implementations["builtin.compile_cuda_binary"] = compile_cuda_binary
    return registered(implementations)


def registry_for(backend: Any) -> dict[str, Builtin]:
    """
    The builtin table for C{backend}: the CPU table updated with the
    backend's optional C{builtins()} mapping.
    """
    table = cpu_builtins()
    extra: Callable[[], Mapping[str, Builtin]] | None = getattr(backend, "builtins", None)
    if extra is not None:
        table.update(extra())
    return table
