# -*- test-case-name: tests.unit.test_gpuwatch -*-
"""
A best-effort watch for CUDA use inside C{cpu_only} runs.

A C{cpu_only} function runs while its worker does not hold the GPU lease, so
it must not touch the GPU: another worker may be measuring there.  The
reference traps the CUDA API with CUPTI callbacks; PyCUDA has no CUPTI
binding, so this watch wraps the Python entry points through which uploaded
code reaches the device:

  - every public callable of C{pycuda.driver} and C{pycuda.gpuarray}, and
    the methods of PyCUDA's device-side classes (C{Function}, C{Stream},
    C{Event}, C{Context}, C{GPUArray});
  - C{torch.cuda}'s public callables and C{torch.Tensor.cuda} when torch is
    already imported.

The first call through any of them raises L{GPUAccessViolation} naming the
call and the innermost uploaded-code frame.  What it cannot see: CUDA reached
through other native libraries (cupy, ctypes, a C extension), calls made in
subprocesses, and device work that was queued before the run started.  The
GPU backend therefore also watches the driver itself through CUPTI
(L{kcoral.worker.cuptiwatch}) when it can; this module is the fallback.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kcoral.errors import GPUAccessViolation

#: Names never wrapped: they do not touch the device, or the watch needs them.
_HARMLESS = frozenset({"init", "get_version", "get_driver_version", "Error", "LogicError"})


def uploaded_location(stack: list[traceback.FrameSummary]) -> str:
    """The innermost uploaded-code frame, else the innermost Python frame."""
    for frame in reversed(stack):
        if frame.filename.startswith("<uploaded:"):
            return f"{frame.filename}:{frame.lineno} in {frame.name}"
    if not stack:
        return ""
    last = stack[-1]
    return f"{last.filename}:{last.lineno} in {last.name}"


def _trap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def trapped(*args: Any, **kwargs: Any) -> Any:
        stack = traceback.extract_stack()[:-1]
        raise GPUAccessViolation(
            f"cpu_only function called {name} while the worker does not hold the GPU lease",
            cuda_call=name,
            location=uploaded_location(stack),
            call_stack="Traceback (most recent call last):\n"
            + "".join(traceback.format_list(stack)),
        )

    trapped.__wrapped__ = original  # type: ignore[attr-defined]
    return trapped


def _present(
    owner: Any, names: Sequence[str], prefix: str, own: bool = False
) -> Iterator[tuple[Any, str, str]]:
    """
    C{(owner, name, "prefix.name")} for each of C{names} that C{owner} has
    (nothing when C{owner} is C{None}); with C{own}, only those it defines
    itself, not inherited ones.
    """
    if owner is None:
        return
    for attr in names:
        if (attr in vars(owner)) if own else hasattr(owner, attr):
            yield owner, attr, f"{prefix}.{attr}"


def _targets() -> Iterator[tuple[Any, str, str]]:
    """(owner, attribute, reported name) for every entry point to wrap."""
    driver = sys.modules.get("pycuda.driver")
    if driver is not None:
        for attr in dir(driver):
            if attr.startswith("_") or attr in _HARMLESS:
                continue
            value = getattr(driver, attr, None)
            if callable(value) and not isinstance(value, type):
                yield driver, attr, f"pycuda.driver.{attr}"
        for cls_name in ("Function", "Stream", "Event", "Context", "DeviceAllocation"):
            yield from _present(
                getattr(driver, cls_name, None),
                ("__call__", "prepared_call", "synchronize", "record", "query", "push", "free"),
                f"pycuda.driver.{cls_name}",
                own=True,
            )
    gpuarray = sys.modules.get("pycuda.gpuarray")
    yield from _present(
        gpuarray,
        ("to_gpu", "to_gpu_async", "empty", "zeros", "empty_like", "zeros_like", "arange"),
        "pycuda.gpuarray",
    )
    yield from _present(
        getattr(gpuarray, "GPUArray", None),
        ("get", "set", "fill", "copy", "__init__"),
        "pycuda.gpuarray.GPUArray",
        own=True,
    )
    torch = sys.modules.get("torch")
    yield from _present(
        getattr(torch, "cuda", None),
        ("synchronize", "empty_cache", "mem_get_info", "set_device", "current_stream"),
        "torch.cuda",
    )
    yield from _present(getattr(torch, "Tensor", None), ("cuda",), "torch.Tensor")


@contextlib.contextmanager
def cpu_only_watch() -> Iterator[None]:
    """Trap CUDA entry points for the duration of the block, then restore them."""
    saved: list[tuple[Any, str, Any, bool]] = []
    try:
        for owner, attr, name in _targets():
            try:
                original = getattr(owner, attr)
                had_own = attr in vars(owner)
                setattr(owner, attr, _trap(name, original))
            except (AttributeError, TypeError):
                continue  # a C type that refuses new attributes
            saved.append((owner, attr, original, had_own))
        yield
    finally:
        for owner, attr, original, had_own in reversed(saved):
            try:
                if had_own:
                    setattr(owner, attr, original)
                else:
                    delattr(owner, attr)
            except (AttributeError, TypeError):
                pass
