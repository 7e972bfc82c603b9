# -*- test-case-name: tests.unit.test_worker_engine -*-
"""
Process-wide accessors for what builtins need: the worker's device backend,
its lease client and its builtin registry.  This is the one holder of the
current backend.

A worker process installs these once at startup (L{install}); importable
helpers such as L{kcoral.builtins.benchmark} read them back.  Outside a worker
nothing is installed and the accessors return C{None}.
"""

from __future__ import annotations

import time
from typing import Any

from kcoral.errors import ExecutionError

_state: dict[str, Any] = {
    "backend": None,
    "lease": None,
    "builtins": None,
    "deadline": None,
    "measurer": None,
}


def install(backend: Any, lease: Any, builtins: Any) -> None:
    """Make C{backend}, C{lease} and C{builtins} the current ones."""
    _state.update(backend=backend, lease=lease, builtins=builtins)


def uninstall() -> None:
    """Forget the current backend, lease and builtins."""
    _state.update(backend=None, lease=None, builtins=None)


def current_backend() -> Any:
    """The worker's L{IDeviceBackend}, or C{None} outside a worker."""
    return _state["backend"]


def current_lease() -> Any:
    """The worker's L{ILeaseClient}, or C{None} outside a worker."""
    return _state["lease"]


def current_builtins() -> Any:
    """The worker's builtin registry, or C{None} outside a worker."""
    return _state["builtins"]


def install_measurer(measurer: Any) -> None:
    """
    Make C{measurer} (L{kcoral.worker.measure.ChannelMeasurer}) the one
    C{benchmark} sends its raw measurements to.
    """
    _state["measurer"] = measurer


def current_measurer() -> Any:
    """
    Where C{benchmark} sends what it measured: the worker's channel to its
    parent, or a new L{kcoral.worker.measure.LocalMeasurer} outside a worker.
    """
    measurer = _state["measurer"]
    if measurer is None:
        from kcoral.worker.measure import LocalMeasurer

        return LocalMeasurer()
    return measurer


def use_backend(backend: Any) -> None:
    """
    Make C{backend} the current one outside a worker (tests, or kcoral used
    as a library): builtins then use it as they would a worker's.
    """
    _state["backend"] = backend


def gpu_backend() -> Any:
    """
    The current backend, which GPU builtins need to be a GPU one.

    @raise ExecutionError: C{unavailable} when there is no GPU backend.
    """
    backend = _state["backend"]
    if backend is None or getattr(backend, "name", None) != "gpu":
        raise ExecutionError("unavailable", "this builtin needs a GPU worker")
    return backend


def set_budget(seconds: float | None) -> None:
    """
    Start the running request's budget: C{seconds} from now, or no bound
    (C{None}).  Builtins that start a compiler bound it by what is left.
    """
    _state["deadline"] = None if seconds is None else time.monotonic() + float(seconds)


def remaining_budget(default: float) -> float:
    """
    Seconds left of the running request's budget, at most C{default}.

    @raise ExecutionError: C{compile} when the budget is spent (only
        compilers ask; the parent ends the request as a timeout anyway).
    """
    deadline = _state["deadline"]
    if deadline is None:
        return default
    left = deadline - time.monotonic()
    if left <= 0:
        raise ExecutionError("compile", "the request's execution budget is spent")
    return min(default, left)
