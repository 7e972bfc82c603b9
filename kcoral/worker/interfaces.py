# -*- test-case-name: tests.unit.test_worker_engine -*-
"""
Seams inside a worker process: the device backend and the lease client.

The engine interprets programs against these two interfaces, so the same
engine runs on CPU nodes (numpy, no lease) and GPU nodes (PyCUDA, the
parent's per-GPU lease).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from zope.interface import Attribute, Interface

if TYPE_CHECKING:
    from kcoral.ipc.shared import SharedBuffer


class IDeviceBackend(Interface):
    """What a worker can do with tensors, libraries and the device."""

    name = Attribute("C{'cpu'} or C{'gpu'}.")
    uses_lease = Attribute("True when device work needs the parent's GPU lease.")

    def target() -> dict[str, str]:
        """The compilation target for /health: C{{}} on CPU, C{{'arch': 'sm_90a'}} on an H200."""

    def versions() -> dict[str, str]:
        """Versions of what this worker runs (driver, CUDA, PyCUDA, numpy, nvcc, Python)."""

    def upload_tensor(data: bytes, dtype: str, shape: tuple[int, ...]) -> Any:
        """
        Copy C{data} to a device tensor; return what uploaded Python receives.

        @raise kcoral.errors.ExecutionError: C{unavailable} on a CPU worker.
        """

    def load_library(data: bytes) -> Any:
        """
        Load a module image (cubin/fatbin) and return a handle whose
        C{get_function(name)} gives a kernel.

        @raise kcoral.errors.ExecutionError: C{unavailable} on CPU, C{compile} on a bad image.
        """

    def tensor_parts(
        value: Any,
    ) -> tuple[str, Sequence[int], bytes | memoryview | SharedBuffer] | None:
        """
        If C{value} is a tensor this backend knows, its C{(dtype, shape,
        little-endian C-contiguous bytes)}; else C{None}.  The bytes may be
        a view (the part collector copies it once, into the part) or a
        sealed L{kcoral.ipc.shared.SharedBuffer} the device copied into
        (kept as the part).
        """

    def drain() -> None:
        """Wait for queued device work (before releasing the lease)."""

    def cleanup() -> str | None:
        """
        End-of-program check: synchronize and read CUDA's pending error.

        @return: a message describing a pending launch error, or C{None}.
        @raise Exception: the context is poisoned; the worker must retire.
        """

    def reset() -> None:
        """Drop per-request device state before the worker is reused."""


class ILeaseClient(Interface):
    """The worker's side of the parent's GPU lease."""

    held = Attribute("Whether this worker holds its lease now.")

    def acquire() -> None:
        """Block until the parent grants the lease (no-op when held)."""

    def release() -> None:
        """Give the lease back (no-op when not held)."""
