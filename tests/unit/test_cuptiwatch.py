"""
Tests for L{kcoral.worker.cuptiwatch}: the driver-API watch reports the
first device-touching CUDA driver call of a cpu_only run (issue 17, item 3).
A stand-in C{cupti} module plays cupti-python and the driver; the real one
runs on the H200 (C{tests/gpu/test_gpu_cupti_watch.py}).
"""

from __future__ import annotations

import enum
from types import SimpleNamespace
from typing import Any

import pytest

from kcoral.errors import GPUAccessViolation
from kcoral.worker.cuptiwatch import DriverWatch


class FakeCupti:
    """Just the cupti-python calls the watch makes, and a driver that calls back."""

    class ApiCallbackSite(enum.IntEnum):
        API_ENTER = 0
        API_EXIT = 1

    class CallbackDomain(enum.IntEnum):
        DRIVER_API = 1

    def __init__(self) -> None:
        self.callback: Any = None
        self.enabled: list[int] = []
        #: Whether a callback is running (CUPTI calls from inside one).
        self.inside = False

    def subscribe(self, callback: Any, userdata: Any) -> int:
        self.callback = callback
        return 7

    def enable_domain(self, enable: int, subscriber: int, domain: int) -> None:
        assert subscriber == 7 and domain == self.CallbackDomain.DRIVER_API
        self.enabled.append(enable)

    def driver_call(self, name: str) -> None:
        """What the driver does for an API call: a callback on entry and exit while the domain is on."""
        for site in (self.ApiCallbackSite.API_ENTER, self.ApiCallbackSite.API_EXIT):
            if self.enabled and self.enabled[-1]:
                data = SimpleNamespace(callback_site=site, function_name=name)
                self.inside = True
                try:
                    self.callback(None, self.CallbackDomain.DRIVER_API, 0, data)
                finally:
                    self.inside = False


def uploaded(cupti: FakeCupti, *calls: str) -> Any:
    """A function compiled as uploaded code that makes C{calls}."""
    body = "".join(f"    cupti.driver_call({name!r})\n" for name in calls) or "    pass\n"
    code = compile("def user():\n" + body, "<uploaded:abc>", "exec")
    namespace: dict[str, Any] = {"cupti": cupti}
    exec(code, namespace)
    return namespace["user"]


def test_driver_call_reported_with_location() -> None:
    cupti = FakeCupti()
    watch = DriverWatch(cupti)
    user = uploaded(cupti, "cuInit", "cuDeviceGetCount", "cuMemAlloc_v2", "cuLaunchKernel")
    with pytest.raises(GPUAccessViolation) as caught, watch.watching():
        user()
    error = caught.value
    assert error.kind == "gpu_access"
    assert error.cuda_call == "cuMemAlloc_v2"
    assert error.location == "<uploaded:abc>:4 in user"
    assert "Traceback" in error.call_stack
    assert cupti.enabled == [1, 0]


def test_harmless_calls_pass() -> None:
    cupti = FakeCupti()
    watch = DriverWatch(cupti)
    with watch.watching():
        uploaded(cupti, "cuInit", "cuDriverGetVersion", "cuGetProcAddress_v2")()


def test_releases_pass() -> None:
    """Freeing what earlier instructions made (often the garbage collector) is not reported."""
    cupti = FakeCupti()
    watch = DriverWatch(cupti)
    with watch.watching():
        uploaded(cupti, "cuMemFree_v2", "cuEventDestroy_v2", "cuModuleUnload")()


def test_outside_the_run_nothing_is_reported() -> None:
    """Driver calls before and after a cpu_only run are the worker's own."""
    cupti = FakeCupti()
    watch = DriverWatch(cupti)
    cupti.driver_call("cuMemAlloc_v2")
    with watch.watching():
        pass
    cupti.driver_call("cuLaunchKernel")
    with watch.watching():
        pass


def test_violation_beats_the_run_error() -> None:
    """A run that touched the GPU and then failed is reported as gpu_access."""
    cupti = FakeCupti()
    watch = DriverWatch(cupti)
    user = uploaded(cupti, "cuMemcpyHtoD_v2")
    with pytest.raises(GPUAccessViolation), watch.watching():
        user()
        raise RuntimeError("the library failed afterwards")


