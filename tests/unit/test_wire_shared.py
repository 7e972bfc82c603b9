"""Sealed shared buffers and their descriptors (kcoral.ipc.shared, the channel's use of them)."""

from __future__ import annotations

import errno
import io
import mmap
import os
import tempfile

import pytest

from kcoral.ipc import shared
from kcoral.ipc.channel_io import read_frame, read_message, take_shared, write_message
from kcoral.ipc.shared import (
    SharedMemoryError,
    adopt,
    drain_descriptors,
    receive_descriptors,
    send_descriptors,
    share,
    socket_pair,
)
from kcoral.testing.descriptors import memfd_count, no_collection
from kcoral.wire.channel import (
    Blob,
    ChannelError,
    Outcome,
    Returned,
    decode,
)

pytestmark = pytest.mark.skipif(not shared.available(), reason="no sealed memfds here")


def test_share_is_sealed_against_every_change() -> None:
    """No descriptor of a shared buffer can write, shrink, grow or map it writable."""
    buffer = share(b"abc" * 1000)
    fd = buffer.fileno()
    with pytest.raises(PermissionError):
        os.write(fd, b"x")
    with pytest.raises(PermissionError):
        os.pwrite(fd, b"x", 0)
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 1)
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 1 << 20)
    with pytest.raises(PermissionError):
        mmap.mmap(fd, len(buffer), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    # Reopened by path (as /proc/self/fd allows) it is still sealed.
    other = os.open(buffer.path(), os.O_RDWR)
    try:
        with pytest.raises(PermissionError):
            os.write(other, b"x")
    finally:
        os.close(other)
    assert buffer.tobytes() == b"abc" * 1000
    assert bytes(buffer.map()[:3]) == b"abc"


def test_buffer_closes_with_its_last_reference() -> None:
    with no_collection():
        before = memfd_count()
        buffer = share(b"x" * 10)
        assert memfd_count() == before + 1
        del buffer
        assert memfd_count() == before


def test_read_chunks() -> None:
    data = os.urandom(3 * 1000 + 7)
    buffer = share(data)
    assert b"".join(buffer.read_chunks(1000)) == data
    assert buffer.pread(3000, 100) == data[3000:]
    assert share(b"").tobytes() == b""


def test_adopt_checks_kind_seals_and_size() -> None:
    buffer = share(b"y" * 100)
    assert adopt(os.dup(buffer.fileno()), 100).tobytes() == b"y" * 100
    with pytest.raises(SharedMemoryError, match="declares 101"):
        adopt(os.dup(buffer.fileno()), 101)
    # An unsealed memfd: its sender could still change it.
    loose = os.memfd_create("loose", os.MFD_ALLOW_SEALING)
    os.write(loose, b"z")
    with pytest.raises(SharedMemoryError, match="not sealed"):
        adopt(loose, 1)
    # A regular file, a pipe: not sealed buffers at all.
    with tempfile.TemporaryFile() as f:
        f.write(b"z")
        f.flush()
        with pytest.raises(SharedMemoryError, match="not a sealed"):
            adopt(os.dup(f.fileno()), 1)
    read_end, write_end = os.pipe()
    os.close(write_end)
    with pytest.raises(SharedMemoryError, match="not a sealed"):
        adopt(read_end, 0)
    # Every refused descriptor was closed.
    for fd in (loose, read_end):
        with pytest.raises(OSError) as e:
            os.fstat(fd)
        assert e.value.errno == errno.EBADF


def test_descriptors_travel_one_message_at_a_time() -> None:
    ours, theirs = socket_pair()
    ours.setblocking(False)
    try:
        a, b = share(b"a" * 10), share(b"b" * 20)
        send_descriptors(theirs, [a.fileno()])
        send_descriptors(theirs, [b.fileno(), a.fileno()])
        (first,) = receive_descriptors(ours, 1)
        assert adopt(first, 10).tobytes() == b"a" * 10
        with pytest.raises(SharedMemoryError, match="expected 1 descriptors, received 2"):
            receive_descriptors(ours, 1)
        with pytest.raises(SharedMemoryError, match="not sent"):
            receive_descriptors(ours, 1)
    finally:
        ours.close()
        theirs.close()


def test_refused_descriptors_do_not_leak() -> None:
    ours, theirs = socket_pair()
    ours.setblocking(False)
    try:
        buffer = share(b"c")
        with no_collection():
            before = memfd_count()
            for _ in range(50):
                send_descriptors(theirs, [buffer.fileno()] * 5)
            for _ in range(25):
                with pytest.raises(SharedMemoryError):
                    receive_descriptors(ours, 2)
            theirs.send(b"junk")
            assert drain_descriptors(ours) == 26
            assert memfd_count() == before
    finally:
        ours.close()
        theirs.close()


def test_channel_message_with_shared_parts() -> None:
    """A return's large part crosses as a descriptor; small ones stay inline."""
    ours, theirs = socket_pair()
    big = share(b"B" * 100_000)
    stream = io.BytesIO()
    message = Returned("out", {"type": "bytes"}, (b"small", big, b"tail"))
    write_message(stream, message, theirs)
    assert message.header()["shared_parts"] == [1]
    stream.seek(0)
    received = read_message(stream, descriptors=ours)
    assert isinstance(received, Returned)
    small, shared_part, tail = received.parts
    assert (small, tail) == (b"small", b"tail")
    assert isinstance(shared_part, shared.SharedBuffer)
    assert shared_part.tobytes() == b"B" * 100_000
    ours.close()
    theirs.close()


def test_channel_blob_by_descriptor() -> None:
    ours, theirs = socket_pair()
    stream = io.BytesIO()
    write_message(stream, Blob("d" * 64, share(b"blob")), theirs)
    stream.seek(0)
    blob = read_message(stream, descriptors=ours)
    assert isinstance(blob, Blob)
    assert isinstance(blob.data, shared.SharedBuffer)
    assert blob.data.tobytes() == b"blob"
    ours.close()
    theirs.close()


def test_channel_refuses_descriptors_it_cannot_take() -> None:
    stream = io.BytesIO()
    ours, theirs = socket_pair()
    ours.setblocking(False)
    write_message(stream, Outcome("COMPLETED", parts=(share(b"x" * 10),)), theirs)
    stream.seek(0)
    frame = read_frame(stream)
    assert frame is not None
    with pytest.raises(ChannelError, match="does not pass"):
        decode(frame)
    with pytest.raises(ChannelError, match="over the limit of 9"):
        decode(frame, lambda sizes: take_shared(ours, sizes), max_shared_bytes=9)
    # The limit is checked before any descriptor is taken.
    assert drain_descriptors(ours) == 1
    # Descriptors named but never sent.
    with pytest.raises(ChannelError, match="not sent"):
        decode(frame, lambda sizes: take_shared(ours, sizes), max_shared_bytes=None)
    ours.close()
    theirs.close()


@pytest.mark.parametrize(
    "shared_parts",
    [[1], [0, 0], [-1], "0", [True], list(range(300))],
)
def test_channel_refuses_malformed_shared_parts(shared_parts: object) -> None:
    frame_header = {
        "type": "returned",
        "key": "k",
        "value": None,
        "part_sizes": [1],
        "shared_parts": shared_parts,
    }
    from kcoral.wire.channel import Frame

    with pytest.raises(ChannelError):
        decode(Frame(frame_header, b""), lambda n: [])


def test_more_parts_than_one_message_passes() -> None:
    """Past MAX_DESCRIPTORS shared parts in one message, the rest go inline."""
    ours, theirs = socket_pair()
    parts = tuple(share(bytes([i % 256]) * 10) for i in range(shared.MAX_DESCRIPTORS + 5))
    stream = io.BytesIO()
    write_message(stream, Outcome("COMPLETED", parts=parts), theirs)
    stream.seek(0)
    received = read_message(stream, descriptors=ours)
    assert isinstance(received, Outcome)
    kinds = [isinstance(part, shared.SharedBuffer) for part in received.parts]
    assert kinds == [True] * shared.MAX_DESCRIPTORS + [False] * 5
    assert [p if isinstance(p, bytes) else p.tobytes() for p in received.parts] == [
        p.tobytes() for p in parts
    ]
    ours.close()
    theirs.close()


def test_a_job_passes_at_most_max_shared_blobs() -> None:
    from kcoral.server.workers.job import MAX_SHARED_BLOBS, Job

    blobs = {f"{i:064x}": share(b"b" * 100) for i in range(MAX_SHARED_BLOBS + 6)}
    job = Job("r", "{}", None, blobs, 1.0, 100, 100)  # type: ignore[arg-type]
    sent = [m for m in job.messages() if isinstance(m, Blob)]
    assert sum(bool(m.descriptors()) for m in sent) == MAX_SHARED_BLOBS
    assert all(m.data == b"b" * 100 for m in sent if not m.descriptors())
