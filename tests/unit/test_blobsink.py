"""
Tests for L{kcoral.wire.blobsink} and the streamed blobs that use it: past
a few megabytes a blob's memfd writes and SHA-256 run on two threads, and
the buffer and the digest are the same as doing both on the reactor.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import random
import threading
from typing import Any

import pytest

from kcoral.testing.live_server import multipart_body
from kcoral.wire import blobsink, multipart, shared
from kcoral.wire.blobsink import BlobSink
from kcoral.wire.multipart import StreamedBody
from kcoral.wire.program import ValidationError

pytestmark = pytest.mark.skipif(not shared.available(), reason="no sealed memfds here")


def _payload(size: int) -> bytes:
    return random.Random(size).randbytes(size)


def _put_in_pieces(sink: BlobSink, data: bytes) -> None:
    pieces = random.Random(7)
    position = 0
    while position < len(data):
        piece = data[position : position + pieces.randint(1, 1 << 20)]
        sink.put(piece)
        position += len(piece)


def _sink_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kcoral-blob-")]


class _Gate:
    """A hasher whose C{update} waits for the test to open the gate."""

    def __init__(self) -> None:
        self.inner = hashlib.sha256()
        self.open = threading.Event()

    def update(self, data: bytes) -> None:
        assert self.open.wait(10)
        self.inner.update(data)

    def hexdigest(self) -> str:
        return self.inner.hexdigest()


def test_writes_and_hashes_in_order() -> None:
    data = _payload(9 << 20)
    head = len(data) // 3
    writer = shared.SharedWriter("test")
    writer.write(data[:head])
    sink = BlobSink(hashlib.sha256(data[:head]), writer.fileno())
    _put_in_pieces(sink, data[head:])
    assert sink.finish() == hashlib.sha256(data).hexdigest()
    buffer = writer.seal()
    assert len(buffer) == len(data)
    assert buffer.tobytes() == data
    buffer.close()


def test_the_owner_may_close_its_descriptor_first() -> None:
    """The write thread has a descriptor of its own."""
    data = _payload(3 << 20)
    fd = os.memfd_create("test")
    sink = BlobSink(hashlib.sha256(), fd)
    os.close(fd)
    sink.put(data)
    assert sink.finish() == hashlib.sha256(data).hexdigest()


def test_cancel_stops_both_threads_and_closes_the_descriptor() -> None:
    before = set(os.listdir("/proc/self/fd"))
    writer = shared.SharedWriter("test")
    gate = _Gate()
    sink = BlobSink(gate, writer.fileno())
    sink.put(b"x" * 1000)
    called = threading.Event()
    sink.notify_at(0, called.set)
    assert not called.is_set()
    sink.cancel()
    # The waiting callback is called at once: nothing is held back any more.
    assert called.is_set()
    gate.open.set()
    for thread in sink._threads:
        thread.join(5)
        assert not thread.is_alive()
    writer.discard()
    assert set(os.listdir("/proc/self/fd")) <= before


def test_a_failed_write_is_raised_by_finish() -> None:
    """A memfd sealed against writes: the write thread's error is not lost."""
    writer = shared.SharedWriter("test")
    fcntl.fcntl(writer.fileno(), fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
    sink = BlobSink(hashlib.sha256(), writer.fileno())
    sink.put(b"abc")
    sink.put(b"def")
    with pytest.raises(PermissionError):
        sink.finish()
    assert sink.backlog == 0
    writer.discard()


def test_backlog_and_notify_at() -> None:
    """The backlog is what either thread has not done; the callback comes when it drops."""
    gate = _Gate()
    writer = shared.SharedWriter("test")
    sink = BlobSink(gate, writer.fileno())
    for _ in range(4):
        sink.put(b"y" * 1000)
    assert sink.backlog == 4000
    drained = threading.Event()
    sink.notify_at(1000, drained.set)
    assert not drained.wait(0.05)
    gate.open.set()
    assert drained.wait(10)
    assert sink.backlog <= 1000
    assert sink.finish() == hashlib.sha256(b"y" * 4000).hexdigest()
    now: list[str] = []
    sink.notify_at(0, lambda: now.append(threading.current_thread().name))
    assert now == [threading.current_thread().name]
    writer.discard()


def test_put_after_finish_is_an_error() -> None:
    writer = shared.SharedWriter("test")
    sink = BlobSink(hashlib.sha256(), writer.fileno())
    sink.finish()
    with pytest.raises(ValueError, match="closed"):
        sink.put(b"late")
    writer.discard()


def test_live_sinks_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blobsink, "MAX_LIVE_SINKS", blobsink._live + 1)
    writer = shared.SharedWriter("test")
    first = BlobSink.start(hashlib.sha256(), writer.fileno())
    assert first is not None
    assert BlobSink.start(hashlib.sha256(), writer.fileno()) is None
    first.finish()
    again = BlobSink.start(hashlib.sha256(), writer.fileno())
    assert again is not None
    again.cancel()
    writer.discard()


