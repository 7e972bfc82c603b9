"""
A GPU worker copies a large returned device tensor straight into a sealed
shared buffer whose mapping is page-locked for the copy
(kcoral.worker.gpu.copy_dtoh_shared), on a machine without a GPU: the
driver library and PyCUDA's copy are stood in for.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np
import pytest

from kcoral.ipc import shared
from kcoral.testing.descriptors import memfd_count, no_collection
from kcoral.testing.fakes import FakeCudaLibrary
from kcoral.wire.values import PartCollector
from kcoral.worker import gpu

pytestmark = pytest.mark.skipif(not shared.available(), reason="no sealed memfds here")


class FakeDriver:
    """PyCUDA's memcpy_dtoh, from a dict of "device" byte strings by address."""

    def __init__(self, memory: dict[int, bytes], fail: bool = False) -> None:
        self.memory = memory
        self.fail = fail
        self.copies = 0

    def memcpy_dtoh(self, destination: np.ndarray, source: int) -> None:
        self.copies += 1
        if self.fail:
            raise RuntimeError("cuMemcpyDtoH failed: an illegal memory access")
        data = self.memory[source]
        destination[:] = np.frombuffer(data, dtype=np.uint8)


@pytest.fixture
def library(monkeypatch: pytest.MonkeyPatch) -> FakeCudaLibrary:
    fake = FakeCudaLibrary()
    monkeypatch.setattr(gpu, "_libcuda", fake)
    monkeypatch.setattr(gpu, "_dtoh_refused", None)
    monkeypatch.setattr(gpu, "_notices", [])
    return fake


def device_bytes(size: int) -> bytes:
    return np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8).tobytes()


def test_copied_into_a_sealed_buffer_page_locked_for_the_copy(library: FakeCudaLibrary) -> None:
    data = device_bytes(gpu.REGISTER_HOST_BYTES)
    driver = FakeDriver({0x7000: data})
    buffer = gpu.copy_dtoh_shared(driver, 0x7000, len(data))
    assert buffer is not None
    assert buffer.tobytes() == data
    # Sealed as any shared part: the parent adopts it.
    shared.adopt(os.dup(buffer.fileno()), len(data)).close()
    assert [call[0] for call in library.calls] == ["register", "unregister"]
    register, unregister = library.calls
    assert register[2:] == (len(data), gpu.CU_MEMHOSTREGISTER_DEFAULT)
    assert unregister[1] == register[1]
    assert driver.copies == 1


def test_refused_registration_falls_back_and_is_noted_once(library: FakeCudaLibrary) -> None:
    library.status = 201  # CUDA_ERROR_INVALID_CONTEXT, say
    data = device_bytes(gpu.REGISTER_HOST_BYTES)
    driver = FakeDriver({1: data})
    with no_collection():
        before = memfd_count()
        assert gpu.copy_dtoh_shared(driver, 1, len(data)) is None
        assert memfd_count() == before  # the unused buffer is freed
    assert driver.copies == 0
    # Not tried again in this worker; one notice for its log.
    assert gpu.copy_dtoh_shared(driver, 1, len(data)) is None
    assert [call[0] for call in library.calls] == ["register"]
    backend = object.__new__(gpu.GpuBackend)
    notices = backend.take_notices()
    assert len(notices) == 1 and "cuMemHostRegister returned 201" in notices[0]
    assert backend.take_notices() == []


def test_failed_copy_raises_after_unregistering(library: FakeCudaLibrary) -> None:
    data = device_bytes(gpu.REGISTER_HOST_BYTES)
    with no_collection():
        before = memfd_count()
        with pytest.raises(RuntimeError, match="illegal memory access"):
            gpu.copy_dtoh_shared(FakeDriver({1: data}, fail=True), 1, len(data))
        assert [call[0] for call in library.calls] == ["register", "unregister"]
        assert memfd_count() == before
    assert gpu._dtoh_refused is None  # a copy error is the program's, not the path's


def test_part_collector_keeps_the_buffer_and_hashes_it(library: FakeCudaLibrary) -> None:
    data = device_bytes(gpu.REGISTER_HOST_BYTES)
    buffer = gpu.copy_dtoh_shared(FakeDriver({1: data}), 1, len(data))
    assert buffer is not None
    parts = PartCollector(shared.PARTS)
    name, digest = parts.add(buffer)
    assert (name, digest) == ("return:0", hashlib.sha256(data).hexdigest())
    assert parts.parts == [buffer] and parts.total_bytes == len(data)
    # Without shared parts (inline frames) the bytes are copied out.
    inline = PartCollector()
    assert inline.add(buffer)[1] == digest
    assert inline.parts == [data]


class StagingDriver(FakeDriver):
    def __init__(self, memory: dict[int, bytes], refuse: bool = False) -> None:
        super().__init__(memory)
        self.refuse = refuse
        self.allocated: list[int] = []

    def pagelocked_empty(self, size: int, dtype: Any) -> np.ndarray:
        if self.refuse:
            raise MemoryError("cuMemHostAlloc failed: out of memory")
        self.allocated.append(size)
        return np.empty(size, dtype)


