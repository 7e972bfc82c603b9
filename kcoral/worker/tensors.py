# -*- test-case-name: tests.unit.test_gpu_builtins_cpu -*-
"""
Host-side tensor helpers shared by the GPU backend and the GPU builtins:
dtype names, shapes, and host copies of device tensors.

A leaf module: it imports neither L{kcoral.worker.gpu} nor the builtins, and
imports PyCUDA, torch and cupy only when handed their objects.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from kcoral.errors import ExecutionError
from kcoral.wire.program import DTYPES
from kcoral.wire.values import numpy_dtype

#: The floating-point names among the twelve.
FLOATING_DTYPES = frozenset(
    {"float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"}
)


def element_type_name(dtype: Any) -> str:
    """The element type name of a numpy or torch dtype (C{torch.} dropped)."""
    if isinstance(dtype, np.dtype):
        return dtype.name
    name = str(dtype)
    return name[len("torch.") :] if name.startswith("torch.") else name


def dtype_name(dtype: Any) -> str:
    """
    The protocol name of a numpy or torch dtype.

    @raise ExecutionError: C{serialization} when it is none of the twelve.
    """
    name = element_type_name(dtype)
    if name not in DTYPES:
        raise ExecutionError("serialization", f"cannot return tensor dtype {name}")
    return name


def check_shape(shape: Any) -> tuple[int, ...]:
    """
    A shape as a tuple of non-negative ints.

    @raise ExecutionError: C{parse} for anything else.
    """
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, (list, tuple)):
        raise ExecutionError(
            "parse", f"shape must be a list of non-negative integers, got {shape!r}"
        )
    out = []
    for dim in shape:
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 0:
            raise ExecutionError(
                "parse", f"shape must be a list of non-negative integers, got {list(shape)!r}"
            )
        out.append(int(dim))
    return tuple(out)


def numpy_parts(array: np.ndarray) -> tuple[str, tuple[int, ...], memoryview]:
    """
    C{(dtype, shape, little-endian C-contiguous bytes)} of a host array; the
    bytes are a view (the part collector copies them once, into the part).
    """
    name = dtype_name(array.dtype)
    dtype = array.dtype
    if dtype.byteorder == ">":
        array = array.astype(dtype.newbyteorder("<"))
    contiguous = np.ascontiguousarray(array)
    return (
        name,
        tuple(int(d) for d in array.shape),
        contiguous.reshape(-1).view(np.uint8).data,
    )


def is_torch_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def is_cupy_array(value: Any) -> bool:
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(value, cupy.ndarray)


def is_gpuarray(value: Any) -> bool:
    gpuarray = sys.modules.get("pycuda.gpuarray")
    return gpuarray is not None and isinstance(value, gpuarray.GPUArray)


def torch_parts(tensor: Any) -> tuple[str, tuple[int, ...], bytes | memoryview]:
    """
    C{(dtype, shape, bytes)} of a torch tensor: a view of its host copy (of
    the tensor itself when it is a contiguous CPU tensor), which the part
    collector copies once, into the part.
    """
    import torch

    name = dtype_name(tensor.dtype)
    shape = tuple(int(d) for d in tensor.shape)
    host = tensor.detach().to("cpu").contiguous().reshape(-1)
    if host.numel() == 0:
        return name, shape, b""
    return name, shape, host.view(torch.uint8).numpy().data


def to_host(value: Any) -> np.ndarray | None:
    """
    A host numpy copy of a tensor-like C{value} (GPUArray, torch, cupy,
    C{__cuda_array_interface__} exporter, numpy array), or C{None}.

    bfloat16 and float8 come back as C{ml_dtypes} arrays.
    """
    if isinstance(value, np.ndarray):
        return value
    if is_torch_tensor(value):
        name, shape, data = torch_parts(value)
        return np.frombuffer(data, dtype=numpy_dtype(name)).reshape(shape)
    if is_gpuarray(value):
        return _gpuarray_to_host(value)
    if is_cupy_array(value):
        import cupy

        return cupy.asnumpy(value)
    cai = getattr(value, "__cuda_array_interface__", None)
    if isinstance(cai, dict):
        return _cai_to_host(cai)
    return None


def _gpuarray_to_host(array: Any) -> np.ndarray:
    if array.size == 0:
        return np.empty(array.shape, dtype=array.dtype)
    if array.flags.c_contiguous:
        return _copy_to_host(int(array.gpudata), array.dtype, tuple(array.shape))
    return array.get()


def _copy_to_host(ptr: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    # Copy into a uint8 buffer: numpy cannot export a buffer of an ml_dtypes
    # dtype to PyCUDA's copy functions.
    import pycuda.driver as drv

    raw = np.empty(math.prod(shape) * dtype.itemsize, dtype=np.uint8)
    drv.memcpy_dtoh(raw, ptr)
    return raw.view(dtype).reshape(shape)


def _cai_to_host(cai: dict[str, Any]) -> np.ndarray:
    import pycuda.driver as drv

    dtype = np.dtype(cai["typestr"])
    shape = tuple(int(d) for d in cai["shape"])
    ptr = int(cai["data"][0])
    strides = cai.get("strides")
    count = math.prod(shape)
    drv.Context.synchronize()
    if count == 0:
        return np.empty(shape, dtype=dtype)
    contiguous = strides is None or tuple(strides) == _c_strides(dtype.itemsize, shape)
    if contiguous:
        return _copy_to_host(ptr, dtype, shape)
    from pycuda import gpuarray

    view = gpuarray.GPUArray(shape, dtype, gpudata=ptr, strides=tuple(strides or ()))
    return view.get()


def _c_strides(itemsize: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    step = itemsize
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))
