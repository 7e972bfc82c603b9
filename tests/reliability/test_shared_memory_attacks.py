"""
Attacks on the shared buffers and the descriptor socket (issue 15): an
uploaded program can close, write, truncate and map every descriptor its
worker holds, and send anything on the channel's descriptor socket (fd 5).

It must not change a cached blob another request later receives, make the
parent read past a buffer or wait for one, or leak descriptors into the
parent.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from typing import Any

import psutil
import pytest

from kcoral.testing.live_server import ServerProcess
from kcoral.wire.multipart import decode_response
from tests.reliability.conftest import assert_serves, body_of, requires_bwrap

pytestmark = [pytest.mark.integration, requires_bwrap]

#: The attacks, run inside the worker.
SOURCE = r"""
import array
import ctypes
import fcntl
import json
import mmap
import os
import socket
import struct

ALL_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def _shared_fds():
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("/memfd:kcoral"):
            found.append(int(name))
    return found


def _try(action):
    try:
        action()
    except OSError as e:
        return e.errno
    return "changed"


def tamper():
    # Every way to change the blob this worker was given.
    results = {}
    for fd in _shared_fds():
        size = os.fstat(fd).st_size
        results[f"write{fd}"] = _try(lambda: os.pwrite(fd, b"EVIL", 0))
        results[f"truncate{fd}"] = _try(lambda: os.ftruncate(fd, 1))
        results[f"grow{fd}"] = _try(lambda: os.ftruncate(fd, size + 4096))
        results[f"mmap{fd}"] = _try(
            lambda: mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        )
        results[f"unseal{fd}"] = _try(lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, 0))

        def reopen():
            other = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
            try:
                os.write(other, b"EVIL")
            finally:
                os.close(other)

        results[f"reopen{fd}"] = _try(reopen)

        def mprotect():
            import numpy as np

            mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
            start = np.frombuffer(mapped, dtype=np.uint8).__array_interface__["data"][0]
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.mprotect(ctypes.c_void_p(start), ctypes.c_size_t(size), 3) != 0:
                raise OSError(ctypes.get_errno(), "mprotect")
            ctypes.memmove(start, b"EVIL", 4)

        results[f"mprotect{fd}"] = _try(mprotect)
    return results


def _frame(header, payload=b""):
    head = json.dumps(header).encode()
    return struct.pack(">IQ", len(head), len(payload)) + head + payload


def _send_fds(fds):
    sock = socket.socket(fileno=os.dup(5))
    try:
        sock.sendmsg([b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    finally:
        sock.close()


def _memfd(data, seals):
    fd = os.memfd_create("attack", os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _returned(sizes, shared):
    os.write(4, _frame({
        "type": "returned", "key": "x", "value": None,
        "part_sizes": sizes, "shared_parts": shared,
    }))


def forge(kind):
    # A return whose shared part is not what it claims.
    if kind == "unsealed":
        _send_fds([_memfd(b"a" * 100, 0)])
        _returned([100], [0])
    elif kind == "shrinkable":
        _send_fds([_memfd(b"a" * 100, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW)])
        _returned([100], [0])
    elif kind == "size":
        _send_fds([_memfd(b"a" * 100, ALL_SEALS)])
        _returned([1 << 20], [0])
    elif kind == "huge":
        _send_fds([_memfd(b"a" * 100, ALL_SEALS)])
        _returned([1 << 40], [0])
    elif kind == "pipe":
        read_end, write_end = os.pipe()
        _send_fds([read_end])
        _returned([0], [0])
    elif kind == "socket":
        _send_fds([5])
        _returned([0], [0])
    elif kind == "missing":
        _returned([100], [0])
    elif kind == "extra":
        fd = _memfd(b"a" * 100, ALL_SEALS)
        _send_fds([fd, fd])
        _returned([100], [0])
    return "sent"


def flood():
    # Descriptors no message names, as many as the socket takes.
    fd = _memfd(b"f" * 100, ALL_SEALS)
    sock = socket.socket(fileno=os.dup(5))
    sock.setblocking(False)
    sent = 0
    try:
        while sent < 20000:
            sock.sendmsg([b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd] * 200))])
            sent += 1
    except OSError:
        pass
    return sent


def close_socket():
    os.close(5)
    return "closed"
