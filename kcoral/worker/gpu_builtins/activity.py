# -*- test-case-name: tests.unit.test_gpu_builtins_cpu,tests.gpu.test_gpu_trusted_timing -*-
"""
What C{benchmark} sees of the GPU: CUPTI activity records (cupti-python)
over every stream and context of the worker, and the driver calls of its
timed loop (ctypes on C{libcuda}: nothing an uploaded module patches in
PyCUDA or torch reaches them).

Each iteration is a window of CUPTI timestamps: a device-wide
synchronize, a timestamp, the call, an event on the calling stream waited
for (a second timestamp), a device-wide synchronize and a third
timestamp.  The GPU activity an iteration I{caused} is the kernels, copies
and memsets that started inside its window (on any stream, from any
thread): the synchronize before it finished everything this context had
been given, so nothing started in the window was launched before it.  Its
span runs from the earliest start to the latest end of that activity.
Activity still running when the calling stream's event completed was on a
stream the call did not join; activity still running after the
synchronize, or starting after it and before the next window, was outside
the context it synchronizes or launched late.

Only GPU activity kinds are enabled: no driver or runtime API records,
whose number (every call the loop and the program make) made closing the
session cost more than the loop itself.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import attrs

__all__ = [
    "ActivityTrace",
    "Driver",
    "IterationActivity",
    "Window",
    "activity_trace",
    "after_windows",
    "attribute",
    "started_late",
    "summarize",
]

#: C{CU_LIMIT_PERSISTING_L2_CACHE_SIZE}.
CU_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06
#: C{CU_EVENT_DISABLE_TIMING}: the loop's event only marks the calling
#: stream's end, it times nothing.
CU_EVENT_DISABLE_TIMING = 0x2

#: How far (ns) past the calling stream's end, or past the synchronize,
#: activity may end before it is flagged: the clocks of the host and the
#: GPU records are converted to one timebase, not read from one clock.
LATE_TOLERANCE_NS = 50_000

#: How far (ns) before a window's first timestamp activity may start and
#: still be the window's.  None: the call's first launch reaches the GPU
#: microseconds after the timestamp (the margin for the two clocks), while
#: what started earlier is the loop's work before the window (the flush
#: memset, which ends before the synchronize returns).
WINDOW_SLACK_NS = 0

#: Bytes of each activity buffer CUPTI fills.
BUFFER_BYTES = 8 << 20


class Driver:
    """The driver calls of the timed loop, through ctypes on C{libcuda}."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._synchronize = lib.cuCtxSynchronize
        self._synchronize.argtypes = []
        self._event_create = lib.cuEventCreate
        self._event_create.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        self._event_record = lib.cuEventRecord
        self._event_record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._event_wait = lib.cuEventSynchronize
        self._event_wait.argtypes = [ctypes.c_void_p]
        self._event_destroy = lib.cuEventDestroy_v2
        self._event_destroy.argtypes = [ctypes.c_void_p]
        self._get_limit = lib.cuCtxGetLimit
        self._get_limit.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.c_int]
        self._set_limit = lib.cuCtxSetLimit
        self._set_limit.argtypes = [ctypes.c_int, ctypes.c_size_t]
        self._reset_persisting = getattr(lib, "cuCtxResetPersistingL2Cache", None)
        for function in (
            self._synchronize,
            self._event_create,
            self._event_record,
            self._event_wait,
            self._event_destroy,
            self._get_limit,
            self._set_limit,
        ):
            function.restype = ctypes.c_int
        self._limit = ctypes.c_size_t(0)

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status:
            raise RuntimeError(f"{what} failed with CUDA error {status}")

    def synchronize(self) -> None:
        """Wait for all work of the current context (every stream)."""
        self._check(self._synchronize(), "cuCtxSynchronize")

    def event(self) -> ctypes.c_void_p:
        event = ctypes.c_void_p()
        self._check(
            self._event_create(ctypes.byref(event), CU_EVENT_DISABLE_TIMING), "cuEventCreate"
        )
        return event

    def destroy(self, event: ctypes.c_void_p) -> None:
        self._event_destroy(event)

    def mark(self, event: ctypes.c_void_p, stream: int) -> None:
        """Record C{event} on C{stream} and wait until it completes."""
        self._check(self._event_record(event, ctypes.c_void_p(stream)), "cuEventRecord")
        self._check(self._event_wait(event), "cuEventSynchronize")

    def persisting_limit(self) -> int:
        """The context's persisting L2 limit in bytes (0 where it has none)."""
        if self._get_limit(ctypes.byref(self._limit), CU_LIMIT_PERSISTING_L2_CACHE_SIZE):
            return 0
        return int(self._limit.value)

    def clear_persisting(self) -> None:
        """Persisting L2 limit to 0, and every persisting line back to normal."""
        self._set_limit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE, 0)
        if self._reset_persisting is not None:
            self._reset_persisting()


def calling_stream() -> int:
    """
    The stream a call is made on: torch's current stream when torch has
    initialised CUDA in this process, else the legacy default stream (0).
    """
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            return int(torch.cuda.current_stream().cuda_stream)
    except Exception:
        pass
    return 0


@attrs.frozen
class Window:
    """One iteration's host timestamps (CUPTI's timebase, ns)."""

    start: int
    stream_done: int
    end: int


