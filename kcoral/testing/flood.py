# -*- test-case-name: tests.reliability.test_connection_floods -*-
"""
A slowloris flood and the probes that measure service through it, for the
reliability tests and C{bench/probes/connection_flood.py}.  Loopback only.

L{TricklingFlood} keeps C{count} connections open from several 127.0.0.x
source addresses, each trickling a request head a byte at a time and never
finishing it; a connection the server closes is opened again at once, as an
attacker would.  L{Probes} counts how many C{/health} requests and
programs, each on a fresh connection, are answered.  Blocking helpers:
threads and sockets, never the reactor.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import attrs

from kcoral.testing.live_server import multipart_body

#: What each flood connection sends first, then one byte of padding a turn.
FLOOD_HEAD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: "


def sources(first: int, count: int) -> list[str]:
    """C{count} loopback addresses from 127.0.0.C{first} on."""
    return [f"127.0.0.{first + n}" for n in range(count)]


class TricklingFlood:
    """
    C{count} trickling connections to C{port}, spread over C{addresses},
    kept open (reopened when closed) by a thread until L{stop}.
    """

    def __init__(
        self,
        port: int,
        count: int,
        addresses: Sequence[str],
        interval: float = 0.5,
        host: str = "127.0.0.1",
    ) -> None:
        self.port = port
        self.count = count
        self.addresses = list(addresses)
        self.interval = interval
        self.host = host
        self.opened = 0
        self.reopened = 0
        self.connect_failures = 0
        self._socks: list[socket.socket | None] = [None] * count
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="flood")

    def _open(self, index: int) -> socket.socket | None:
        source = self.addresses[index % len(self.addresses)]
        try:
            sock = socket.create_connection(
                (self.host, self.port), timeout=2, source_address=(source, 0)
            )
            sock.setblocking(False)
            sock.send(FLOOD_HEAD)
        except OSError:
            self.connect_failures += 1
            return None
        self.opened += 1
        return sock

    def start(self, settle: float = 1.0) -> TricklingFlood:
        """Open every connection, start trickling, and let the server take them in."""
        for index in range(self.count):
            self._socks[index] = self._open(index)
        self._thread.start()
        time.sleep(settle)
        return self

    def open_now(self) -> int:
        """How many flood connections are open (as far as this side knows)."""
        return sum(sock is not None for sock in self._socks)

    def _run(self) -> None:
        while not self._stop.is_set():
            turn = time.monotonic()
            for index, sock in enumerate(self._socks):
                if self._stop.is_set():
                    break
                if sock is not None:
                    try:
                        sock.send(b"a")
                        continue
                    except BlockingIOError:
                        continue
                    except OSError:
                        sock.close()
                self._socks[index] = self._open(index)
                if self._socks[index] is not None and sock is not None:
                    self.reopened += 1
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - turn)))

    def stop(self) -> None:
        """Stop trickling and close every connection."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        for sock in self._socks:
            if sock is not None:
                sock.close()
        self._socks = [None] * self.count

    def __enter__(self) -> TricklingFlood:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@attrs.define
class Probes:
    """
    Probes of a server through a flood from C{source}: C{/health}, and an
    ordinary program (with C{token} when given); answered counts by kind.
    """

    port: int
    source: str = "127.0.0.1"
    token: str | None = None
    timeout: float = 20.0
    sent: dict[str, int] = attrs.Factory(lambda: {"health": 0, "program": 0})
    answered: dict[str, int] = attrs.Factory(lambda: {"health": 0, "program": 0})
    failures: list[str] = attrs.Factory(list)
    slowest_s: float = 0.0

    def _request(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str]
    ) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection(
            "127.0.0.1", self.port, timeout=self.timeout, source_address=(self.source, 0)
        )
        try:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def _probe(
        self,
        kind: str,
        method: str,
        path: str,
        body: bytes | None,
        headers: dict[str, str],
        ok: Any,
    ) -> bool:
        self.sent[kind] += 1
        started = time.monotonic()
        try:
            status, data = self._request(method, path, body, headers)
            good = status == 200 and ok(json.loads(data))
            if not good:
                self.failures.append(f"{kind}: {status} {data[:200]!r}")
        except Exception as e:
            good = False
            self.failures.append(f"{kind}: {type(e).__name__}: {e}")
        self.slowest_s = max(self.slowest_s, time.monotonic() - started)
        if good:
            self.answered[kind] += 1
        return good

    def health(self) -> bool:
        """One C{GET /health}; whether it was answered C{ok}."""
        return self._probe("health", "GET", "/health", None, {}, lambda d: d.get("status") == "ok")

    def program(self) -> bool:
        """One program adding 2 and 3; whether it COMPLETED with 5."""
        program = {
            "instructions": [
                {
                    "op": "upload",
                    "id": "m",
                    "kind": "module",
                    "source": "def f(a, b):\n    return a + b\n",
                },
                {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
                {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": [2, 3]},
                {"op": "return", "key": "out", "value": {"$ref": "r"}},
            ]
        }
        content_type, body = multipart_body(program)
        headers = {"Content-Type": content_type}
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        return self._probe(
            "program",
            "POST",
            "/execute",
            body,
            headers,
            lambda d: d.get("status") == "COMPLETED" and d["results"]["out"]["value"] == 5,
        )

    def rounds(self, count: int, pause: float = 0.2) -> None:
        """C{count} rounds of one /health and one program probe."""
        for _ in range(count):
            self.health()
            self.program()
            time.sleep(pause)

    def percentages(self) -> dict[str, float]:
        """Answered over sent, in percent, by kind."""
        return {
            kind: (100.0 * self.answered[kind] / self.sent[kind]) if self.sent[kind] else 0.0
            for kind in self.sent
        }
