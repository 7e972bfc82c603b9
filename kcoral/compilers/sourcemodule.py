# -*- test-case-name: tests.unit.test_compilers -*-
"""
L{SourceModuleBackend}: compile with PyCUDA on the GPU node.

C{pycuda.compiler.compile} runs nvcc itself; it needs no CUDA context when
C{arch} is given, but importing PyCUDA needs the CUDA driver library, so this
backend is only available on GPU nodes. Flags and arch go through the same
policy as L{kcoral.compilers.nvcc.NvccBackend}.

L{load_module_image} loads a module image (this backend's, nvcc's, or a
C{library} upload) into the current context.
"""

from __future__ import annotations

import os
import shlex
import stat
import tempfile
import time
from typing import Any

import attrs
from twisted.plugin import IPlugin
from zope.interface import implementer

from kcoral.compilers.interfaces import KIND_LOADABLE, ICompilerBackend
from kcoral.compilers.nvcc import find_nvcc, probe_versions, shorten, validate_arch
from kcoral.compilers.nvcc import validate_options as _validate_options
from kcoral.errors import ExecutionError

__all__ = ["SourceModuleBackend", "load_module_image"]


def _import_pycuda_compiler() -> tuple[Any, str]:
    try:
        import pycuda.compiler as compiler
    except Exception as e:  # ImportError, or the driver library failing to load
        return None, f"pycuda is not importable: {type(e).__name__}: {e}"
    return compiler, ""


@implementer(IPlugin, ICompilerBackend)
@attrs.define(eq=False)
class SourceModuleBackend:
    """
    Compile CUDA C with C{pycuda.compiler.compile(..., no_extern_c=True)}.

    Returns a cubin (or a fatbin with C{-fatbin} / a C{compute_NN} arch), to be
    loaded with L{load_module_image}. The timeout is enforced by running
    nvcc under coreutils C{timeout}, which kills nvcc's whole process group.
    """

    name = "sourcemodule"
    kind = KIND_LOADABLE

    workspace: str | None = None

    def available(self) -> tuple[bool, str]:
        compiler, reason = _import_pycuda_compiler()
        if compiler is None:
            return False, reason
        if find_nvcc()[0] is None:
            return False, find_nvcc()[1]
        return True, ""

    def versions(self) -> dict[str, str]:
        out: dict[str, str] = {}
        try:
            import pycuda

            out["pycuda"] = str(getattr(pycuda, "VERSION_TEXT", ""))
        except Exception:
            return {}
        nvcc, _ = find_nvcc()
        if nvcc is not None:
            out.update(probe_versions(nvcc))
        return out

    def compile(self, source: str, arch: str, options: tuple[str, ...], timeout: float) -> bytes:
        if not isinstance(source, str):
            raise ExecutionError("parse", "CUDA source must be a string")
        validate_arch(arch)
        args, fatbin = _validate_options(options, self.workspace)
        if not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ExecutionError(
                "parse", f"compile timeout must be a positive number, got {timeout!r}"
            )
        compiler, reason = _import_pycuda_compiler()
        if compiler is None:
            raise ExecutionError("unavailable", reason)
        nvcc, reason = find_nvcc()
        if nvcc is None:
            raise ExecutionError("unavailable", reason)
        target = "fatbin" if fatbin or arch.startswith("compute_") else "cubin"
        with tempfile.TemporaryDirectory(prefix="kcoral-pycuda-") as tmp:
            # pycuda runs its `nvcc` argument as argv[0]: a wrapper adds the limit.
            wrapper = os.path.join(tmp, "nvcc")
            with open(wrapper, "w") as f:
                f.write(
                    f'#!/bin/sh\nexec timeout -k 2 {float(timeout):.3f} {shlex.quote(nvcc)} "$@"\n'
                )
            os.chmod(wrapper, stat.S_IRWXU)
            started = time.monotonic()
            try:
                return bytes(
                    compiler.compile(
                        source,
                        nvcc=wrapper,
                        options=args,
                        arch=arch,
                        no_extern_c=True,
                        cache_dir=False,
                        target=target,
                    )
                )
            except Exception as e:
                if time.monotonic() - started >= timeout:
                    raise ExecutionError("compile", f"nvcc timed out after {timeout:g}s") from None
                text = str(getattr(e, "stderr", "") or e)
                if isinstance(text, bytes):
                    text = text.decode("utf-8", "replace")
                raise ExecutionError(
                    "compile", f"nvcc failed for {arch}:\n" + shorten(text.replace(tmp, "."))
                ) from None


def load_module_image(image: bytes) -> Any:
    """
    Load a cubin/fatbin/PTX image into the current CUDA context.

    @return: a C{pycuda.driver.Module}.
    @raise ExecutionError: C{unavailable} without PyCUDA, C{compile} when the
        driver rejects the image (wrong arch, corrupt data).
    """
    try:
        import pycuda.driver as cuda
    except Exception as e:
        raise ExecutionError("unavailable", f"pycuda is not importable: {e}") from None
    if not isinstance(image, (bytes, bytearray, memoryview)):
        raise ExecutionError("parse", f"module image must be bytes, got {type(image).__name__}")
    try:
        return cuda.module_from_buffer(bytes(image))
    except cuda.Error as e:
        raise ExecutionError("compile", "cannot load module image: " + shorten(str(e))) from None
