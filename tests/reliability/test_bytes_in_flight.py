"""
Memory stays bounded when many large uploads and results meet (issue 15):
request bodies land in sealed shared buffers and results stream from them,
both counted against C{--max-bytes-in-flight}; past it a request is
answered 503 with C{Retry-After}, never held in memory.
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psutil
import pytest

from kcoral.testing.descriptors import MEMFD_PREFIX, descriptor_targets
from kcoral.testing.live_server import Response, ServerProcess, multipart_body
from kcoral.wire.multipart import decode_response
from tests.reliability.conftest import assert_serves, body_of, requires_bwrap

pytestmark = [pytest.mark.integration, requires_bwrap]

MIB = 1 << 20
SLOW_ECHO = r"""
import time


def echo(data):
    time.sleep(0.3)
    return data
"""


def program(digest: str) -> dict[str, Any]:
    return {
        "instructions": [
            {"op": "upload", "id": "b", "kind": "bytes", "blob": digest},
            {"op": "upload", "id": "m", "kind": "module", "source": SLOW_ECHO},
            {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "echo"},
            {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": [{"$ref": "b"}]},
            {"op": "return", "key": "out", "value": {"$ref": "r"}},
        ]
    }


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_response(sock: socket.socket, buffered: bytes) -> tuple[Response, bytes]:
    """One response (Content-Length framed) from C{sock}; the bytes after it."""
    data = buffered
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError(f"connection closed in a response head: {data[:200]!r}")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            while b"\r\n" not in rest:
                rest += _more(sock)
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            while len(rest) < size + 2:
                rest += _more(sock)
            body, rest = body + rest[:size], rest[size + 2 :]
            if size == 0:
                return Response(int(lines[0].split()[1]), headers, body), rest
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("connection closed in a response body")
        rest += chunk
    return Response(int(lines[0].split()[1]), headers, rest[:length]), rest[length:]


def _more(sock: socket.socket) -> bytes:
    chunk = sock.recv(1 << 20)
    if not chunk:
        raise ConnectionError("connection closed in a response")
    return chunk


def post_expecting_continue(port: int, program: dict[str, Any], blob: bytes) -> Response:
    """
    POST with C{Expect: 100-continue}, the way a client avoids sending a
    body the server will not read: a refusal (503 past the bytes in
    flight) comes right after the interim 100 and the body is not sent.
    """
    content_type, body = multipart_body(program, [blob])
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    try:
        sock.sendall(
            b"POST /execute HTTP/1.1\r\nHost: 127.0.0.1\r\nExpect: 100-continue\r\n"
            + f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        )
        interim, rest = _read_response(sock, b"")
        assert interim.status == 100, interim
        sock.settimeout(0.5)
        try:
            rest += sock.recv(1 << 20)
        except TimeoutError:
            pass
        sock.settimeout(120)
        if not rest:
            sock.sendall(body)
        response, _ = _read_response(sock, rest)
        return response
    finally:
        sock.close()


class PeakRss:
    """The largest VmRSS of a process, sampled every 5 ms while running."""

    def __init__(self, pid: int) -> None:
        self._process = psutil.Process(pid)
        self.peak = self._process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._process.memory_info().rss)
            time.sleep(0.005)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def server(attacked_server: Callable[..., ServerProcess]) -> ServerProcess:
    return attacked_server(
        "--num-workers",
        "2",
        "--max-requests-per-worker",
        "0",
        "--max-bytes-in-flight",
        str(48 * MIB),
        "--max-queued-requests",
        "64",
    )


def _descriptors_but_memfds(pid: int) -> int:
    """
    The server's open descriptors other than memfds: the blobs the requests
    that completed left in the memory cache are memfds, and legitimately so.
    """
    return sum(not target.startswith(MEMFD_PREFIX) for target in descriptor_targets(pid).values())


def test_many_large_uploads(server: ServerProcess) -> None:
    """
    Twelve clients send a 16 MiB blob each at once and get it back: the
    ones past the cap are answered 503 with Retry-After; the others
    complete with their own bytes; the server's memory grows by less than
    the cap and its descriptors come back.
    """
    assert_serves(server)
    process = psutil.Process(server.process.pid)  # type: ignore[union-attr]
    fds_before = _descriptors_but_memfds(process.pid)
    rss_before = process.memory_info().rss
    blobs = [os.urandom(16 * MIB) for _ in range(12)]

    def send(data: bytes) -> tuple[bytes, Response]:
        return data, post_expecting_continue(server.port, program(sha(data)), data)

    with PeakRss(process.pid) as rss, ThreadPoolExecutor(len(blobs)) as pool:
        answers = list(pool.map(send, blobs))
    completed = refused = 0
    for data, response in answers:
        if response.status == 503:
            refused += 1
            assert "retry-after" in response.headers, response.headers
            assert body_of(response)["error"]["kind"] == "busy"
            continue
        assert response.status == 200, response.body[:2000]
        result, parts = decode_response(response.headers["content-type"], response.body)
        assert result["status"] == "COMPLETED", result
        assert parts[result["results"]["out"]["part"]] == data
        completed += 1
    assert completed >= 1 and refused >= 1, (completed, refused)
    print(f"{completed} completed, {refused} refused, RSS +{(rss.peak - rss_before) / MIB:.0f} MiB")
    # Bodies and results live in sealed buffers the server never maps.
    assert rss.peak - rss_before < 48 * MIB, (rss.peak - rss_before) / MIB
    assert_serves(server)
    deadline = time.monotonic() + 10
    while _descriptors_but_memfds(process.pid) > fds_before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _descriptors_but_memfds(process.pid) <= fds_before
