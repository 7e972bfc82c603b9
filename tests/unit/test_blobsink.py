"""
Tests for L{kcoral.ipc.blobsink} and the streamed blobs that use it: past
a few megabytes a blob's memfd writes and SHA-256 run on two threads, and
the buffer and the digest are the same as doing both on the reactor.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import random
import threading
from collections.abc import Callable
from typing import Any

import pytest

from kcoral.ipc import blobsink, shared, uploads
from kcoral.ipc.blobsink import BlobSink
from kcoral.ipc.uploads import StreamedBody
from kcoral.testing.live_server import multipart_body
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


def test_many_small_chunks() -> None:
    """More chunks than one writev takes, in pieces the hash waits to gather."""
    data = _payload(3 << 20)
    writer = shared.SharedWriter("test")
    sink = BlobSink(hashlib.sha256(), writer.fileno())
    step = 5000
    for offset in range(0, len(data), step):
        sink.put(memoryview(data)[offset : offset + step])
    assert sink.queued == len(data)
    assert sink.finish() == hashlib.sha256(data).hexdigest()
    buffer = writer.seal()
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
    # Nothing is held back for a failed sink.
    called: list[int] = []
    sink.notify_at(0, lambda: called.append(1))
    assert called == [1]
    writer.discard()


def test_backlog_and_notify_at() -> None:
    """The backlog is what is not hashed yet; the callback comes when it drops."""
    gate = _Gate()
    writer = shared.SharedWriter("test")
    sink = BlobSink(gate, writer.fileno())
    piece = 2 << 20
    for _ in range(3):
        sink.put(b"y" * piece)
    assert sink.backlog == 3 * piece
    drained = threading.Event()
    sink.notify_at(piece, drained.set)
    assert not drained.wait(0.05)
    gate.open.set()
    assert drained.wait(10)
    assert sink.backlog <= piece
    assert sink.finish() == hashlib.sha256(b"y" * 3 * piece).hexdigest()
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


@pytest.mark.parametrize("size", [100, (1 << 20) - 1, 1 << 20, (12 << 20) + 5])
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
    assert uploads.OFFLOAD_BYTES == 1 << 20


def test_received_chunks_are_queued_without_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    Inside a large blob, a chunk with no delimiter in it reaches the sink
    as a view of the received bytes object itself (the scanner's direct
    path); the digest and the buffer are still right.
    """
    queued: list[bytes | memoryview] = []
    put = BlobSink.put

    def spy(sink: BlobSink, chunk: bytes | memoryview) -> None:
        queued.append(chunk)
        put(sink, chunk)

    monkeypatch.setattr(BlobSink, "put", spy)
    data = _payload(10 << 20)
    content_type, body = multipart_body({"instructions": []}, [data])
    streamed = StreamedBody.for_content_type(content_type, max_bytes=1 << 30)
    assert streamed is not None
    received = [body[i : i + (256 << 10)] for i in range(0, len(body), 256 << 10)]
    for chunk in received:
        streamed.feed(chunk)
    parsed = streamed.result()
    (blob,) = parsed.blobs.values()
    assert blob.digest == hashlib.sha256(data).hexdigest()
    assert blob.read() == data
    parsed.close()
    views = [c for c in queued if isinstance(c, memoryview)]
    copied = [c for c in queued if not isinstance(c, memoryview)]
    # Copied: the few bytes kept from one chunk to the next (they could
    # have begun a delimiter), and the blob's last piece.
    assert sum(map(len, copied)) < 256 << 10
    assert sum(map(len, views)) > len(data) - uploads.OFFLOAD_BYTES - (1 << 20)
    ids = {id(chunk) for chunk in received}
    assert all(id(view.obj) in ids for view in views)


def hold_hashing(patch: Callable[[Any, str, Any], None]) -> threading.Event:
    """
    Hold every sink's hash thread until the returned event is set; C{patch}
    is pytest's C{monkeypatch.setattr} or trial's C{TestCase.patch}.
    """
    gate = threading.Event()
    hash_range = BlobSink._hash_range

    def gated(sink: BlobSink, start: int, end: int) -> None:
        assert gate.wait(10)
        hash_range(sink, start, end)

    patch(BlobSink, "_hash_range", gated)
    return gate


def _multipart(parts: list[tuple[str, bytes]]) -> tuple[str, bytes]:
    boundary = "b0undary0123456789"
    out = []
    for name, content in parts:
        kind = "application/json" if name == "program" else "application/octet-stream"
        out.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n'
            f"Content-Type: {kind}\r\n\r\n".encode()
            + content
            + b"\r\n"
        )
    out.append(f"--{boundary}--\r\n".encode())
    return f"multipart/form-data; boundary={boundary}", b"".join(out)


def test_a_large_blob_settles_after_its_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    The part's end does not wait for the threads: the rest of the body is
    read meanwhile, and result() (on a pool thread in the server) collects
    the blob once they are done.
    """
    gate = hold_hashing(monkeypatch.setattr)
    large, small = _payload(6 << 20), b"tail"
    content_type, body = multipart_body({"instructions": []}, [large, small])
    streamed = _stream(body, content_type, 11)
    assert streamed.settling
    gate.set()
    parsed = streamed.result()
    assert not streamed.settling
    assert {d: b.read() for d, b in parsed.blobs.items()} == {
        hashlib.sha256(large).hexdigest(): large,
        hashlib.sha256(small).hexdigest(): small,
    }
    parsed.close()


def test_errors_keep_part_order_with_a_settling_blob() -> None:
    """
    A large blob's digest is checked only after the parts behind it were
    read; its mismatch is still the error reported when it came first, as
    the reference reports the earliest part's error.
    """
    large = _payload(5 << 20)
    program = (b'{"instructions":[]}',)
    wrong = "0" * 64
    content_type, body = _multipart(
        [("program", *program), (f"blob:{wrong}", large), ("unknown", b"x")]
    )
    with pytest.raises(ValidationError, match="blob hash mismatch"):
        _stream(body, content_type, 1).result()
    content_type, body = _multipart(
        [("program", *program), ("unknown", b"x"), (f"blob:{wrong}", large)]
    )
    with pytest.raises(ValidationError, match="unsupported multipart part"):
        _stream(body, content_type, 2).result()
    right = hashlib.sha256(large).hexdigest()
    content_type, body = _multipart(
        [("program", *program), (f"blob:{right}", large), (f"blob:{right}", large)]
    )
    with pytest.raises(ValidationError, match="duplicate blob part"):
        _stream(body, content_type, 3).result()


def test_abort_while_the_result_settles(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    The client leaves while a pool thread waits for the blob threads: the
    abort does not wait, and the thread drops what it collected.
    """
    gate = hold_hashing(monkeypatch.setattr)
    content_type, body = multipart_body({"instructions": []}, [_payload(6 << 20)])
    before = set(os.listdir("/proc/self/fd"))
    streamed = _stream(body, content_type, 5)
    assert set(os.listdir("/proc/self/fd")) > before
    outcome: list[BaseException | object] = []

    def settle() -> None:
        try:
            outcome.append(streamed.result())
        except BaseException as e:
            outcome.append(e)

    pool_thread = threading.Thread(target=settle)
    pool_thread.start()
    while not streamed._closing.locked():
        pass
    streamed.abort()  # returns at once although result() holds the lock
    gate.set()
    pool_thread.join(10)
    (error,) = outcome
    assert isinstance(error, ValidationError) and "aborted" in str(error)
    for thread in _sink_threads():
        thread.join(5)
    assert set(os.listdir("/proc/self/fd")) <= before
