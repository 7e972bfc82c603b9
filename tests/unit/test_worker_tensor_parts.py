"""
A GPU worker's returned tensors, on a machine without a GPU: PyCUDA's
driver and GPUArray are stood in for, so the device-to-shared-buffer path
(kcoral.worker.gpu._shared_parts) runs its real code around them.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import numpy as np
import pytest

from kcoral.wire import shared
from kcoral.worker import gpu

pytestmark = pytest.mark.skipif(not shared.available(), reason="no sealed memfds here")

#: "Device memory": pointer -> bytes.
DEVICE: dict[int, bytes] = {}


class FakeGPUArray:
    def __init__(self, host: np.ndarray, pointer: int, contiguous: bool = True) -> None:
        DEVICE[pointer] = host.tobytes()
        self.gpudata = pointer
        self.dtype = host.dtype
        self.shape = host.shape
        self.size = host.size
        self.flags = types.SimpleNamespace(c_contiguous=contiguous)


@pytest.fixture
def fake_pycuda(monkeypatch: pytest.MonkeyPatch) -> Any:
    driver = types.ModuleType("pycuda.driver")

    def memcpy_dtoh(dest: Any, pointer: int) -> None:
        view = memoryview(dest).cast("B")
        assert not view.readonly
        data = DEVICE[pointer]
        assert len(data) == view.nbytes
        view[:] = data

    driver.memcpy_dtoh = memcpy_dtoh  # type: ignore[attr-defined]
    gpuarray = types.ModuleType("pycuda.gpuarray")
    gpuarray.GPUArray = FakeGPUArray  # type: ignore[attr-defined]
    package = types.ModuleType("pycuda")
    package.driver = driver  # type: ignore[attr-defined]
    package.gpuarray = gpuarray  # type: ignore[attr-defined]
    for name, module in [
        ("pycuda", package),
        ("pycuda.driver", driver),
        ("pycuda.gpuarray", gpuarray),
    ]:
        monkeypatch.setitem(sys.modules, name, module)
    return driver


def test_large_array_goes_straight_into_a_shared_buffer(fake_pycuda: Any) -> None:
    host = np.random.default_rng(0).standard_normal((256, 128), dtype=np.float32)
    name, shape, data = gpu._shared_parts(FakeGPUArray(host, 1), "float32")  # type: ignore[misc]
    assert (name, shape) == ("float32", (256, 128))
    assert isinstance(data, shared.SharedBuffer)
    assert data.tobytes() == host.tobytes()
    with pytest.raises(PermissionError):
        os.pwrite(data.fileno(), b"x", 0)


def test_small_or_strided_arrays_take_the_host_path(fake_pycuda: Any) -> None:
    small = np.zeros(16, dtype=np.float32)
    assert gpu._shared_parts(FakeGPUArray(small, 2), "float32") is None
    big = np.zeros(1 << 16, dtype=np.float32)
    assert gpu._shared_parts(FakeGPUArray(big, 3, contiguous=False), "float32") is None
    assert gpu._shared_parts(big, "float32") is None


def test_a_failed_copy_falls_back(fake_pycuda: Any) -> None:
    def broken(dest: Any, pointer: int) -> None:
        raise RuntimeError("cuMemcpyDtoH failed")

    fake_pycuda.memcpy_dtoh = broken
    before = len(os.listdir("/proc/self/fd"))
    big = np.zeros(1 << 16, dtype=np.float32)
    assert gpu._shared_parts(FakeGPUArray(big, 4), "float32") is None
    assert len(os.listdir("/proc/self/fd")) == before
