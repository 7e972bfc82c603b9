"""
Tests for L{kcoral.worker.gpuwatch}: CUDA entry points are trapped inside a
cpu_only run and restored afterwards.  A stand-in C{pycuda.driver} module
plays PyCUDA, so this runs without a GPU.
"""

from __future__ import annotations

import sys
import types

import pytest

from kcoral.errors import GPUAccessViolation
from kcoral.worker.gpuwatch import cpu_only_watch


@pytest.fixture
def fake_driver(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    driver = types.ModuleType("pycuda.driver")

    def mem_alloc(size: int) -> str:
        return f"allocated {size}"

    class Function:
        def __call__(self, *args: object) -> str:
            return "launched"

    driver.mem_alloc = mem_alloc  # type: ignore[attr-defined]
    driver.get_version = lambda: (13, 0, 0)  # type: ignore[attr-defined]
    driver.Function = Function  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pycuda.driver", driver)
    return driver


def test_driver_call_is_trapped_with_location(fake_driver: types.ModuleType) -> None:
    """A driver call inside the watch raises gpu_access naming the call and the caller."""
    code = compile("def user():\n    return driver.mem_alloc(4)\n", "<uploaded:abc>", "exec")
    namespace = {"driver": fake_driver}
    exec(code, namespace)
    with cpu_only_watch(), pytest.raises(GPUAccessViolation) as caught:
        namespace["user"]()
    error = caught.value
    assert error.kind == "gpu_access"
    assert error.cuda_call == "pycuda.driver.mem_alloc"
    assert error.location == "<uploaded:abc>:2 in user"
    assert "Traceback" in error.call_stack


def test_kernel_launch_is_trapped(fake_driver: types.ModuleType) -> None:
    """Launching a kernel through Function.__call__ is trapped too."""
    kernel = fake_driver.Function()
    with cpu_only_watch(), pytest.raises(GPUAccessViolation):
        kernel()


def test_everything_is_restored(fake_driver: types.ModuleType) -> None:
    """After the watch the original functions work again, also after a violation."""
    with cpu_only_watch(), pytest.raises(GPUAccessViolation):
        fake_driver.mem_alloc(1)
    assert fake_driver.mem_alloc(4) == "allocated 4"
    assert fake_driver.Function()() == "launched"


def test_harmless_calls_pass(fake_driver: types.ModuleType) -> None:
    """Version queries do not touch the device and stay callable."""
    with cpu_only_watch():
        assert fake_driver.get_version() == (13, 0, 0)