def _stream(body: bytes, content_type: str, seed: int) -> StreamedBody:
    streamed = StreamedBody.for_content_type(content_type, max_bytes=1 << 30)
    assert streamed is not None
    chunks = random.Random(seed)
    position = 0
    while position < len(body):
        step = chunks.randint(1, 3 << 20)
        streamed.feed(body[position : position + step])
        position += step
    return streamed


@pytest.mark.parametrize("size", [100, (4 << 20) - 1, 4 << 20, (12 << 20) + 5])
def test_streamed_blob_either_side_of_the_hand_over(size: int) -> None:
    data = _payload(size)
    content_type, body = multipart_body({"instructions": []}, [data])
    parsed = _stream(body, content_type, size).result()
    (blob,) = parsed.blobs.values()
    assert blob.digest == hashlib.sha256(data).hexdigest()
    assert blob.size == size
    assert blob.read() == data
    parsed.close()


def test_streamed_blobs_when_no_sink_is_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the bound, a large blob is written and hashed by the caller: same result."""
    monkeypatch.setattr(blobsink, "MAX_LIVE_SINKS", 0)
    data = _payload(9 << 20)
    content_type, body = multipart_body({"instructions": []}, [data, b"small"])
    parsed = _stream(body, content_type, 3).result()
    blob = parsed.blobs[hashlib.sha256(data).hexdigest()]
    assert blob.read() == data
    parsed.close()


def test_large_blob_with_a_wrong_name_is_refused() -> None:
    data = _payload(6 << 20)
    content_type, body = multipart_body({"instructions": []}, [data])
    real = hashlib.sha256(data).hexdigest().encode()
    body = body.replace(real, b"0" * 64)
    streamed = StreamedBody.for_content_type(content_type, max_bytes=1 << 30)
    assert streamed is not None
    streamed.feed(body)
    with pytest.raises(ValidationError, match="blob hash mismatch"):
        streamed.result()


def test_aborted_body_stops_the_threads() -> None:
    data = _payload(8 << 20)
    content_type, body = multipart_body({"instructions": []}, [data])
    streamed = StreamedBody.for_content_type(content_type, max_bytes=1 << 30)
    assert streamed is not None
    streamed.feed(body[: len(body) * 3 // 4])
    threads = _sink_threads()
    assert {t.name for t in threads} == {"kcoral-blob-write", "kcoral-blob-hash"}
    assert streamed.backlog() >= 0
    streamed.abort()
    for thread in threads:
        thread.join(5)
        assert not thread.is_alive()
    # A failed body holds nothing back.
    assert streamed.backlog() == 0
    called: list[Any] = []
    streamed.when_drained(0, lambda: called.append(1))
    assert called == [1]


def test_hand_over_size() -> None:
    assert multipart.OFFLOAD_BYTES == 4 << 20
