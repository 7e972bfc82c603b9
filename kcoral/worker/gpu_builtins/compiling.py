# -*- test-case-name: tests.unit.test_gpu_builtins_cpu,tests.gpu.test_gpu_backend -*-
"""
C{builtin.compile_cuda}: compile a CUDA module's kernel for this device
(nvcc off the GPU lease) and return its launch handle.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from kcoral.compilers.source import add_extern_c
from kcoral.compilers.tvmffi import export_source, is_host_function, load_library
from kcoral.errors import ExecutionError
from kcoral.worker.gpu_builtins.common import check_cfg
from kcoral.worker.gpu_builtins.launch import KernelHandle, make_handle, normalize_arg_types
from kcoral.worker.runtime import current_lease, gpu_backend, remaining_budget

_C_TYPES = {
    "char": "i8",
    "signed char": "i8",
    "unsigned char": "u8",
    "int8_t": "i8",
    "uint8_t": "u8",
    "short": "i16",
    "unsigned short": "u16",
    "int16_t": "i16",
    "uint16_t": "u16",
    "int": "i32",
    "signed": "i32",
    "signed int": "i32",
    "unsigned": "u32",
    "unsigned int": "u32",
    "int32_t": "i32",
    "uint32_t": "u32",
    "long": "i64",
    "long long": "i64",
    "long int": "i64",
    "long long int": "i64",
    "unsigned long": "u64",
    "unsigned long long": "u64",
    "int64_t": "i64",
    "uint64_t": "u64",
    "size_t": "u64",
    "ptrdiff_t": "i64",
    "float": "f32",
    "double": "f64",
}

_QUALIFIERS = re.compile(r"\b(const|volatile|__restrict__|__restrict|restrict)\b")


def kernel_signature(source: str, name: str) -> tuple[tuple[str, str], ...] | None:
    """
    C{((name, type), ...)} of the parameters of C{__global__} kernel
    C{name} in C{source}, or C{None} when they cannot be read (templates,
    unknown types, macros).
    """
    pattern = re.compile(
        r"__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+"
        r"(?:__launch_bounds__\s*\([^)]*\)\s*)?" + re.escape(name) + r"\s*\(([^)]*)\)"
    )
    match = pattern.search(source)
    if match is None:
        return None
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", match.group(1), flags=re.S).strip()
    if not text or text == "void":
        return ()
    params = []
    for i, raw in enumerate(text.split(",")):
        decl = " ".join(_QUALIFIERS.sub(" ", raw).split())
        pointer = "*" in decl
        decl = decl.replace("*", " ").replace("&", " ")
        words = decl.split()
        if not words:
            return None
        pname = words[-1] if len(words) > 1 else f"arg{i}"
        ctype = " ".join(words[:-1]) if len(words) > 1 else words[0]
        if pointer:
            params.append((pname, "ptr"))
        elif ctype in _C_TYPES:
            params.append((pname, _C_TYPES[ctype]))
        else:
            return None
    return tuple(params)


def parse_compile_cfg(cfg: Any) -> list[str]:
    """The validated C{extra_cuda_cflags} of a C{compile_cuda} cfg."""
    cfg = check_cfg(cfg, "compile_cuda")
    flags = cfg.get("extra_cuda_cflags", [])
    if not isinstance(flags, (list, tuple)) or not all(isinstance(f, str) for f in flags):
        raise ExecutionError("parse", "compile_cuda: extra_cuda_cflags must be a list of strings")
    return list(flags)


#: Most seconds one compile_cuda may run when the budget allows more.
COMPILE_TIMEOUT_SECONDS = 300.0


def compile_image(
    source: str, arch: str, flags: Sequence[str], timeout: float | None = None
) -> bytes:
    """
    Compile CUDA C to a cubin for C{arch} through the compiler backend
    registry's C{sourcemodule} backend (PyCUDA's compiler, no device
    needed): cached by source, options and arch like nvcc on CPU nodes, and
    bounded by what is left of the request's budget.

    @raise ExecutionError: C{compile} with nvcc's diagnostics, its timeout,
        or a budget already spent; C{unavailable} without nvcc or PyCUDA.
    """
    from kcoral.compilers import compile_binary

    if timeout is None:
        timeout = remaining_budget(COMPILE_TIMEOUT_SECONDS)
    return compile_binary(source, arch, ("-O3", *flags), timeout, backend="sourcemodule")


def compile_cuda(source_fn: Any, cfg: Any = None, *, lease: Any = None) -> KernelHandle:
    """
    C{builtin.compile_cuda}: compile the kernel of a C{language: "cuda"}
    module handle for this device and return a L{KernelHandle}.

    C{cfg = {grid?, block?, shared_mem?, arg_types?, arg_names?,
    extra_cuda_cflags?}}; without C{arg_types} they are read from the
    kernel's C signature.  nvcc runs without the GPU lease; the lease is
    acquired again before the image is loaded.
    """
    source = getattr(source_fn, "source", None)
    name = getattr(source_fn, "name", None)
    if isinstance(source_fn, str):
        source, name = source_fn, check_cfg(cfg, "compile_cuda").get("name")
    if not isinstance(source, str) or not isinstance(name, str):
        raise ExecutionError(
            "runtime", "compile_cuda expects the get_function handle of a CUDA module"
        )
    config = check_cfg(cfg, "compile_cuda")
    flags = parse_compile_cfg(config)
    if is_host_function(source, name):
        return _compile_host_function(source, name, flags, lease)
    if "arg_types" in config:
        params = normalize_arg_types(config["arg_types"], config.get("arg_names"))
    backend = gpu_backend()
    if lease is None:
        lease = current_lease()
    if lease is not None:
        lease.release()
    # Compile first: a source that does not compile is a `compile` error
    # with the compiler's message, whatever its signature looks like.
    image = compile_image(add_extern_c(source), backend.arch, flags)
    if lease is not None:
        lease.acquire()
    if "arg_types" not in config:
        found = kernel_signature(source, name)
        if found is None:
            raise ExecutionError(
                "parse",
                f"compile_cuda: cannot read the parameters of {name!r}; give cfg.arg_types",
            )
        params = found
    library = backend.load_library(image)
    try:
        function = library.get_function(name)
    except ExecutionError:
        raise ExecutionError(
            "compile", f"compile_cuda: the compiled module has no kernel {name!r}"
        ) from None
    return make_handle(function.function, name, config, [f"{n}:{k}" for n, k in params], None)


#: TVM-FFI modules loaded by this worker, by library digest: a module stays
#: loaded while its functions may be called.
_host_modules: dict[str, Any] = {}


def _compile_host_function(source: str, name: str, flags: list[str], lease: Any) -> Any:
    """
    Build a TVM-FFI host function into a shared library (the C{tvmffi}
    backend: cached, bounded by the budget, off the lease), load it with
    C{tvm_ffi.load_module} under the lease and return the exported function.
    """
    import hashlib

    from kcoral.compilers import compile_binary

    backend = gpu_backend()
    if lease is None:
        lease = current_lease()
    if lease is not None:
        lease.release()
    image = compile_binary(
        export_source(source, name),
        backend.arch,
        tuple(flags),
        remaining_budget(COMPILE_TIMEOUT_SECONDS),
        backend="tvmffi",
    )
    if lease is not None:
        lease.acquire()
    digest = hashlib.sha256(image).hexdigest()
    module = _host_modules.get(digest)
    if module is None:
        module = _host_modules[digest] = load_library(image)
    try:
        return module[name]
    except Exception:
        raise ExecutionError(
            "compile", f"compile_cuda: the compiled library exports no function {name!r}"
        ) from None