def test_staging_regions_then_reused(library: FakeCudaLibrary) -> None:
    """
    Each tensor of a return gets its own region (views stay valid together);
    after release the buffer is reused, grown only when a return needs more.
    """
    small, large = device_bytes(gpu.REGISTER_HOST_BYTES), device_bytes(2 * gpu.REGISTER_HOST_BYTES)
    driver = StagingDriver({1: small, 2: large})
    staging = gpu.Staging()
    first, second = staging.copy(driver, 1, len(small)), staging.copy(driver, 2, len(large))
    assert first is not None and second is not None
    assert (bytes(first), bytes(second)) == (small, large)
    assert driver.allocated == [len(small), len(small) + len(large)]
    staging.release()
    again = staging.copy(driver, 2, len(large))
    assert again is not None and bytes(again) == large
    assert len(driver.allocated) == 2  # kept
    assert library.calls == []  # nothing registered per return


def test_staging_declines_past_its_limit(
    library: FakeCudaLibrary, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu, "STAGING_MAX_BYTES", gpu.REGISTER_HOST_BYTES)
    data = device_bytes(gpu.REGISTER_HOST_BYTES)
    driver = StagingDriver({1: data})
    staging = gpu.Staging()
    assert staging.copy(driver, 1, len(data)) is not None
    assert staging.copy(driver, 1, len(data)) is None  # this return's regions are full
    assert gpu._dtoh_refused is None


def test_staging_refused_falls_back(library: FakeCudaLibrary) -> None:
    data = device_bytes(gpu.REGISTER_HOST_BYTES)
    assert gpu.Staging().copy(StagingDriver({1: data}, refuse=True), 1, len(data)) is None
    assert "pagelocked_empty" in (gpu._dtoh_refused or "")


@pytest.mark.parametrize(
    ("how", "registered", "staged"),
    [("registered", 1, 0), ("staging", 0, 1), ("pageable", 0, 0), ("bogus", 0, 1), (None, 0, 1)],
)
def test_backend_picks_the_copy_from_the_environment(
    library: FakeCudaLibrary,
    monkeypatch: pytest.MonkeyPatch,
    how: str | None,
    registered: int,
    staged: int,
) -> None:
    """KCORAL_DTOH_COPY picks the way (staging unless it names another); small tensors never."""
    if how is None:
        monkeypatch.delenv(gpu.DTOH_COPY_ENV, raising=False)
    else:
        monkeypatch.setenv(gpu.DTOH_COPY_ENV, how)
    data = device_bytes(gpu.REGISTER_HOST_BYTES)
    backend = object.__new__(gpu.GpuBackend)
    backend._drv = StagingDriver({9: data})
    backend._torch = None
    backend.ordinal = 0
    backend._dtoh_copy = gpu._dtoh_copy()
    backend._staging = gpu.Staging()
    array = np.frombuffer(data, dtype=np.uint8)
    sources = {id(array): (9, len(data))}
    monkeypatch.setattr(gpu, "_device_source", lambda value, torch, ordinal: sources.get(id(value)))
    name, shape, part = backend.tensor_parts(array)
    assert (name, shape) == ("uint8", (len(data),))
    assert isinstance(part, shared.SharedBuffer) == bool(registered)
    assert (part.tobytes() if isinstance(part, shared.SharedBuffer) else bytes(part)) == data
    if staged:  # a view of the staging buffer, not of the program's array
        assert part.obj is not array and np.shares_memory(part.obj, backend._staging.buffer)
    backend.returned()
    assert backend._staging.used == 0
    assert sum(call[0] == "register" for call in library.calls) == registered
    assert len(backend._drv.allocated) == staged
    small = np.zeros(16, np.uint8)
    sources[id(small)] = (9, 16)
    assert isinstance(backend.tensor_parts(small)[2], memoryview)


def test_staging_past_its_limit_registers(
    library: FakeCudaLibrary, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A return larger than STAGING_MAX_BYTES is registered instead (no pinned buffer that big)."""
    monkeypatch.delenv(gpu.DTOH_COPY_ENV, raising=False)
    monkeypatch.setattr(gpu, "STAGING_MAX_BYTES", gpu.REGISTER_HOST_BYTES)
    data = device_bytes(gpu.REGISTER_HOST_BYTES + 4096)
    backend = object.__new__(gpu.GpuBackend)
    backend._drv = StagingDriver({9: data})
    backend._torch = None
    backend.ordinal = 0
    backend._dtoh_copy = gpu._dtoh_copy()
    backend._staging = gpu.Staging()
    monkeypatch.setattr(gpu, "_device_source", lambda value, torch, ordinal: (9, len(data)))
    part = backend.tensor_parts(np.frombuffer(data, dtype=np.uint8))[2]
    assert isinstance(part, shared.SharedBuffer) and part.tobytes() == data
    assert backend._drv.allocated == []
    assert [call[0] for call in library.calls] == ["register", "unregister"]
