# -*- test-case-name: tests.unit.test_gateway_dispatch -*-
"""
Helpers for tests and benchmarks of C{kcoral gateway}:
L{FakeJobQueue}, an in-memory L{kcoral.gateway.dispatch.IJobQueue} for
unit tests; L{GatewayProcess}, a real gateway subprocess on a free
loopback port; and L{GatewayPool}, a real nats-server, a gateway and the
CPU nodes that join it (the integration tests' fixture and
C{bench/gateway.py}'s pool).
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
from twisted.internet.defer import Deferred, fail, succeed
from zope.interface import implementer

from kcoral.gateway.dispatch import IJobQueue, QueueRefused
from kcoral.gateway.jobs import Claim
from kcoral.testing.live_server import (
    ServerProcess,
    free_port,
    free_port_run,
    request,
    spawn_kcoral,
    wait_until_up,
)
from kcoral.testing.nats import NatsServer

__all__ = ["FakeJobQueue", "GatewayPool", "GatewayProcess"]


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
        node_ports: list[str] = []
        if self.front_ends > 1 and "--node-port" not in self.args:
            # Each front end also listens on a node port of its own (by
            # default the client port + 1 + its index): pick a free run.
            node_ports = ["--node-port", str(free_port_run(self.front_ends))]
        self.process = spawn_kcoral(
            [
                "gateway",
                "--nats",
                self.nats_url,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                *(["--nats-credentials", str(self.credentials)] if self.credentials else []),
                *node_ports,
                *self.args,
            ],
            log_path=self.log_path,
            append=True,
            preexec_fn=None,
        )
        deadline = time.monotonic() + timeout
        try:
            wait_until_up(
                self.process,
                lambda: len(self.health()["gateway"]["nodes"]) >= wait_for_nodes,
                deadline,
                "gateway",
            )
            # With several front ends, the first answers before the others
            # listen: wait until the kernel has handed a connection to each.
            wait_until_up(
                self.process,
                lambda: len(self.front_ends_answering(10)) >= self.front_ends,
                deadline,
                "gateway",
            )
        except TimeoutError:
            self.stop()
            raise RuntimeError("gateway did not answer /health in time") from None
        return self

    @property
    def front_ends(self) -> int:
        """The C{--front-ends} count in L{args} (1 without the flag)."""
        args = list(self.args)
        return int(args[args.index("--front-ends") + 1]) if "--front-ends" in args else 1

    def front_ends_answering(self, tries: int) -> dict[int, dict[str, Any]]:
        """Each front end's C{/health} seen from C{tries} new connections, by index."""
        seen: dict[int, dict[str, Any]] = {}
        for _ in range(tries):
            try:
                health = self.health()
            except (OSError, ValueError):
                continue
            seen[health["gateway"]["front_end"]["index"]] = health
        return seen

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


class GatewayPool:
    """
    A C{nats-server}, a gateway and nodes (C{kcoral server --join}), all
    on loopback under C{tmp}; stopped in reverse.  C{gateway_args} go to
    the gateway, C{node_args} to every node (before a node's own extras).
    """

    def __init__(
        self,
        tmp: Path,
        node_ids: Sequence[str],
        *,
        gateway_args: Sequence[str] = (),
        node_args: Sequence[str] = (),
        node_timeout: float = 120.0,
    ) -> None:
        self.tmp = tmp
        self.node_ids = list(node_ids)
        self.nats = NatsServer(node_ids=self.node_ids, directory=tmp / "nats")
        self.gateway: GatewayProcess | None = None
        self.gateway_args = list(gateway_args)
        self.node_args = list(node_args)
        self.node_timeout = node_timeout
        self.nodes: dict[str, ServerProcess] = {}

    def start(self) -> GatewayPool:
        self.nats.start()
        try:
            self.gateway = GatewayProcess(
                self.nats.url,
                self.nats.credentials_file("gateway"),
                args=self.gateway_args,
                log_path=self.tmp / "gateway.log",
            ).start()
        except BaseException:
            # Nothing is left running when the gateway cannot start.
            self.nats.cleanup()
            raise
        return self

    @property
    def port(self) -> int:
        assert self.gateway is not None
        return self.gateway.port

    @property
    def url(self) -> str:
        assert self.gateway is not None
        return self.gateway.url

    def node(
        self, node_id: str, *, seats: int = 1, extra: Sequence[str] = (), wait: bool = True
    ) -> ServerProcess:
        """Start node C{node_id} (C{seats} CPU workers) and wait until the gateway sees it."""
        server = ServerProcess(
            [
                "--device",
                "cpu",
                "--num-workers",
                str(seats),
                "--sandbox",
                "none",
                "--log-dir",
                "",
                *self.node_args,
                "--join",
                self.nats.url,
                "--node-id",
                node_id,
                "--credentials",
                str(self.nats.credentials_file(node_id)),
                *extra,
            ],
            log_path=self.tmp / f"{node_id}.log",
        )
        self.nodes[node_id] = server.start(timeout=self.node_timeout)
        if wait:
            self.wait_for(lambda h: node_id in {n["node"] for n in h["gateway"]["nodes"]})
        return server

    def kill_node(self, node_id: str) -> None:
        """SIGKILL the node and every process below it."""
        import psutil

        server = self.nodes.pop(node_id)
        assert server.process is not None
        try:
            tree = psutil.Process(server.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()
        for child in tree:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass

    def stop_node(self, node_id: str) -> None:
        """Stop the node gracefully (SIGTERM)."""
        self.nodes.pop(node_id).stop()

    def health(self) -> dict[str, Any]:
        assert self.gateway is not None
        return self.gateway.health()

    def wait_for(
        self, condition: Callable[[dict[str, Any]], bool], timeout: float = 60.0
    ) -> dict[str, Any]:
        """The first C{/health} that meets C{condition}, asked every 0.1 s."""
        deadline = time.monotonic() + timeout
        while True:
            health = self.health()
            if condition(health):
                return health
            if time.monotonic() > deadline:
                raise AssertionError(f"gateway never got there: {health['gateway']}")
            time.sleep(0.1)

    def wait_nodes(self, count: int, timeout: float = 120.0) -> dict[str, Any]:
        """Wait until exactly C{count} nodes are present."""
        return self.wait_for(lambda h: len(h["gateway"]["nodes"]) == count, timeout)

    def stop(self) -> None:
        for server in self.nodes.values():
            server.stop()
        self.nodes.clear()
        if self.gateway is not None:
            self.gateway.stop()
        self.nats.cleanup()
