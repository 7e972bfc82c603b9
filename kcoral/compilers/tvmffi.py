# -*- test-case-name: tests.unit.test_tvmffi -*-
"""
TVM-FFI host functions in C{language: "cuda"} modules.

The protocol's documented form of a CUDA module exports a host function
whose parameters are TVM-FFI values and which launches its kernels itself::

    void add_one(tvm::ffi::TensorView x, tvm::ffi::TensorView y) {
        add_one_kernel<<<blocks, threads>>>(...);
    }

L{is_host_function} recognises one, L{export_source} adds the TVM-FFI
includes and export wrapper, and L{TvmFfiBackend} (the C{tvmffi} compiler
backend) builds it with nvcc and apache-tvm-ffi's headers into a shared
library, which C{tvm_ffi.load_module} loads.  Plain C{__global__} kernels
keep going to the cubin backends.
"""

from __future__ import annotations

import os
import re
import tempfile
from typing import Any

import attrs
from twisted.plugin import IPlugin
from zope.interface import implementer

from kcoral.compilers.interfaces import KIND_BINARY, ICompilerBackend
from kcoral.compilers.nvcc import (
    NvccBackend,
    run_nvcc,
    shorten,
    validate_arch,
    validate_options,
)
from kcoral.errors import ExecutionError

__all__ = ["TvmFfiBackend", "export_source", "is_host_function", "load_library", "tvm_ffi_paths"]

_INCLUDES = "#include <tvm/ffi/container/tensor.h>\n#include <tvm/ffi/function.h>\n"


def _strip_comments(source: str) -> str:
    return re.sub(r"/\*.*?\*/|//[^\n]*", " ", source, flags=re.S)


def is_host_function(source: str, name: str) -> bool:
    """
    Whether C{name} is defined in C{source} as a host function (not a
    C{__global__} kernel) taking TVM-FFI parameters.
    """
    text = _strip_comments(source)
    pattern = re.compile(r"(__global__\s+)?\bvoid\s+" + re.escape(name) + r"\s*\(([^)]*)\)\s*\{")
    for match in pattern.finditer(text):
        if match.group(1) is None and "tvm::ffi::" in match.group(2):
            return True
    return False


def export_source(source: str, name: str) -> str:
    """
    C{source} with the TVM-FFI headers in front and, unless the source
    exports C{name} itself, C{TVM_FFI_DLL_EXPORT_TYPED_FUNC(name, name)}
    after it.
    """
    exported = re.search(
        r"TVM_FFI_DLL_EXPORT_TYPED_FUNC\s*\(\s*" + re.escape(name) + r"\s*,",
        _strip_comments(source),
    )
    tail = "" if exported else f"\nTVM_FFI_DLL_EXPORT_TYPED_FUNC({name}, {name});\n"
    return f"{_INCLUDES}#line 1\n{source}\n{tail}"


def tvm_ffi_paths() -> tuple[list[str], str, str]:
    """
    C{(include directories, library directory, version)} of the installed
    apache-tvm-ffi.

    @raise ExecutionError: C{unavailable} when it is not installed.
    """
    try:
        import tvm_ffi
        from tvm_ffi import libinfo
    except Exception as e:
        raise ExecutionError(
            "unavailable", f"TVM-FFI host functions need apache-tvm-ffi: {e}"
        ) from None
    includes = list(
        dict.fromkeys([libinfo.find_include_path(), libinfo.find_dlpack_include_path()])
    )
    library_dir = os.path.dirname(libinfo.find_libtvm_ffi())
    return includes, library_dir, str(getattr(tvm_ffi, "__version__", ""))


@implementer(IPlugin, ICompilerBackend)
@attrs.define(eq=False)
class TvmFfiBackend:
    """
    Build a TVM-FFI module source (see L{export_source}) into a shared
    library for C{arch} with nvcc; needs no GPU.  The result is the
    library's bytes, for C{tvm_ffi.load_module} or a C{library} upload.
    """

    name = "tvmffi"
    kind = KIND_BINARY

    workspace: str | None = None
    _nvcc: NvccBackend = attrs.field(factory=NvccBackend, init=False, repr=False)

    def available(self) -> tuple[bool, str]:
        try:
            tvm_ffi_paths()
        except ExecutionError as e:
            return False, e.message
        return self._nvcc.available()

    def versions(self) -> dict[str, str]:
        out = self._nvcc.versions()
        try:
            out["tvm_ffi"] = tvm_ffi_paths()[2]
        except ExecutionError:
            pass
        return out

    def compile(self, source: str, arch: str, options: tuple[str, ...], timeout: float) -> bytes:
        if not isinstance(source, str):
            raise ExecutionError("parse", "CUDA source must be a string")
        validate_arch(arch)
        if arch.startswith("compute_"):
            raise ExecutionError(
                "parse", f"a shared library needs a real arch (sm_NN), got {arch!r}"
            )
        args, _fatbin = validate_options(options, self.workspace or os.getcwd())
        if not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ExecutionError(
                "parse", f"compile timeout must be a positive number, got {timeout!r}"
            )
        includes, library_dir, _version = tvm_ffi_paths()
        nvcc, reason = self._nvcc.locate()
        if nvcc is None:
            raise ExecutionError("unavailable", reason)
        if not any(a.startswith("-std=") for a in args):
            args = ["-std=c++17", *args]
        with tempfile.TemporaryDirectory(prefix="kcoral-tvmffi-") as tmp:
            src = os.path.join(tmp, "module.cu")
            out = os.path.join(tmp, "module.so")
            with open(src, "w", encoding="utf-8") as f:
                f.write(source)
            argv = [
                nvcc,
                "-shared",
                "-Xcompiler",
                "-fPIC",
                f"-arch={arch}",
                *(f"-I{d}" for d in includes),
                *args,
                "-o",
                out,
                src,
                f"-L{library_dir}",
                "-ltvm_ffi",
            ]
            self._run(argv, tmp, nvcc, arch, timeout)
            try:
                with open(out, "rb") as f:
                    return f.read()
            except OSError:
                raise ExecutionError("compile", "nvcc succeeded but wrote no library") from None

    def _run(self, argv: list[str], tmp: str, nvcc: str, arch: str, timeout: float) -> None:
        """Run nvcc in its own process group, killed as a whole on timeout."""
        run_nvcc(argv, cwd=tmp, env=self._nvcc._environment(nvcc, tmp), arch=arch, timeout=timeout)


def load_library(image: bytes, directory: str | None = None) -> Any:
    """
    Load a TVM-FFI shared library from its bytes with C{tvm_ffi.load_module}
    (it needs a file: one is written under C{directory}, the temp dir by
    default, and removed once loaded).

    @raise ExecutionError: C{unavailable} without apache-tvm-ffi, C{compile}
        when the library does not load.
    """
    tvm_ffi_paths()
    import tvm_ffi

    fd, path = tempfile.mkstemp(suffix=".so", prefix="kcoral-tvmffi-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(image)
        try:
            return tvm_ffi.load_module(path)
        except Exception as e:
            raise ExecutionError(
                "compile", "cannot load the TVM-FFI library: " + shorten(str(e))
            ) from None
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
