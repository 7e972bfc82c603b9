"""
The request-body budget cannot be held hostage (issue 32, item 2): a head
that declares a large body holds nothing until the bytes arrive, a head
without a valid token is refused before its body, one address holds at most
its share, and a body that stops arriving is cut off and its bytes given
back.  Every attack runs against a real bubblewrap CPU server on 127.0.0.1;
the canary programs are ordinary ones from another address.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kcoral.testing.live_server import ServerProcess, multipart_body, sha256
from tests.reliability.conftest import body_of, post_from, requires_bwrap, run_program
from tests.reliability.test_clients import read_all, split_response

pytestmark = [pytest.mark.integration, requires_bwrap]

MIB = 1 << 20
TOKEN = "budget-attack-token-0123456789"
ADD = "def f(a, b):\n    return a + b\n"
LENGTH = "def f(data):\n    return len(data)\n"


def head(length: int, token: str | None = None, content_type: str | None = None) -> bytes:
    """A /execute request head declaring C{length} body bytes."""
    lines = [
        "POST /execute HTTP/1.1",
        "Host: 127.0.0.1",
        f"Content-Type: {content_type or 'multipart/form-data; boundary=kcoralboundary'}",
        f"Content-Length: {length}",
    ]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def heads_only(port: int, count: int, length: int, token: str | None = None) -> list[socket.socket]:
    """C{count} connections, from 127.0.0.2 up, that send a head and nothing more."""
    socks = []
    for n in range(count):
        sock = socket.create_connection(
            ("127.0.0.1", port), timeout=30, source_address=(f"127.0.0.{n + 2}", 0)
        )
        sock.sendall(head(length, token))
        socks.append(sock)
    time.sleep(0.5)  # let the server read every head
    return socks


def canary(server: ServerProcess, token: str | None = None) -> dict[str, Any]:
    """An ordinary program from 127.0.0.1; its JSON body (status asserted 200)."""
    content_type, body = multipart_body(run_program(ADD, "f", 2, 3))
    headers = {"Content-Type": content_type}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        connection.request("POST", "/execute", body=body, headers=headers)
        response = connection.getresponse()
        data = response.read()
    finally:
        connection.close()
    assert response.status == 200, (response.status, data[:500])
    document: dict[str, Any] = json.loads(data)
    assert document["status"] == "COMPLETED", document
    return document


def close_all(socks: list[socket.socket]) -> None:
    for sock in socks:
        sock.close()


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("budget") / "tokens"
    path.write_text(f"tester {TOKEN}\n")
    return path


@pytest.fixture(scope="module")
def open_server(attacked_server: Callable[..., ServerProcess]) -> ServerProcess:
    """The default caps (256 MiB bodies, 2 GiB in flight), no tokens."""
    return attacked_server("--num-workers", "1", "--max-requests-per-worker", "0")


@pytest.fixture(scope="module")
def token_server(attacked_server: Callable[..., ServerProcess], token_file: Path) -> ServerProcess:
    """The default caps, behind a token file."""
    return attacked_server(
        "--num-workers", "1", "--max-requests-per-worker", "0",
        "--auth-token-file", str(token_file),
    )  # fmt: skip


def test_heads_only_hold_nothing(open_server: ServerProcess) -> None:
    """
    The issue's attack: eight connections each send a head declaring a
    256 MiB body (8 x 256 MiB is the whole 2 GiB budget) and nothing else.
    Canary programs still run.
    """
    socks = heads_only(open_server.port, 8, 256 * MIB)
    try:
        for _ in range(5):
            canary(open_server)
    finally:
        close_all(socks)


def test_heads_without_token_refused_at_once(token_server: ServerProcess) -> None:
    """
    With tokens, a head without one is answered 401 before any of its body
    is read (the connection is not held for the body deadline), and the
    canaries, with the token, run.
    """
    socks = heads_only(token_server.port, 8, 256 * MIB)
    try:
        for sock in socks:
            sock.settimeout(10)
            status, headers, body = split_response(read_all(sock))
            assert status == 401, (status, body[:200])
            assert headers["www-authenticate"] == 'Bearer realm="kcoral"'
        for _ in range(3):
            canary(token_server, TOKEN)
    finally:
        close_all(socks)


def test_authenticated_heads_only_hold_nothing(token_server: ServerProcess) -> None:
    """A client with a valid token sending only heads keeps no one out either."""
    socks = heads_only(token_server.port, 8, 256 * MIB, TOKEN)
    try:
        for _ in range(3):
            canary(token_server, TOKEN)
    finally:
        close_all(socks)


@pytest.fixture(scope="module")
def small_budget(attacked_server: Callable[..., ServerProcess]) -> ServerProcess:
    """16 MiB in flight, 8 MiB per address, bodies cut after 2 s without a byte."""
    return attacked_server(
        "--num-workers", "1", "--max-requests-per-worker", "0",
        "--max-bytes-in-flight", str(16 * MIB), "--max-bytes-per-client", str(8 * MIB),
        "--body-stall-seconds", "2",
    )  # fmt: skip


def partial_body(port: int, source: str, declared: int, sent: int) -> socket.socket:
    """A connection from C{source} that sends C{sent} of C{declared} body bytes and stops."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0))
    sock.sendall(head(declared) + b"x" * sent)
    return sock


