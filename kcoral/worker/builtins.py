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

import re
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from kcoral.errors import ExecutionError
from kcoral.wire.program import BUILTINS, GPU_ONLY_BUILTINS

Builtin = tuple[Callable[..., Any], bool]

_C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

#: Default seconds allowed to one compile_cuda_binary call.
COMPILE_TIMEOUT_SECONDS = 300.0


@attrs.frozen
class CudaSource:
    """The handle of an C{upload module} with C{language: cuda}: its text."""

    source: str

    def get_function(self, name: str) -> CudaFunction:
        """
        The named function of this source.

        @raise ExecutionError: C{parse} when C{name} is not a C identifier or
            is C{main}.
        """
        if not _C_IDENTIFIER.match(name):
            raise ExecutionError("parse", f"CUDA function name {name!r} is not a C identifier")
        if name == "main":
            raise ExecutionError("parse", "CUDA function name 'main' is not allowed")
        return CudaFunction(self.source, name)


@attrs.frozen
class CudaFunction:
    """A named function of a CUDA source, consumed by the compile builtins."""

    source: str
    name: str


def _unavailable(name: str) -> Callable[..., Any]:
    def builtin(*args: Any) -> Any:
        raise ExecutionError("unavailable", f"{name} is unavailable in CPU mode")

    builtin.__name__ = name.rpartition(".")[2]
    builtin.__qualname__ = builtin.__name__
    builtin._kcoral_placeholder = True  # type: ignore[attr-defined]
    return builtin


def _split_cfg(args: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if args and isinstance(args[-1], dict):
        return args[:-1], args[-1]
    return args, {}


def compile_cuda_binary(source: Any, *rest: Any) -> bytes:
    """
    Compile CUDA source for an explicit C{arch}; return the image's bytes:
    a cubin for C{__global__} kernels, a shared library (for
    C{tvm_ffi.load_module} or a C{library} upload) when the handle names a
    host function with TVM-FFI parameters.

    C{source} is a L{CudaFunction} (or the source text); the trailing C{cfg}
    is C{{arch: str, extra_cuda_cflags?: [str], timeout_seconds?: number}}.
    The compiler lives in L{kcoral.compilers}; without it this is
    C{unavailable}.
    """
    args, cfg = _split_cfg(rest)
    if args:
        raise ExecutionError("parse", "compile_cuda_binary expects (source, cfg)")
    name = None
    if isinstance(source, CudaFunction):
        text, name = source.source, source.name
    elif isinstance(source, str):
        text = source
    else:
        raise ExecutionError(
            "parse", "compile_cuda_binary expects the get_function handle of a CUDA module"
        )
    arch = cfg.get("arch")
    if not isinstance(arch, str):
        raise ExecutionError("parse", "compile_cuda_binary: 'arch' must be a string")
    flags = cfg.get("extra_cuda_cflags", [])
    if not isinstance(flags, (list, tuple)) or not all(isinstance(f, str) for f in flags):
        raise ExecutionError(
            "parse", "compile_cuda_binary: 'extra_cuda_cflags' must be a list of strings"
        )
    timeout = cfg.get("timeout_seconds", COMPILE_TIMEOUT_SECONDS)
    try:
        from kcoral.compilers import compile_binary  # type: ignore[attr-defined]
    except ImportError as e:
        raise ExecutionError(
            "unavailable", f"builtin.compile_cuda_binary is unavailable: {e}"
        ) from None
    from kcoral.compilers.source import add_extern_c
    from kcoral.compilers.tvmffi import export_source, is_host_function

    if name is not None and is_host_function(text, name):
        # A TVM-FFI host function: a shared library for tvm_ffi.load_module.
        return bytes(
            compile_binary(
                export_source(text, name), arch, tuple(flags), float(timeout), backend="tvmffi"
            )
        )
    return bytes(compile_binary(add_extern_c(text), arch, tuple(flags), float(timeout)))


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
