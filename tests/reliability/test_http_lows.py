"""
The HTTP side's low-severity holes of issue 32, attacked on a real CPU
server: an oversized request is answered 413 even while its client is still
sending (lingering close), a UNIX socket is its owner's alone unless the
operator says otherwise (and is warned about without tokens), and a client
reusing another client's request id does not overwrite that client's saved
program.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kcoral.testing.live_server import ServerProcess, multipart_body
from tests.reliability.conftest import requires_bwrap, run_program
from tests.reliability.test_clients import events, wait_for

pytestmark = [pytest.mark.integration, requires_bwrap]

MIB = 1 << 20
ADD = "def f(a, b):\n    return a + b\n"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """
    A bubblewrap server without tokens, on TCP and on two UNIX sockets (one
    with the default mode, one with mode=660), with 1 MiB request bodies.
    """
    root = tmp_path_factory.mktemp("lows")
    # A short path: a UNIX socket's path has a 108-byte limit.
    sockets = Path(os.environ.get("TMPDIR", "/tmp")) / f"kc-{uuid.uuid4().hex[:8]}"
    sockets.mkdir(mode=0o700)
    server = ServerProcess(
        [
            "--device",
            "cpu",
            "--sandbox",
            "bubblewrap",
            "--num-workers",
            "1",
            "--max-requests-per-worker",
            "0",
            "--log-dir",
            str(root / "logs"),
            "--max-request-bytes",
            str(MIB),
        ]  # fmt: skip
    )
    server.args += [
        "--listen", f"tcp:{server.port}:interface=127.0.0.1",
        "--listen", f"unix:{sockets / 'default.sock'}",
        "--listen", f"unix:{sockets / 'group.sock'}:mode=660",
    ]  # fmt: skip
    try:
        with server:
            yield {"server": server, "logs": root / "logs", "sockets": sockets}
    finally:
        for name in ("default.sock", "group.sock"):
            (sockets / name).unlink(missing_ok=True)
        sockets.rmdir()


def test_oversized_request_gets_its_413(served: dict[str, Any]) -> None:
    """
    A client that sends a 64 MiB body to a server taking 1 MiB, all of it
    before reading, gets the 413 and its ERROR body, not a reset.
    """
    server = served["server"]
    for _ in range(3):
        content_type, body = multipart_body(run_program(ADD, "f", 1, 2), [os.urandom(64 * MIB)])
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        try:
            connection.request(
                "POST", "/execute", body=body, headers={"Content-Type": content_type}
            )
            response = connection.getresponse()
            document = json.loads(response.read())
        finally:
            connection.close()
        assert response.status == 413
        assert document["error"]["kind"] == "request_too_large"
    assert server.health()["status"] == "ok"


def test_unix_socket_owner_only(served: dict[str, Any]) -> None:
    """
    C{unix:PATH} makes a socket of mode 0600; C{mode=660} is honoured; the
    server warns that its UNIX sockets have no token.
    """
    sockets = served["sockets"]
    assert stat.S_IMODE(os.stat(sockets / "default.sock").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(sockets / "group.sock").st_mode) == 0o660
    (warning,) = wait_for(served["logs"], lambda e: e["event"] == "unauthenticated_unix_socket")
    assert sorted(warning["paths"]) == [str(sockets / "default.sock"), str(sockets / "group.sock")]
    assert warning["level"] == "WARNING"
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect(str(sockets / "default.sock"))
        client.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
    finally:
        client.close()
    assert answer.startswith(b"HTTP/1.1 200")


def post(server: ServerProcess, source: str, request_id: str, a: int) -> dict[str, Any]:
    content_type, body = multipart_body(run_program(ADD, "f", a, 1))
    connection = http.client.HTTPConnection(
        "127.0.0.1", server.port, timeout=60, source_address=(source, 0)
    )
    try:
        connection.request(
            "POST",
            "/execute",
            body=body,
            headers={"Content-Type": content_type, "X-Request-ID": request_id},
        )
        response = connection.getresponse()
        document: dict[str, Any] = json.loads(response.read())
    finally:
        connection.close()
    assert response.status == 200, document
    return document


def test_reused_request_id_keeps_the_first_program(served: dict[str, Any]) -> None:
    """
    127.0.0.3 sends a program under the request id 127.0.0.2 used: both
    programs are saved, the first one unchanged, and each request's
    C{request_accepted} event names its own file.
    """
    server, logs = served["server"], served["logs"]
    request_id = str(uuid.uuid4())
    first = post(server, "127.0.0.2", request_id, 10)
    second = post(server, "127.0.0.3", request_id, 20)
    assert (first["request_id"], second["request_id"]) == (request_id, request_id)
    assert (first["results"]["out"]["value"], second["results"]["out"]["value"]) == (11, 21)
    accepted = wait_for(
        logs, lambda e: e["event"] == "request_accepted" and e["request_id"] == request_id
    )
    assert len(accepted) == 2
    names = [e["program"] for e in accepted]
    assert names == [f"{request_id}.json", f"{request_id}.2.json"]
    (run,) = list((logs / "runs").iterdir())
    saved = [json.loads((run / "programs" / name).read_bytes()) for name in names]
    assert [p["instructions"][2]["args"] for p in saved] == [[10, 1], [20, 1]]
    assert len([e for e in events(logs) if e.get("request_id") == request_id]) >= 4
