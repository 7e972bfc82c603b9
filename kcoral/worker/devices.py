# -*- test-case-name: tests.unit.test_worker_engine -*-
"""
Device backends and the registry L{make_backend} picks them from.

L{CpuBackend} serves CPU workers: Python modules, bytes and files run; tensor
and library uploads fail with C{unavailable} (protocol §6.2).  A GPU backend
registers itself in L{BACKENDS} (or through L{register_backend}) without any
other change here.

A backend may additionally provide these optional members, which the engine
and the builtin registry look up with C{getattr}:

  - C{builtins()}: a mapping C{name -> (callable, cpu_only)} that extends or
    overrides the CPU builtin table (see L{kcoral.worker.builtins});
  - C{cpu_only_watch()}: a context manager wrapped around C{cpu_only} runs that
    raises L{kcoral.errors.GPUAccessViolation} when the CUDA API is entered.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Sequence
from typing import Any

import attrs
from zope.interface import implementer

from kcoral.errors import ExecutionError
from kcoral.wire.values import numpy_tensor_parts
from kcoral.worker.interfaces import IDeviceBackend


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


@implementer(IDeviceBackend)
@attrs.define
class CpuBackend:
    """The backend of CPU workers: NumPy on the host, no lease."""

    name = "cpu"
    uses_lease = False

    def target(self) -> dict[str, str]:
        return {}

    def versions(self) -> dict[str, str]:
        """C{tvm_ffi} when it is installed, else nothing (protocol §1.1)."""
        version = _version("apache-tvm-ffi")
        return {"tvm_ffi": version} if version else {}

    def upload_tensor(self, data: bytes, dtype: str, shape: tuple[int, ...]) -> Any:
        raise ExecutionError("unavailable", "tensor uploads require a GPU worker")

    def load_library(self, data: bytes) -> Any:
        raise ExecutionError("unavailable", "library uploads require a GPU worker")

    def tensor_parts(self, value: Any) -> tuple[str, Sequence[int], bytes | memoryview] | None:
        return numpy_tensor_parts(value)

    def drain(self) -> None:
        pass

    def cleanup(self) -> str | None:
        return None

    def reset(self) -> None:
        pass


def _make_cpu(**kwargs: Any) -> CpuBackend:
    return CpuBackend()


#: Backend factories by device name; each takes the worker's keyword options
#: (C{gpu_ordinal}, C{tensor_api}) and ignores those it does not use.
def _make_gpu(**kwargs: Any) -> Any:
    # Imported here so CPU workers never import PyCUDA.
    from kcoral.worker.gpu import make_gpu_backend

    return make_gpu_backend(**kwargs)


BACKENDS: dict[str, Callable[..., Any]] = {"cpu": _make_cpu, "gpu": _make_gpu}


def _prepare_gpu(**kwargs: Any) -> None:
    from kcoral.worker.gpu import prepare_gpu_backend

    prepare_gpu_backend(**kwargs)


#: Optional device-free preparation per backend (imports), run off the lease.
PREPARERS: dict[str, Callable[..., None]] = {"gpu": _prepare_gpu}


def prepare_backend(name: str, **kwargs: Any) -> None:
    """Do backend C{name}'s slow, device-free start-up work (imports)."""
    prepare = PREPARERS.get(name)
    if prepare is not None:
        prepare(**kwargs)


def register_backend(name: str, factory: Callable[..., Any]) -> None:
    """Add (or replace) the factory for device C{name}."""
    BACKENDS[name] = factory


def make_backend(name: str, **kwargs: Any) -> Any:
    """
    Build the backend for device C{name}.

    @raise LookupError: no backend is registered under C{name}.
    """
    try:
        factory = BACKENDS[name]
    except KeyError:
        raise LookupError(f"no device backend named {name!r}") from None
    return factory(**kwargs)
