# -*- test-case-name: tests.unit.test_gpu_builtins_cpu,tests.gpu.test_gpu_backend -*-
"""
Launch handles (C{builtin.kernel}): a kernel with its geometry and argument
types fixed, called with tensors and scalars.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from kcoral.errors import ExecutionError
from kcoral.worker.gpu_builtins.common import check_cfg, cuda_errors, is_number

#: Argument type names and their C{struct} codes.
ARG_TYPES: dict[str, str] = {
    "ptr": "P",
    "i8": "b",
    "u8": "B",
    "i16": "h",
    "u16": "H",
    "i32": "i",
    "u32": "I",
    "i64": "q",
    "u64": "Q",
    "f32": "f",
    "f64": "d",
}

_ALIASES = {
    "pointer": "ptr",
    "tensor": "ptr",
    "int8": "i8",
    "uint8": "u8",
    "int16": "i16",
    "uint16": "u16",
    "int": "i32",
    "int32": "i32",
    "uint32": "u32",
    "int64": "i64",
    "uint64": "u64",
    "float": "f32",
    "float32": "f32",
    "double": "f64",
    "float64": "f64",
}

_INT_RANGES = {
    "i8": (-(2**7), 2**7 - 1),
    "u8": (0, 2**8 - 1),
    "i16": (-(2**15), 2**15 - 1),
    "u16": (0, 2**16 - 1),
    "i32": (-(2**31), 2**31 - 1),
    "u32": (0, 2**32 - 1),
    "i64": (-(2**63), 2**63 - 1),
    "u64": (0, 2**64 - 1),
}


def normalize_arg_types(arg_types: Any, arg_names: Any = None) -> tuple[tuple[str, str], ...]:
    """
    C{((name, type), ...)} from a list of C{"i32"} or C{"n:i32"} entries
    (names from C{arg_names}, else C{arg0}, C{arg1}, ...).

    @raise ExecutionError: C{parse} for an unknown type or a bad list.
    """
    if not isinstance(arg_types, (list, tuple)):
        raise ExecutionError("parse", f"arg_types must be a list of type names, got {arg_types!r}")
    if arg_names is not None and (
        not isinstance(arg_names, (list, tuple)) or len(arg_names) != len(arg_types)
    ):
        raise ExecutionError("parse", "arg_names must be a list as long as arg_types")
    out = []
    for i, entry in enumerate(arg_types):
        if not isinstance(entry, str):
            raise ExecutionError("parse", f"arg_types[{i}] must be a string, got {entry!r}")
        name, sep, kind = entry.rpartition(":")
        kind = kind.strip().lower()
        kind = _ALIASES.get(kind, kind)
        if kind not in ARG_TYPES:
            raise ExecutionError(
                "parse",
                f"arg_types[{i}]: unknown type {entry!r} (one of {', '.join(ARG_TYPES)})",
            )
        if not sep:
            name = str(arg_names[i]) if arg_names is not None else f"arg{i}"
        out.append((name.strip(), kind))
    return tuple(out)


def _dims(value: Any, what: str) -> tuple[int, int, int]:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = [value]
    if (
        not isinstance(value, (list, tuple))
        or not 1 <= len(value) <= 3
        or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1 for v in value)
    ):
        raise ExecutionError("parse", f"{what} must be 1 to 3 positive integers, got {value!r}")
    dims = [int(v) for v in value] + [1] * (3 - len(value))
    return dims[0], dims[1], dims[2]


def device_pointer(value: Any) -> int | None:
    """The device address of a tensor-like value, or C{None} if it is none."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return int(value.data_ptr()) if value.is_cuda else None
    gpudata = getattr(value, "gpudata", _MISSING)
    if gpudata is not _MISSING:
        return int(gpudata) if gpudata is not None else 0  # type: ignore[call-overload]
    cai = getattr(value, "__cuda_array_interface__", None)
    if isinstance(cai, dict):
        return int(cai["data"][0])
    drv = sys.modules.get("pycuda.driver")
    if drv is not None and isinstance(value, (drv.DeviceAllocation, drv.PooledDeviceAllocation)):
        return int(value)
    return None


_MISSING = object()


def _describe(value: Any) -> str:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor) and not value.is_cuda:
        return "a CPU torch.Tensor"
    if isinstance(value, np.ndarray):
        return "a host numpy array"
    return f"{type(value).__name__} {value!r}" if is_number(value) else type(value).__name__


def convert_argument(kind: str, value: Any) -> int | float | None:
    """
    C{value} as a kernel argument of C{kind}, or C{None} when it does not
    fit (wrong type or out of range).
    """
    if kind == "ptr":
        return device_pointer(value)
    if kind in ("f32", "f64"):
        return float(value) if is_number(value) else None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        return None
    low, high = _INT_RANGES[kind]
    return int(value) if low <= value <= high else None


