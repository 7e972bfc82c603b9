"""
Tests for L{kcoral.wire.hashbehind} and the streamed blobs that use it: a
large blob's SHA-256 is finished by a thread that reads back the memfd,
and the digest is the same as hashing every byte on the reactor.
"""

from __future__ import annotations

import hashlib
import os
import random
import threading

import pytest

from kcoral.testing.live_server import multipart_body
from kcoral.wire import multipart, shared
from kcoral.wire.hashbehind import HashBehind
from kcoral.wire.multipart import StreamedBody
from kcoral.wire.program import ValidationError

pytestmark = pytest.mark.skipif(not shared.available(), reason="no sealed memfds here")


def _payload(size: int) -> bytes:
    return random.Random(size).randbytes(size)


def _write_in_pieces(data: bytes) -> tuple[shared.SharedWriter, HashBehind, int]:
    writer = shared.SharedWriter("test")
    head = len(data) // 3
    hasher = hashlib.sha256(data[:head])
    writer.write(data[:head])
    behind = HashBehind(hasher, writer.fileno(), head)
    position = head
    pieces = random.Random(7)
    while position < len(data):
        piece = data[position : position + pieces.randint(1, 1 << 20)]
        writer.write(piece)
        position += len(piece)
        behind.advance(position)
    return writer, behind, position


def test_follows_the_writer() -> None:
    data = _payload(9 << 20)
    writer, behind, _ = _write_in_pieces(data)
    assert behind.hexdigest() == hashlib.sha256(data).hexdigest()
    writer.discard()


def test_digest_after_the_writer_sealed_and_closed() -> None:
    """The thread reads through its own descriptor: sealing and closing the writer's is fine."""
    data = _payload(6 << 20)
    writer, behind, _ = _write_in_pieces(data)
    buffer = writer.seal()
    buffer.close()
    assert behind.hexdigest() == hashlib.sha256(data).hexdigest()


def test_cancel_ends_the_thread_and_closes_its_descriptor() -> None:
    writer = shared.SharedWriter("test")
    writer.write(b"x" * 1000)
    before = set(os.listdir("/proc/self/fd"))
    behind = HashBehind(hashlib.sha256(b"x" * 1000), writer.fileno(), 1000)
    behind.cancel()
    behind._thread.join(5)
    assert not behind._thread.is_alive()
    assert set(os.listdir("/proc/self/fd")) <= before
    writer.discard()


def test_a_short_file_is_an_error() -> None:
    """Told of bytes that are not there (never by our writer): an error, not a hang."""
    writer = shared.SharedWriter("test")
    writer.write(b"abc")
    behind = HashBehind(hashlib.sha256(), writer.fileno(), 0)
    behind.advance(10)
    with pytest.raises(OSError, match="ended before"):
        behind.hexdigest()
    writer.discard()


@pytest.mark.parametrize("size", [100, (4 << 20) - 1, 4 << 20, (12 << 20) + 5])
def test_streamed_blob_digest_either_side_of_the_hand_over(size: int) -> None:
    data = _payload(size)
    content_type, body = multipart_body({"instructions": []}, [data])
    streamed = StreamedBody.for_content_type(content_type, max_bytes=1 << 30)
    assert streamed is not None
    chunks = random.Random(size)
    position = 0
    while position < len(body):
        step = chunks.randint(1, 3 << 20)
        streamed.feed(body[position : position + step])
        position += step
    parsed = streamed.result()
    (blob,) = parsed.blobs.values()
    assert blob.digest == hashlib.sha256(data).hexdigest()
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


def test_aborted_body_stops_the_hash_thread() -> None:
    data = _payload(8 << 20)
    content_type, body = multipart_body({"instructions": []}, [data])
    streamed = StreamedBody.for_content_type(content_type, max_bytes=1 << 30)
    assert streamed is not None
    streamed.feed(body[: len(body) * 3 // 4])
    threads = [t for t in threading.enumerate() if t.name == "kcoral-hash-behind"]
    assert threads
    streamed.abort()
    for thread in threads:
        thread.join(5)
        assert not thread.is_alive()


def test_hand_over_size() -> None:
    assert multipart.HASH_BEHIND_BYTES == 4 << 20
