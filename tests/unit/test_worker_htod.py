"""
A GPU worker's host-to-device copy of a large shared-buffer mapping is
page-locked for the copy (kcoral.worker.gpu._copy_htod), on a machine
without a GPU: the driver library and PyCUDA's copy are stood in for.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kcoral.ipc import shared
from kcoral.testing.fakes import FakeCudaLibrary
from kcoral.worker import gpu

pytestmark = pytest.mark.skipif(not shared.available(), reason="no sealed memfds here")


class FakeDriver:
    def __init__(self, fail: bool = False) -> None:
        self.copied: list[bytes] = []
        self.fail = fail

    def memcpy_htod(self, destination: Any, view: memoryview) -> None:
        if self.fail:
            raise RuntimeError("cuMemcpyHtoD failed")
        self.copied.append(bytes(view))


@pytest.fixture
def library(monkeypatch: pytest.MonkeyPatch) -> FakeCudaLibrary:
    fake = FakeCudaLibrary()
    monkeypatch.setattr(gpu, "_libcuda", fake)
    return fake


def mapping(size: int) -> tuple[bytes, memoryview]:
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
    return data, memoryview(shared.share(data).map()).cast("B")


def test_large_mapping_page_locked_for_the_copy(library: FakeCudaLibrary) -> None:
    data, view = mapping(gpu.REGISTER_HOST_BYTES)
    driver = FakeDriver()
    gpu._copy_htod(driver, 1, view)
    assert driver.copied == [data]
    pointer = np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0]
    assert library.calls == [
        ("register", pointer, len(data), gpu.CU_MEMHOSTREGISTER_READ_ONLY),
        ("unregister", pointer),
    ]


def test_refused_registration_copies_pageable(library: FakeCudaLibrary) -> None:
    library.status = 1  # CUDA_ERROR_INVALID_VALUE, say
    data, view = mapping(gpu.REGISTER_HOST_BYTES)
    driver = FakeDriver()
    gpu._copy_htod(driver, 1, view)
    assert driver.copied == [data]
    assert [call[0] for call in library.calls] == ["register"]


def test_small_or_private_buffers_are_not_registered(library: FakeCudaLibrary) -> None:
    driver = FakeDriver()
    _, small = mapping(gpu.REGISTER_HOST_BYTES - 1)
    gpu._copy_htod(driver, 1, small)
    gpu._copy_htod(driver, 1, memoryview(bytes(gpu.REGISTER_HOST_BYTES)))
    assert len(driver.copied) == 2
    assert library.calls == []


def test_unregistered_after_a_failed_copy(library: FakeCudaLibrary) -> None:
    _, view = mapping(gpu.REGISTER_HOST_BYTES)
    with pytest.raises(RuntimeError):
        gpu._copy_htod(FakeDriver(fail=True), 1, view)
    assert [call[0] for call in library.calls] == ["register", "unregister"]
