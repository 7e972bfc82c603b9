# -*- test-case-name: tests.integration.test_sdnotify -*-
"""
C{kcoral server} under a systemd C{Type=notify} unit, as systemd runs it:
C{NOTIFY_SOCKET} names a Unix datagram socket the test binds.  The server
sends C{READY=1} once it serves (its workers are up), C{STOPPING=1} when
SIGTERM arrives, and its programs never see the variable.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest

from kcoral.testing.live_server import ServerProcess, post_program

pytestmark = [pytest.mark.integration]

ENVIRON = """\
import os
def f():
    return os.environ.get("NOTIFY_SOCKET")
"""


def _receive(sock: socket.socket, wanted: str, timeout: float = 60.0) -> list[list[str]]:
    """Messages until one has the line C{wanted} (a guard against a hang, not a timing)."""
    messages = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            lines = sock.recv(4096).decode().split("\n")
        except TimeoutError:
            break
        messages.append(lines)
        if wanted in lines:
            return messages
    raise AssertionError(f"no {wanted} in {messages}")


def test_ready_and_stopping(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        env = {**os.environ, "NOTIFY_SOCKET": path}
        server = ServerProcess(
            ["--device", "cpu", "--num-workers", "1", "--sandbox", "none", "--log-dir", ""],
            env=env,
            log_path=tmp_path / "server.log",
        )
        server.start()
        try:
            [*_, ready] = _receive(sock, "READY=1")
            assert ready[0] == "READY=1"
            assert ready[1] == "STATUS=serving with 1 worker(s)"
            assert server.health()["status"] == "ok"
            program = {
                "instructions": [
                    {"op": "upload", "kind": "module", "id": "m", "source": ENVIRON},
                    {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
                    {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": []},
                    {"op": "return", "key": "r", "value": {"$ref": "r"}},
                ]
            }
            answer = post_program(server.port, program).json()
            assert answer["status"] == "COMPLETED"
            assert answer["results"]["r"] == {"type": "null"}  # the variable is gone
            assert server.process is not None
            server.process.send_signal(signal.SIGTERM)
            assert ["STOPPING=1", "STATUS=stopping"] in _receive(sock, "STOPPING=1")
        finally:
            code = server.stop()
        assert code == 0
