"""
Service survives a slowloris flood past the connection cap (issue 32, item
4): connections that trickle request heads are closed to make room for
clients that send theirs, per address and in all, and a server whose
open-file limit is below its connection cap neither spins nor floods its
log with C{EMFILE}.  CI-sized floods on loopback, from several 127.0.0.x
source addresses, against a real bubblewrap CPU server; the probes are
/health and ordinary programs from 127.0.0.1, each on a fresh connection.
C{bench/probes/connection_flood.py} runs the issue's 4,300 connections.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kcoral.testing.flood import Probes, TricklingFlood, sources
from kcoral.testing.live_server import ServerProcess
from tests.reliability.conftest import requires_bwrap

pytestmark = [pytest.mark.integration, requires_bwrap]

TOKEN = "flood-test-token-0123456789"
BASE = ["--device", "cpu", "--sandbox", "bubblewrap", "--num-workers", "1"]


def assert_all_answered(probes: Probes, flood: TricklingFlood, what: str) -> None:
    print(
        f"{what}: /health {probes.answered['health']}/{probes.sent['health']}, programs "
        f"{probes.answered['program']}/{probes.sent['program']}, slowest "
        f"{probes.slowest_s * 1e3:.0f} ms; flood opened {flood.opened} connections "
        f"({flood.reopened} again after the server closed them)"
    )
    assert probes.failures == []
    assert probes.percentages() == {"health": 100.0, "program": 100.0}


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("flood") / "tokens"
    path.write_text(f"tester {TOKEN}\n")
    return path


@pytest.fixture(scope="module")
def capped(token_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server capped at 300 connections (flags the code before the fix had too)."""
    log = tmp_path_factory.mktemp("flood-logs") / "server.log"
    args = [*BASE, "--log-dir", "", "--max-connections", "300"]
    args += ["--auth-token-file", str(token_file)]
    with ServerProcess(args, log_path=log) as server:
        yield server


def test_flood_past_the_cap(capped: ServerProcess) -> None:
    """
    600 connections from six addresses trickle request heads against a cap
    of 300 (reopened as soon as they are closed): every /health probe and
    every authenticated program from a seventh address is answered.
    """
    with TricklingFlood(capped.port, 600, sources(2, 6)) as flood:
        probes = Probes(capped.port, token=TOKEN)
        probes.rounds(15)
        assert flood.opened > 300
    assert_all_answered(probes, flood, "600 trickling connections, cap 300")


def test_kept_alive_client_survives(capped: ServerProcess) -> None:
    """
    A client that completed a request and keeps its connection open is not
    closed to make room while flooding connections that never completed a
    head are there to close.
    """
    connection = http.client.HTTPConnection(
        "127.0.0.1", capped.port, timeout=20, source_address=("127.0.0.9", 0)
    )
    try:
        connection.request("GET", "/health")
        response = connection.getresponse()
        assert response.status == 200
        response.read()
        with TricklingFlood(capped.port, 500, sources(2, 5)):
            time.sleep(2)
            connection.request("GET", "/health")
            response = connection.getresponse()
            assert response.status == 200
            assert json.loads(response.read())["status"] == "ok"
    finally:
        connection.close()


@pytest.fixture(scope="module")
def per_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """At most 50 connections per address."""
    args = [*BASE, "--log-dir", "", "--max-connections-per-client", "50"]
    with ServerProcess(args) as server:
        yield server


def test_per_address_cap(per_client: ServerProcess) -> None:
    """
    200 trickling connections from 127.0.0.1 itself, where the probes come
    from: the address holds at most 50 and its oldest waiting one makes
    room for each probe; another address is untouched.
    """
    other = socket.create_connection(
        ("127.0.0.1", per_client.port), timeout=20, source_address=("127.0.0.7", 0)
    )
    try:
        with TricklingFlood(per_client.port, 200, ["127.0.0.1"]) as flood:
            probes = Probes(per_client.port)
            probes.rounds(10)
            other.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := other.recv(65536):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        assert_all_answered(probes, flood, "200 trickling connections from the probes' address")
    finally:
        other.close()


@pytest.fixture(scope="module")
def low_fd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    """A server whose hard limit on open files is 512 (the default cap is 4,096)."""
    log = tmp_path_factory.mktemp("fd-logs") / "server.log"
    args = [*BASE, "--log-dir", ""]
    with ServerProcess(args, log_path=log, fd_limit=512) as server:
        yield server, log


def test_flood_past_the_fd_limit(low_fd: tuple[ServerProcess, Path]) -> None:
    """
    700 trickling connections against a server that may open only 512
    files: the cap is kept below the limit, every probe is answered, and
    the log holds a handful of lines, not one per failed accept.
    """
    server, log = low_fd
    with TricklingFlood(server.port, 700, sources(2, 7)) as flood:
        probes = Probes(server.port)
        probes.rounds(10)
    assert_all_answered(probes, flood, "700 trickling connections, 512 open files")
    text = log.read_text(errors="replace")
    print(f"server log: {len(text)} bytes, {text.count('EMFILE')} lines naming EMFILE")
    assert text.count("EMFILE") <= 5
    assert "connection_cap_lowered" in text