def blob_program(size: int) -> tuple[dict[str, Any], bytes]:
    data = os.urandom(size)
    program = {
        "instructions": [
            {"op": "upload", "id": "b", "kind": "bytes", "blob": sha256(data)},
            {"op": "upload", "id": "m", "kind": "module", "source": LENGTH},
            {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
            {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": [{"$ref": "b"}]},
            {"op": "return", "key": "out", "value": {"$ref": "r"}},
        ]
    }
    return program, data


def post_blob(port: int, source: str, size: int) -> tuple[int, dict[str, Any]]:
    program, data = blob_program(size)
    content_type, body = multipart_body(program, [data])
    connection = http.client.HTTPConnection(
        "127.0.0.1", port, timeout=120, source_address=(source, 0)
    )
    try:
        connection.request("POST", "/execute", body=body, headers={"Content-Type": content_type})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_one_address_holds_its_share(small_budget: ServerProcess) -> None:
    """
    127.0.0.2 holds 7 MiB of bodies it never finishes: its next 4 MiB body
    is refused (503), while 127.0.0.1's 4 MiB body runs.
    """
    hog = partial_body(small_budget.port, "127.0.0.2", 8 * MIB, 7 * MIB)
    try:
        time.sleep(0.5)
        status, document = post_blob(small_budget.port, "127.0.0.2", 4 * MIB)
        assert status == 503, document
        assert document["error"]["kind"] == "busy"
        status, document = post_blob(small_budget.port, "127.0.0.1", 4 * MIB)
        assert status == 200, document
        assert document["results"]["out"]["value"] == 4 * MIB
    finally:
        hog.close()


def test_stalled_body_released(small_budget: ServerProcess) -> None:
    """
    Two addresses hold 14 of the 16 MiB with bodies they stop sending: a
    4 MiB canary is refused at first, the stalled bodies are cut off with a
    408 after 2 s without a byte, and the canary then runs.
    """
    hogs = [partial_body(small_budget.port, f"127.0.0.{n}", 8 * MIB, 7 * MIB) for n in (3, 4)]
    try:
        time.sleep(0.5)
        status, _ = post_blob(small_budget.port, "127.0.0.1", 4 * MIB)
        assert status == 503
        for hog in hogs:
            hog.settimeout(20)
            status, _, body = split_response(read_all(hog))
            assert status == 408, body[:200]
            assert body_of_raw(body)["error"]["kind"] == "request_timeout"
        status, document = post_blob(small_budget.port, "127.0.0.1", 4 * MIB)
        assert status == 200, document
    finally:
        close_all(hogs)
    canary(small_budget)


def body_of_raw(body: bytes) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(body)
    return document


def test_post_from_still_works(open_server: ServerProcess) -> None:
    """A whole request from another address is served as ever."""
    response = post_from(open_server, "127.0.0.5", run_program(ADD, "f", 1, 1))
    assert response.status == 200
    assert body_of(response)["results"]["out"]["value"] == 2
