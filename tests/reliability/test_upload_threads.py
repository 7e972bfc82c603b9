"""
A large blob is written and hashed by two threads of the server
(L{kcoral.ipc.blobsink}); clients that misbehave in the middle of one must
not leave threads, descriptors or memory behind, nor stall anyone else.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psutil
import pytest

from kcoral.ipc import blobsink
from kcoral.testing.descriptors import MEMFD_PREFIX, descriptor_targets
from kcoral.testing.live_server import ServerProcess, multipart_body
from tests.reliability.conftest import assert_serves, body_of, requires_bwrap

pytestmark = [pytest.mark.integration, requires_bwrap]

MIB = 1 << 20


@pytest.fixture(scope="module")
def server(attacked_server: Callable[..., ServerProcess]) -> ServerProcess:
    return attacked_server("--num-workers", "2", "--max-requests-per-worker", "0")


def _program(data: bytes) -> dict[str, Any]:
    digest = hashlib.sha256(data).hexdigest()
    return {"instructions": [{"op": "upload", "id": "b", "kind": "bytes", "blob": digest}]}


def _upload(data: bytes) -> tuple[str, bytes]:
    return multipart_body(_program(data), [data])


def _head(port: int, content_type: str, length: int) -> bytes:
    return (
        f"POST /execute HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def _threads(pid: int) -> int:
    return int(psutil.Process(pid).num_threads())


def _descriptors(pid: int) -> tuple[int, int]:
    """The server's open descriptors: (memfds, the rest)."""
    targets = descriptor_targets(pid).values()
    memfds = sum(target.startswith(MEMFD_PREFIX) for target in targets)
    return memfds, len(targets) - memfds


def _warm(server: ServerProcess) -> tuple[int, tuple[int, int]]:
    """
    The server's thread and descriptor counts at rest, after a large upload
    has started every thread that stays (the I/O pool's among them).
    """
    for _ in range(2):
        data = os.urandom(6 * MIB)
        assert body_of(server.execute(_program(data), [data]))["status"] == "COMPLETED"
    pid = server.process.pid  # type: ignore[union-attr]
    return _settled(pid, 10**6, (10**6, 10**6))


def _settled(pid: int, threads: int, descriptors: tuple[int, int]) -> tuple[int, tuple[int, int]]:
    """Wait (15 s at most) until the counts are down to the given ones; the counts."""
    deadline = time.monotonic() + 15
    while True:
        now = _threads(pid), _descriptors(pid)
        settled = now[0] <= threads and all(
            a <= b for a, b in zip(now[1], descriptors, strict=True)
        )
        if settled or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def test_clients_leaving_mid_blob_leave_nothing(server: ServerProcess) -> None:
    """
    Eight clients each send 24 MiB of a 40 MiB blob and close the
    connection; one more sends 24 MiB and then nothing. The first eight's
    threads end, their memfds go; the server keeps serving while the
    silent one waits, and once it leaves too nothing is left.
    """
    assert_serves(server)
    pid = server.process.pid  # type: ignore[union-attr]
    threads_before, (memfds_before, fds_before) = _warm(server)
    content_type, body = _upload(os.urandom(40 * MIB))

    def leave_midway(_: int) -> None:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(_head(server.port, content_type, len(body)))
            sock.sendall(body[: 24 * MIB])

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(leave_midway, range(8)))
    silent = socket.create_connection(("127.0.0.1", server.port))
    try:
        silent.sendall(_head(server.port, content_type, len(body)))
        silent.sendall(body[: 24 * MIB])
        # Someone else is served meanwhile, a large blob included.
        assert_serves(server)
        other = os.urandom(6 * MIB)
        assert body_of(server.execute(_program(other), [other]))["status"] == "COMPLETED"
    finally:
        silent.close()
    # Only the completed 6 MiB blob stays (in the memory cache).
    threads, (memfds, fds) = _settled(pid, threads_before, (memfds_before + 1, fds_before))
    assert threads <= threads_before, (threads_before, threads)
    assert fds <= fds_before, (fds_before, fds)
    assert memfds <= memfds_before + 1, (memfds_before, memfds)
    assert_serves(server)


def test_more_large_uploads_than_sinks(server: ServerProcess) -> None:
    """
    Twice as many concurrent large uploads as L{blobsink.MAX_LIVE_SINKS}:
    the ones past the bound are written and hashed on the reactor, every
    upload completes with its own digest checked, and the server's threads
    grow by at most two per sink and its two thread pools (4 and 10).
    """
    count = 2 * blobsink.MAX_LIVE_SINKS + 8
    pid = server.process.pid  # type: ignore[union-attr]
    threads_before, _ = _warm(server)
    blobs = [os.urandom(3 * MIB) for _ in range(count)]
    most = 0

    def send(data: bytes) -> dict[str, Any]:
        return body_of(server.execute(_program(data), [data]))

    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(send, data) for data in blobs]
        while not all(f.done() for f in futures):
            most = max(most, _threads(pid) - threads_before)
            time.sleep(0.005)
    for future in futures:
        assert future.result()["status"] == "COMPLETED"
    pools = 4 + 10
    assert most <= 2 * blobsink.MAX_LIVE_SINKS + pools, most
    # The sinks' threads end; the pools may keep what they started.
    assert _settled(pid, threads_before + pools, (10**6, 10**6))[0] <= threads_before + pools
