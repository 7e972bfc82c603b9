# -*- test-case-name: tests.unit.test_gateway_dispatch -*-
"""
Helpers for tests and benchmarks of C{kcoral gateway}:
L{FakeJobQueue}, an in-memory L{kcoral.gateway.dispatch.IJobQueue} for
unit tests, and L{GatewayProcess}, a real gateway subprocess on a free
loopback port.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
from twisted.internet.defer import Deferred, fail, succeed
from zope.interface import implementer

from kcoral.gateway.dispatch import IJobQueue, QueueRefused
from kcoral.gateway.jobs import Claim
from kcoral.testing.live_server import free_port, request

__all__ = ["FakeJobQueue", "GatewayProcess"]


@implementer(IJobQueue)
@attrs.define
class FakeJobQueue:
    """
    The work queue and claims bucket in memory: published messages are
    kept by subject, claims by job; C{refuse} makes the next publishes fail
    (C{"full"} or C{"down"}); C{hold_cancels} keeps cancel Deferreds
    unfired until the test fires them.
    """

    connected: bool = True
    size: int = 1000
    published: list[tuple[str, bytes, str]] = attrs.field(factory=list)
    claims: dict[str, Claim] = attrs.field(factory=dict)
    prepared: list[tuple[str, int]] = attrs.field(factory=list)
    refuse: str | None = None
    hold_cancels: bool = False
    held: list[tuple[str, Deferred[Claim | None]]] = attrs.field(factory=list)
    depth: int | None = 0

    def publish(self, subject: str, data: bytes, job: str) -> Deferred[None]:
        if self.refuse is not None or len(self.published) >= self.size:
            full = self.refuse != "down"
            return fail(QueueRefused("queue full" if full else "down", full=full))
        self.published.append((subject, data, job))
        return succeed(None)

    def prepare(self, compat: str, gpus: int) -> Deferred[None]:
        self.prepared.append((compat, gpus))
        return succeed(None)

    def claim(self, job: str, node: str) -> bool:
        """A node's create-only claim; whether it won."""
        if job in self.claims:
            return False
        self.claims[job] = Claim(node=node)
        return True

    def cancel(self, job: str) -> Deferred[Claim | None]:
        if self.hold_cancels:
            d: Deferred[Claim | None] = Deferred()
            self.held.append((job, d))
            return d
        return succeed(self._cancel(job))

    def _cancel(self, job: str) -> Claim | None:
        existing = self.claims.get(job)
        if existing is not None:
            return existing
        self.claims[job] = Claim(cancelled=True)
        return None

    def release_cancels(self) -> None:
        """Fire the held cancels, deciding each against the claims now."""
        held, self.held = self.held, []
        for job, d in held:
            d.callback(self._cancel(job))


@attrs.define
class GatewayProcess:
    """
    A C{kcoral gateway} subprocess on a free loopback port.  Use as a
    context manager; C{stop()} sends SIGTERM, C{kill()} SIGKILL.
    """

    nats_url: str
    credentials: Path | None = None
    args: Sequence[str] = ()
    port: int = attrs.field(factory=free_port)
    log_path: Path | None = None
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0, *, wait_for_nodes: int = 0) -> GatewayProcess:
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        argv = [
            sys.executable,
            "-m",
            "kcoral",
            "gateway",
            "--nats",
            self.nats_url,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *(["--nats-credentials", str(self.credentials)] if self.credentials else []),
            *self.args,
        ]
        output = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(argv, env=env, stdout=output, stderr=subprocess.STDOUT)
        finally:
            if self.log_path:
                output.close()  # type: ignore[union-attr]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.process.returncode} during start")
            try:
                health = self.health()
                if len(health["gateway"]["nodes"]) >= wait_for_nodes:
                    return self
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("gateway did not answer /health in time")

    def health(self) -> dict[str, Any]:
        result: dict[str, Any] = request(self.port, "GET", "/health", timeout=5).json()
        return result

    def wait_for_nodes(self, count: int, timeout: float = 60.0) -> dict[str, Any]:
        """Wait until C{count} nodes are present; the last /health."""
        deadline = time.monotonic() + timeout
        health = self.health()
        while len(health["gateway"]["nodes"]) != count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{count} nodes not present in time: {health['gateway']}")
            time.sleep(0.1)
            health = self.health()
        return health

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def __enter__(self) -> GatewayProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
