# -*- test-case-name: tests.unit.test_compile_call -*-
"""
C{builtin.compile_cuda_binary}'s call, checked: what to compile, for which
arch, with which flags, within which time and through which backend.

The handles it takes (L{CudaSource}, the C{upload} of a CUDA module, and
L{CudaFunction}, its C{get_function}) and L{compile_call} are shared by the
worker's builtin (L{kcoral.worker.builtins.compile_cuda_binary}) and the
server's compile-only programs (L{kcoral.server.workers.compileonly}), so
both refuse the same calls with the same messages, in the same order.

Pure: no I/O, no toolchain.
"""

from __future__ import annotations

import re
from typing import Any

import attrs

from kcoral.errors import ExecutionError

#: Default seconds allowed to one compile_cuda_binary call.
COMPILE_TIMEOUT_SECONDS = 300.0

_C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


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


@attrs.frozen
class CompileCall:
    """
    One C{compile_cuda_binary} call, checked.

    @ivar source: the text the backend compiles (C{extern "C"} added, or
        the TVM-FFI export around a host function).
    @ivar backend: C{nvcc} (a cubin) or C{tvmffi} (a shared library).
    """

    source: str
    arch: str
    flags: tuple[str, ...]
    timeout: float
    backend: str


def split_cfg(args: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A trailing dict is the call's C{cfg}; the arguments before it stay."""
    if args and isinstance(args[-1], dict):
        return args[:-1], args[-1]
    return args, {}


def compile_call(source: Any, *rest: Any) -> CompileCall:
    """
    Check C{compile_cuda_binary(source, cfg)}: C{source} is a
    L{CudaFunction} (or the source text); C{cfg} is C{{arch: str,
    extra_cuda_cflags?: [str], timeout_seconds?: number}}.  A handle that
    names a host function with TVM-FFI parameters is built as a shared
    library (backend C{tvmffi}); anything else as a cubin (C{nvcc}), its
    C{__global__} functions given C{extern "C"} linkage.

    @raise ExecutionError: C{parse} with the message the builtin has always
        given.
    @raise ValueError: (or C{TypeError}, C{OverflowError}) C{timeout_seconds}
        is not a number.
    """
    from kcoral.compilers.source import add_extern_c
    from kcoral.compilers.tvmffi import export_source, is_host_function

    args, cfg = split_cfg(rest)
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
    if name is not None and is_host_function(text, name):
        # A TVM-FFI host function: a shared library for tvm_ffi.load_module.
        return CompileCall(export_source(text, name), arch, tuple(flags), float(timeout), "tvmffi")
    return CompileCall(add_extern_c(text), arch, tuple(flags), float(timeout), "nvcc")
