# -*- test-case-name: tests.unit.test_cuptiwatch,tests.gpu.test_gpu_cupti_watch -*-
"""
Watch the CUDA driver itself during C{cpu_only} runs, through CUPTI's
callback API (cupti-python).

Every CUDA library (torch, cupy, PyCUDA, ctypes on C{libcuda}) ends in the
driver API, so a driver-API callback sees them all.  The subscription is
made once per process; the driver domain is enabled only while a
C{cpu_only} function runs.  A callback cannot stop the call it reports (it
runs inside the driver), so the first device-touching call is remembered,
with the Python stack of the thread that made it, and the run fails with
C{gpu_access} naming that call and the uploaded-code line when it returns.

Without cupti-python (or without a CUPTI the driver accepts) the worker
falls back to L{kcoral.worker.gpuwatch}'s Python-level traps.

The same subscription lets a module upload or a GPU function's run start
off the lease (L{DriverWatch.leasing}): its code may touch CUDA, so the
first driver call that does blocks, on entry, until the worker holds the
lease; then the domain is switched off, at that call's exit, for the rest
of the block.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from kcoral.errors import GPUAccessViolation
from kcoral.worker.gpuwatch import uploaded_location

__all__ = [
    "HARMLESS_DRIVER_CALLS",
    "RELEASE_PREFIXES",
    "DriverWatch",
    "driver_watch",
    "existing_driver_watch",
]

#: Driver calls that only ask questions or look up entry points: libraries
#: make them when they load, and they do not touch a device.
HARMLESS_DRIVER_CALLS = frozenset(
    {
        "cuInit",
        "cuDriverGetVersion",
        "cuGetProcAddress",
        "cuGetProcAddress_v2",
        "cuGetExportTable",
        "cuGetErrorName",
        "cuGetErrorString",
        "cuDeviceGet",
        "cuDeviceGetCount",
        "cuDeviceGetName",
        "cuDeviceGetUuid",
        "cuDeviceGetUuid_v2",
        "cuDeviceGetAttribute",
        "cuDeviceGetPCIBusId",
        "cuDeviceTotalMem",
        "cuDeviceTotalMem_v2",
        "cuDeviceComputeCapability",
        "cuDevicePrimaryCtxGetState",
        "cuCtxGetCurrent",
        "cuCtxGetDevice",
        "cuCtxGetApiVersion",
        "cuModuleGetLoadingMode",
    }
)


#: Calls that release what earlier, leased instructions made (memory,
#: modules, events, streams): the garbage collector may make them during a
#: cpu_only run for objects the program no longer holds.
RELEASE_PREFIXES = (
    "cuMemFree",
    "cuMemHostUnregister",
    "cuModuleUnload",
    "cuLibraryUnload",
    "cuEventDestroy",
    "cuStreamDestroy",
    "cuDevicePrimaryCtxRelease",
)


@attrs.define(eq=False)
class DriverWatch:
    """
    One CUPTI subscriber to the driver API domain, switched on per run.

    @ivar cupti: the C{cupti.cupti} module (or a stand-in in tests).
    """

    cupti: Any
    _subscriber: Any = None
    _first: tuple[str, str, str] | None = None
    _active: bool = False
    #: While L{leasing}: what takes the lease at the first device call,
    #: and the event the other threads' calls wait on meanwhile.
    _acquire: Callable[[], None] | None = None
    _granted: threading.Event | None = None
    _lock: threading.Lock = attrs.field(factory=threading.Lock)
    #: Whether L{leasing} has the domain on (not yet switched off).
    _leasing_on: bool = False
    #: The thread whose device call took the lease: at that call's exit
    #: callback the domain is switched off.
    _off_at_exit: int | None = None
    #: Whether CUPTI refused to switch the domain off inside a callback.
    switch_off_refused: bool = False

    def __attrs_post_init__(self) -> None:
        self._subscriber = self.cupti.subscribe(self._callback, None)

    def _callback(self, userdata: Any, domain: Any, callback_id: Any, cbdata: Any) -> None:
        granted = self._granted
        if not self._active and granted is None:
            return
        if cbdata.callback_site != self.cupti.ApiCallbackSite.API_ENTER:
            if self._off_at_exit == threading.get_ident():
                # The exit of the call that took the lease: switched off
                # here, not on its entry (switched off on entry, later
                # blocks missed device calls on an H200:
                # bench/probes/cupti_switch_probe.py).
                self._off_at_exit = None
                self._switch_off()
            return
        name = str(cbdata.function_name)
        if name in HARMLESS_DRIVER_CALLS or name.startswith(RELEASE_PREFIXES):
            return
        if granted is not None:
            # Called on entry, before the driver does the work: the call
            # waits here until this worker holds the lease.
            with self._lock:
                acquire, self._acquire = self._acquire, None
            if acquire is None:
                granted.wait()
                return
            try:
                acquire()
            finally:
                granted.set()
            # Held now: nothing later in the block needs watching, and the
            # callbacks would slow every later call (a torch launch took
            # 82 us instead of 6 on an H200), so the domain goes off at
            # this call's exit.
            self._off_at_exit = threading.get_ident()
            return
        if self._first is not None:
            return
        stack = traceback.extract_stack()[:-1]
        with self._lock:
            if self._first is None:
                self._first = (
                    name,
                    uploaded_location(stack),
                    "Traceback (most recent call last):\n" + "".join(traceback.format_list(stack)),
                )

    def _switch_off(self) -> None:
        """Switch the driver domain off from inside a callback, if CUPTI lets us."""
        try:
            self.cupti.enable_domain(0, self._subscriber, self.cupti.CallbackDomain.DRIVER_API)
            self._leasing_on = False
        except Exception:
            # Refused: the domain stays on until the block ends, which costs
            # time but changes nothing the lease guards.
            self.switch_off_refused = True

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """
        Report the run's first device-touching driver call as
        L{GPUAccessViolation} when the block ends.
        """
        domain = self.cupti.CallbackDomain.DRIVER_API
        # Device objects that are already garbage are freed now, not by a
        # collection in the middle of the run.
        gc.collect()
        self._first = None
        self._active = True
        self.cupti.enable_domain(1, self._subscriber, domain)
        try:
            yield
        finally:
            self.cupti.enable_domain(0, self._subscriber, domain)
            self._active = False
            first, self._first = self._first, None
            if first is not None:
                name, location, stack = first
                raise GPUAccessViolation(
                    f"cpu_only function called the CUDA driver ({name}) while the worker "
                    "does not hold the GPU lease",
                    cuda_call=name,
                    location=location,
                    call_stack=stack,
                )

    @contextlib.contextmanager
    def leasing(self, acquire: Callable[[], None]) -> Iterator[None]:
        """
        Run a block off the lease and take it (C{acquire()}, blocking) at the
        block's first device-touching driver call, before the driver does
        that call; a call from another thread meanwhile waits for the grant
        too.  Whether it was taken is the lease's own C{held}.  Once it is,
        the domain is switched off at the exit of the call that took it: the
        rest of the block runs at full speed.
        """
        domain = self.cupti.CallbackDomain.DRIVER_API
        self._acquire = acquire
        self._granted = threading.Event()
        self.cupti.enable_domain(1, self._subscriber, domain)
        self._leasing_on = True
        try:
            yield
        finally:
            self._off_at_exit = None
            if self._leasing_on:
                self.cupti.enable_domain(0, self._subscriber, domain)
                self._leasing_on = False
            self._acquire = None
            self._granted = None


_watch: list[DriverWatch | None] = []


def driver_watch() -> DriverWatch | None:
    """
    This process's L{DriverWatch}, made on first use; C{None} when CUPTI
    cannot be used here (no cupti-python, or the subscription is refused).
    """
    if not _watch:
        try:
            from cupti import cupti

            _watch.append(DriverWatch(cupti))
        except Exception:
            _watch.append(None)
    return _watch[0]


def existing_driver_watch() -> DriverWatch | None:
    """This process's L{DriverWatch} if one was made already, else C{None}."""
    return _watch[0] if _watch else None