class KernelHandle:
    """
    A kernel with its launch geometry and argument types fixed when made.

    Calling it with tensors (GPUArray, torch CUDA tensors, cupy arrays or any
    C{__cuda_array_interface__} exporter) and scalars launches the kernel on
    the default stream.  C{grid}, C{block} and C{shared_mem} may be given (or
    overridden) as keywords of a call.
    """

    def __init__(
        self,
        function: Any,
        grid: Any = None,
        block: Any = None,
        shared_mem: int = 0,
        arg_types: Any = (),
        arg_names: Any = None,
        name: str | None = None,
    ) -> None:
        self.function = function
        self.name = name or getattr(function, "name", None) or "kernel"
        self.grid = None if grid is None else _dims(grid, "grid")
        self.block = None if block is None else _dims(block, "block")
        self.shared_mem = _shared(shared_mem)
        self.params = normalize_arg_types(arg_types, arg_names)
        self._format = "@" + "".join(ARG_TYPES[kind] for _, kind in self.params)
        self._configured_shared = 0

    @property
    def signature(self) -> str:
        """C{"name(x: ptr, n: i32)"}."""
        inner = ", ".join(f"{n}: {k}" for n, k in self.params)
        return f"{self.name}({inner})"

    def pack(self, args: Sequence[Any]) -> bytes:
        """
        The kernel's parameter buffer for C{args}.

        @raise ExecutionError: C{runtime} naming the first parameter that
            does not fit, or for a wrong number of arguments.
        """
        if len(args) != len(self.params):
            raise ExecutionError(
                "runtime",
                f"{self.signature} takes {len(self.params)} argument(s), got {len(args)}",
            )
        values = []
        for i, ((pname, kind), value) in enumerate(zip(self.params, args, strict=True)):
            converted = convert_argument(kind, value)
            if converted is None:
                expects = "a device tensor (ptr)" if kind == "ptr" else kind
                raise ExecutionError(
                    "runtime",
                    f"{self.name}: parameter {i} ({pname}) expects {expects}, "
                    f"got {_describe(value)}",
                )
            values.append(converted)
        return struct.pack(self._format, *values)

    def __call__(
        self, *args: Any, grid: Any = None, block: Any = None, shared_mem: Any = None
    ) -> None:
        buffer = self.pack(args)
        grid3 = _dims(grid, "grid") if grid is not None else self.grid
        block3 = _dims(block, "block") if block is not None else self.block
        if grid3 is None or block3 is None:
            raise ExecutionError(
                "runtime", f"{self.name}: no launch geometry (give grid and block in cfg)"
            )
        shared = _shared(shared_mem) if shared_mem is not None else self.shared_mem
        self._launch(grid3, block3, shared, buffer)

    def _launch(
        self, grid: tuple[int, int, int], block: tuple[int, int, int], shared: int, buffer: bytes
    ) -> None:
        if shared > 48 * 1024 and shared > self._configured_shared:
            import pycuda.driver as drv

            self.function.set_attribute(
                drv.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, shared
            )
            self._configured_shared = shared
        try:
            self.function._launch_kernel(grid, block, buffer, shared, None)
        except cuda_errors() as e:
            raise ExecutionError("runtime", f"{self.name}: launch failed: {e}") from e

    def __repr__(self) -> str:
        return f"<KernelHandle {self.signature} grid={self.grid} block={self.block}>"


def _shared(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ExecutionError("parse", f"shared_mem must be a non-negative integer, got {value!r}")
    return int(value)


def launcher(library: Any, name: Any = None, cfg: Any = None) -> KernelHandle:
    """
    C{builtin.kernel}: a L{KernelHandle} for kernel C{name} of an uploaded
    library, or for a function handle from C{get_function} (then C{name}
    may be omitted).  C{cfg = {grid, block, shared_mem?, arg_types,
    arg_names?}}.
    """
    if isinstance(name, dict) and cfg is None:
        name, cfg = None, name
    cfg = check_cfg(cfg, "kernel")
    if "arg_types" not in cfg:
        raise ExecutionError("parse", "kernel: cfg.arg_types is required")
    if name is None:
        function = getattr(library, "function", None)
        if function is None:
            raise ExecutionError(
                "runtime", "kernel expects a library handle and a name, or a library function"
            )
        name = getattr(library, "name", None)
    else:
        if not isinstance(name, str):
            raise ExecutionError("parse", f"kernel: name must be a string, got {name!r}")
        if not hasattr(library, "get_function"):
            raise ExecutionError("runtime", "kernel expects an uploaded library handle")
        function = library.get_function(name)
        function = getattr(function, "function", function)
    return make_handle(function, name, cfg, cfg["arg_types"], cfg.get("arg_names"))


def make_handle(
    function: Any, name: str | None, cfg: dict[str, Any], arg_types: Any, arg_names: Any
) -> KernelHandle:
    return KernelHandle(
        function,
        grid=cfg.get("grid"),
        block=cfg.get("block"),
        shared_mem=cfg.get("shared_mem", 0),
        arg_types=arg_types,
        arg_names=arg_names,
        name=name,
    )