"""


def call(fn: str, *args: Any, blob: str | None = None) -> dict[str, Any]:
    """A program running C{fn(*args)} of L{SOURCE}, with a bytes upload of C{blob} first."""
    instructions: list[dict[str, Any]] = []
    if blob is not None:
        instructions.append({"op": "upload", "id": "b", "kind": "bytes", "blob": blob})
    instructions += [
        {"op": "upload", "id": "m", "kind": "module", "source": SOURCE},
        {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": fn},
        {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": list(args)},
        {"op": "return", "key": "out", "value": {"$ref": "r"}},
    ]
    return {"instructions": instructions}


def echo(blob: str) -> dict[str, Any]:
    return {
        "instructions": [
            {"op": "upload", "id": "b", "kind": "bytes", "blob": blob},
            {"op": "return", "key": "out", "value": {"$ref": "b"}},
        ]
    }


def returned_part(response: Any) -> bytes:
    assert response.status == 200, response.body[:2000]
    result, parts = decode_response(response.headers["content-type"], response.body)
    assert result["status"] == "COMPLETED", result
    node = result["results"]["out"]
    data = parts[node["part"]]
    assert hashlib.sha256(data).hexdigest() == node["sha256"]
    return data


def parent_fds(server: ServerProcess) -> int:
    return psutil.Process(server.process.pid).num_fds()  # type: ignore[union-attr]


def assert_fds_back_to(server: ServerProcess, before: int, wait: float = 10.0) -> None:
    """
    The parent holds no more descriptors than C{before} once a replaced
    worker's pipes and sockets are closed (that takes a moment).
    """
    deadline = time.monotonic() + wait
    lowest = parent_fds(server)
    while lowest > before and time.monotonic() < deadline:
        time.sleep(0.1)
        lowest = min(lowest, parent_fds(server))
    assert lowest <= before


@pytest.fixture(scope="module")
def server(attacked_server: Callable[..., ServerProcess]) -> ServerProcess:
    return attacked_server("--num-workers", "1", "--max-requests-per-worker", "0")


def test_cached_blob_cannot_be_changed(server: ServerProcess) -> None:
    """
    A program holding a cached blob's descriptor tries every way to change
    it; the next request that uses the blob (from the cache) gets it intact.
    """
    data = os.urandom(1 << 20)
    digest = hashlib.sha256(data).hexdigest()
    response = server.execute(call("tamper", blob=digest), [data])
    assert response.status == 200, response.body[:2000]
    body = body_of(response)
    assert body["status"] == "COMPLETED", body
    attempts = body["results"]["out"]["value"]
    # The worker had the blob's descriptor, and every attempt was refused.
    assert any(key.startswith("write") for key in attempts), attempts
    assert "changed" not in attempts.values(), attempts
    # From the cache (no blob supplied), to this worker and to a new one.
    assert returned_part(server.execute(echo(digest))) == data
    assert returned_part(server.execute(echo(digest))) == data


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("unsealed", "not sealed"),
        ("shrinkable", "not sealed"),
        ("size", "declares 1048576"),
        ("huge", "over the limit"),
        ("pipe", "not a sealed"),
        ("socket", "not a sealed"),
        ("missing", "not sent"),
        ("extra", "expected 1 descriptors, received 2"),
    ],
)
def test_forged_shared_parts_are_refused(server: ServerProcess, kind: str, message: str) -> None:
    """
    A return naming a descriptor that is not a sealed buffer of its declared
    size (or none at all) fails the request at once as a broken channel;
    the parent reads nothing, waits for nothing and keeps no descriptor.
    """
    assert_serves(server)
    before = parent_fds(server)
    response = server.execute(call("forge", kind), timeout=60)
    assert response.status == 500, response.body[:2000]
    body = body_of(response)
    assert body["error"]["kind"] == "engine", body
    assert message in body["error"]["message"], body
    assert_serves(server)
    assert_fds_back_to(server, before)


def test_descriptor_flood(server: ServerProcess) -> None:
    """
    Descriptors no frame names are drained and closed when the program
    ends; the request fails as a broken channel and its worker is replaced.
    """
    assert_serves(server)
    before = parent_fds(server)
    response = server.execute(call("flood"), timeout=60)
    assert response.status == 500, response.body[:2000]
    assert "no message named" in body_of(response)["error"]["message"]
    assert_serves(server)
    assert_fds_back_to(server, before)


def test_closed_descriptor_socket(server: ServerProcess) -> None:
    """A worker that closed its descriptor socket still answers; large parts fail cleanly."""
    response = server.execute(call("close_socket"), timeout=60)
    assert response.status == 200, response.body[:2000]
    assert_serves(server)


def test_no_descriptor_leaks(server: ServerProcess) -> None:
    """
    Many requests moving large blobs and results, cache misses included:
    the parent's open descriptors stay flat.
    """
    blobs = [os.urandom(100 * 1024 + i) for i in range(4)]
    digests = [hashlib.sha256(blob).hexdigest() for blob in blobs]
    for blob, digest in zip(blobs, digests, strict=True):
        assert returned_part(server.execute(echo(digest), [blob])) == blob
    before = parent_fds(server)
    for _ in range(15):
        for blob, digest in zip(blobs, digests, strict=True):
            unknown = hashlib.sha256(os.urandom(16)).hexdigest()
            assert body_of(server.execute(echo(unknown)))["status"] == "CACHE_MISS"
            assert returned_part(server.execute(echo(digest), [blob])) == blob
            assert returned_part(server.execute(echo(digest))) == blob
    assert_fds_back_to(server, before)


def test_many_large_blobs(server: ServerProcess) -> None:
    """
    A program with more large blobs than pass as descriptors (64 per body,
    64 per job) gets every one, supplied and then from the cache.
    """
    blobs = [os.urandom(70_000) for _ in range(100)]
    digests = [hashlib.sha256(blob).hexdigest() for blob in blobs]
    program = {
        "instructions": [
            *[
                {"op": "upload", "id": f"b{i}", "kind": "bytes", "blob": digest}
                for i, digest in enumerate(digests)
            ],
            {
                "op": "upload",
                "id": "m",
                "kind": "module",
                "source": "def pack(*a):\n    return list(a)\n",
            },
            {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "pack"},
            {
                "op": "run",
                "id": "r",
                "fn": {"$ref": "f"},
                "args": [{"$ref": f"b{i}"} for i in range(100)],
            },
            {"op": "return", "key": "out", "value": {"$ref": "r"}},
        ]
    }
    for supplied in (blobs, []):
        response = server.execute(program, supplied)
        assert response.status == 200, response.body[:2000]
        result, parts = decode_response(response.headers["content-type"], response.body)
        assert result["status"] == "COMPLETED", result
        nodes = result["results"]["out"]["value"]
        assert [parts[node["part"]] for node in nodes] == blobs