# -- leasing: a module import off the lease ----------------------------------


def test_leasing_takes_the_lease_at_the_first_device_call() -> None:
    """Queries pass; the first device call waits for acquire(), which runs once."""
    cupti = FakeCupti()
    watch = DriverWatch(cupti)
    log: list[str] = []
    original = cupti.driver_call

    def driver_call(name: str) -> None:
        original(name)
        log.append(name)

    cupti.driver_call = driver_call  # type: ignore[method-assign]
    user = uploaded(cupti, "cuInit", "cuMemFree_v2", "cuMemAlloc_v2", "cuLaunchKernel")
    with watch.leasing(lambda: log.append("acquire")):
        user()
    assert log == ["cuInit", "cuMemFree_v2", "acquire", "cuMemAlloc_v2", "cuLaunchKernel"]
    # Switched off at the exit of the call that took the lease, not again.
    assert cupti.enabled == [1, 0]
    # Off once the block is over: nothing more is taken.
    user()
    assert log.count("acquire") == 1


def test_leasing_switches_the_domain_off_once_the_lease_is_held() -> None:
    """After the grant, later driver calls reach no callback (no per-call cost)."""
    cupti = FakeCupti()
    watch = DriverWatch(cupti)
    seen: list[str] = []
    original = watch._callback

    def counting(userdata: Any, domain: Any, callback_id: Any, cbdata: Any) -> None:
        seen.append(cbdata.function_name)
        original(userdata, domain, callback_id, cbdata)

    cupti.callback = counting
    with watch.leasing(lambda: None):
        assert cupti.enabled == [1]
        uploaded(cupti, "cuMemAlloc_v2", "cuLaunchKernel", "cuLaunchKernel")()
        assert cupti.enabled == [1, 0]
    assert cupti.enabled == [1, 0]
    # The first device call's entry and exit only: off at its exit.
    assert seen == ["cuMemAlloc_v2", "cuMemAlloc_v2"]
    assert not watch.switch_off_refused


def test_leasing_when_cupti_refuses_the_switch_off() -> None:
    """The lease is still taken once; the domain goes off when the block ends."""
    cupti = FakeCupti()
    watch = DriverWatch(cupti)
    enable = cupti.enable_domain

    def refusing(enable_: int, subscriber: int, domain: int) -> None:
        if not enable_ and cupti.inside:
            raise RuntimeError("CUPTI_ERROR_NOT_SUPPORTED")
        enable(enable_, subscriber, domain)

    cupti.enable_domain = refusing  # type: ignore[method-assign]
    taken: list[int] = []
    with watch.leasing(lambda: taken.append(1)):
        uploaded(cupti, "cuMemAlloc_v2", "cuLaunchKernel")()
        assert cupti.enabled == [1]
    assert taken == [1] and cupti.enabled == [1, 0]
    assert watch.switch_off_refused


def test_leasing_without_device_calls_takes_nothing() -> None:
    cupti = FakeCupti()
    watch = DriverWatch(cupti)
    taken: list[int] = []
    with watch.leasing(lambda: taken.append(1)):
        uploaded(cupti, "cuInit", "cuDeviceGetCount")()
    assert taken == []


def test_leasing_other_threads_wait_for_the_grant() -> None:
    """A second thread's device call waits until the first caller holds the lease."""
    import threading

    cupti = FakeCupti()
    watch = DriverWatch(cupti)
    release = threading.Event()
    order: list[str] = []

    def acquire() -> None:
        order.append("acquiring")
        release.wait(5)
        order.append("granted")

    with watch.leasing(acquire):
        first = threading.Thread(target=cupti.driver_call, args=("cuMemAlloc_v2",))
        first.start()
        while not order:
            pass
        second = threading.Thread(
            target=lambda: (cupti.driver_call("cuLaunchKernel"), order.append("second ran"))
        )
        second.start()
        second.join(0.2)
        assert order == ["acquiring"]
        release.set()
        first.join(5)
        second.join(5)
    assert order == ["acquiring", "granted", "second ran"]
