# -*- test-case-name: tests.unit.test_gpu_builtins_cpu,tests.gpu.test_gpu_backend -*-
"""
C{builtin.randn}, C{builtin.empty} and C{builtin.zeros}: new device tensors
of the current GPU backend.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kcoral.errors import ExecutionError
from kcoral.wire.values import numpy_dtype
from kcoral.worker.gpu_builtins.common import check_cfg
from kcoral.worker.runtime import gpu_backend
from kcoral.worker.tensors import FLOATING_DTYPES, check_shape


def _tensor_spec(spec: Any, kwargs: dict[str, Any], what: str) -> dict[str, Any]:
    merged = dict(check_cfg(spec, what))
    merged.update(kwargs)
    if "shape" not in merged:
        raise ExecutionError("parse", f"{what}: 'shape' is required")
    return merged


def parse_tensor_spec(
    spec: Any, kwargs: dict[str, Any], what: str, floating: bool = False
) -> tuple[tuple[int, ...], str]:
    """C{(shape, dtype)} of a factory's C{{shape, dtype?}} argument."""
    merged = _tensor_spec(spec, kwargs, what)
    shape = check_shape(merged["shape"])
    dtype = merged.get("dtype", "float16")
    if not isinstance(dtype, str):
        raise ExecutionError("parse", f"{what}: dtype must be a string, got {dtype!r}")
    if dtype.startswith("torch."):
        dtype = dtype[len("torch.") :]
    try:
        numpy_dtype(dtype)
    except ValueError:
        raise ExecutionError("parse", f"{what}: unsupported dtype {dtype!r}") from None
    if floating and dtype not in FLOATING_DTYPES:
        raise ExecutionError("parse", f"{what}: dtype must be floating point, got {dtype!r}")
    return shape, dtype


def host_randn(shape: tuple[int, ...], dtype: str, seed: int | None) -> np.ndarray:
    """Standard normal samples from numpy's PCG64, cast to C{dtype}."""
    rng = np.random.default_rng(seed)
    work = np.float64 if dtype == "float64" else np.float32
    return rng.standard_normal(shape, dtype=work).astype(numpy_dtype(dtype))


def randn(spec: Any = None, /, **kwargs: Any) -> Any:
    """
    A new device tensor of standard normal samples (C{builtin.randn}):
    C{{shape, dtype?: "float16", seed?}}.  The same seed gives the same bits.
    """
    shape, dtype = parse_tensor_spec(spec, kwargs, "randn", floating=True)
    seed = _tensor_spec(spec, kwargs, "randn").get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
        raise ExecutionError("parse", f"randn: seed must be an integer, got {seed!r}")
    if seed is not None and seed < 0:
        raise ExecutionError("parse", f"randn: seed must be non-negative, got {seed}")
    host = host_randn(shape, dtype, None if seed is None else int(seed))
    return gpu_backend().upload_tensor(host.tobytes(), dtype, shape)


def empty(spec: Any = None, /, **kwargs: Any) -> Any:
    """A new uninitialized device tensor (C{builtin.empty}): C{{shape, dtype?}}."""
    shape, dtype = parse_tensor_spec(spec, kwargs, "empty")
    backend = gpu_backend()
    return backend.wrap(backend.allocate(dtype, shape))


def zeros(spec: Any = None, /, **kwargs: Any) -> Any:
    """A new zero-filled device tensor (C{builtin.zeros}): C{{shape, dtype?}}."""
    import pycuda.driver as drv

    shape, dtype = parse_tensor_spec(spec, kwargs, "zeros")
    backend = gpu_backend()
    array = backend.allocate(dtype, shape)
    if array.nbytes:
        drv.memset_d8(array.gpudata, 0, array.nbytes)
    return backend.wrap(array)