@attrs.frozen
class IterationActivity:
    """The GPU activity one window caused."""

    #: C{(start, end, label)} of each kernel, copy or memset.
    records: tuple[tuple[int, int, str], ...]

    @property
    def span_ms(self) -> float | None:
        if not self.records:
            return None
        return (max(r[1] for r in self.records) - min(r[0] for r in self.records)) / 1e6

    def heaviest(self) -> str:
        """The label with the most GPU time in all (C{""} without activity)."""
        totals: Counter[str] = Counter()
        for start, end, label in self.records:
            totals[label] += end - start
        return max(totals, key=lambda label: (totals[label], label)) if totals else ""

    def late(self, after: int) -> bool:
        """Whether some activity ended more than the tolerance after C{after}."""
        return any(r[1] > after + LATE_TOLERANCE_NS for r in self.records)


def summarize(activity: IterationActivity) -> tuple[tuple[str, int], ...]:
    """The activity's kind: each label with how often it occurs, sorted."""
    return tuple(sorted(Counter(r[2] for r in activity.records).items()))


def _by_start(
    gpu: Sequence[tuple[int, int, str]],
) -> tuple[list[tuple[int, int, str]], list[int]]:
    records = sorted(gpu)
    return records, [r[0] for r in records]


def attribute(
    gpu: Sequence[tuple[int, int, str]],
    windows: Sequence[Window],
) -> list[IterationActivity]:
    """
    The GPU records (C{(start, end, label)}) each window caused: those that
    started in it, from its first timestamp (less L{WINDOW_SLACK_NS}) to
    its last.
    """
    records, starts = _by_start(gpu)
    out = []
    for window in windows:
        low = bisect.bisect_left(starts, window.start - WINDOW_SLACK_NS)
        high = bisect.bisect_right(starts, window.end)
        out.append(IterationActivity(tuple(records[low:high])))
    return out


def after_windows(
    gpu: Sequence[tuple[int, int, str]],
    windows: Sequence[Window],
) -> list[IterationActivity]:
    """
    For each window, the GPU records that started after it and before the
    next one (the last window: any time after it).
    """
    records, starts = _by_start(gpu)
    out = []
    for i, window in enumerate(windows):
        low = bisect.bisect_right(starts, window.end)
        if i + 1 < len(windows):
            high = bisect.bisect_left(starts, windows[i + 1].start - WINDOW_SLACK_NS)
        else:
            high = len(records)
        out.append(IterationActivity(tuple(records[low : max(low, high)])))
    return out


def started_late(
    between: Sequence[IterationActivity],
    expected: Counter[str],
    skip: frozenset[int] = frozenset(),
) -> dict[int, str]:
    """
    The windows after which (L{after_windows}) activity other than the
    C{expected} labels (how often each may occur there) started, each with
    the first such label; the windows in C{skip} are not checked.
    """
    late = {}
    for i, found in enumerate(between):
        if i in skip or not found.records:
            continue
        unexpected = Counter(r[2] for r in found.records) - expected
        if unexpected:
            late[i] = f"{min(unexpected)} started after it"
    return late


@attrs.define(eq=False)
class ActivityTrace:
    """
    CUPTI activity records of this process, collected while a session is
    open: kernels, copies and memsets, each as C{(start, end, label)}.
    """

    cupti: Any
    gpu: list[tuple[int, int, str]] = attrs.field(factory=list)
    _registered: bool = False
    _open: bool = False

    def _kinds(self) -> tuple[Any, ...]:
        kind = self.cupti.ActivityKind
        return (
            kind.CONCURRENT_KERNEL,
            kind.MEMCPY,
            kind.MEMSET,
            kind.MEMCPY2,
        )

    def _requested(self) -> tuple[int, int]:
        return BUFFER_BYTES, 0

    def _completed(self, activities: list[Any]) -> None:
        kind = self.cupti.ActivityKind
        kernel, memcpy, memcpy2, memset = (
            kind.CONCURRENT_KERNEL,
            kind.MEMCPY,
            kind.MEMCPY2,
            kind.MEMSET,
        )
        append = self.gpu.append
        for a in activities:
            k = a.kind
            if k == kernel:
                append((a.start, a.end, f"kernel:{a.name}"))
            elif k == memcpy:
                append((a.start, a.end, f"memcpy:{int(a.copy_kind)}:{int(a.bytes)}"))
            elif k == memcpy2:
                append((a.start, a.end, f"memcpy_p2p:{int(a.bytes)}"))
            elif k == memset:
                append((a.start, a.end, f"memset:{int(a.bytes)}"))

    def now(self) -> int:
        """CUPTI's timestamp (ns), the timebase of its records."""
        return int(self.cupti.get_timestamp())

    @contextlib.contextmanager
    def session(self, driver: Driver) -> Iterator[ActivityTrace]:
        """Collect records inside the block; all of them are in when it ends."""
        self.gpu = []
        if not self._registered:
            self.cupti.activity_register_callbacks(self._requested, self._completed)
            self._registered = True
        enabled = []
        self._open = True
        try:
            for kind in self._kinds():
                self.cupti.activity_enable(kind)
                enabled.append(kind)
            yield self
            driver.synchronize()
        finally:
            try:
                self.cupti.activity_flush_all(1)
            finally:
                for kind in reversed(enabled):
                    with contextlib.suppress(Exception):
                        self.cupti.activity_disable(kind)
                self._open = False


_trace: list[ActivityTrace | None] = []


def activity_trace() -> ActivityTrace | None:
    """This process's L{ActivityTrace}; C{None} when cupti-python is not usable."""
    if not _trace:
        try:
            from cupti import cupti

            _trace.append(ActivityTrace(cupti))
        except Exception:
            _trace.append(None)
    return _trace[0]
