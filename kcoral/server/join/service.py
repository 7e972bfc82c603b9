# -*- test-case-name: tests.integration.test_node_join -*-
"""
The C{join} child of a server started with C{--join}: the node's life in
the pool, tied to the server's.

At start (after the HTTP port listens and the workers are up),
L{JoinService}:

  1. reads its server's own health (in process): target and versions (the
     compatibility class), GPU count and seats;
  2. tries its NATS credentials once: credentials nats-server refuses stop
     the server's start (exit status 1) with the reason; an unreachable
     nats-server does not (the node keeps trying in the background);
  3. connects (L{kcoral.gateway.natsbridge.NatsBridge}, reconnecting for
     ever), binds its job consumers, and starts its presence key and its
     seat loop.  A pool whose stream or buckets do not exist yet (no
     gateway has started) is retried with a backoff.

At stop it stops pulling, waits for the jobs it holds to post their
results, deletes its presence key and closes the connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from kcoral.config import ServerConfig
from kcoral.gateway.jobs import Presence, compat_key, node_inbox
from kcoral.gateway.natsbridge import NatsBridge, NatsCredentials, load_credentials
from kcoral.server.children import AsyncService
from kcoral.server.join.natsresult import NatsResults
from kcoral.server.join.presence import PresenceAnnouncer
from kcoral.server.join.puller import JobPuller
from kcoral.server.join.queue import NatsJobQueue
from kcoral.server.join.runner import BytesInFlight, JobRunner
from kcoral.server.join.transfer import GatewayLink

if TYPE_CHECKING:
    from kcoral.server.http.app import KcoralAPI
    from kcoral.server.workers.pool import WorkerPool

__all__ = ["JoinRefused", "JoinService", "free_seats", "probe_credentials"]

#: Seconds between attempts to bind the pool's consumers while it has none.
PREPARE_RETRY_SECONDS = 2.0


def free_seats(pool: WorkerPool) -> int:
    """
    The pool's seats that would take a program now: idle ones (their worker
    up) that no queued request is owed.  A busy seat, or one whose worker
    is being replaced, is not free.
    """
    if pool.closing:
        return 0
    idle = sum(1 for seat in pool.seats if seat.status == "idle")
    return max(0, idle - pool.queue_length)


class JoinRefused(Exception):
    """nats-server refused the node's credentials."""


def probe_credentials(servers: Sequence[str], credentials: NatsCredentials) -> str | None:
    """
    Blocking (a thread): connect once, without retrying.  C{None} when
    nats-server took the credentials or could not be reached (the node
    then keeps trying); the refusal's text when it refused them.
    """
    import nats

    errors: list[str] = []

    async def error_cb(e: Exception) -> None:
        errors.append(str(e))

    async def attempt() -> None:
        client = await nats.connect(
            servers=list(servers),
            allow_reconnect=False,
            max_reconnect_attempts=0,
            connect_timeout=3,
            error_cb=error_cb,
            **credentials.connect_options(),
        )
        await client.close()

    try:
        asyncio.run(attempt())
    except Exception as e:
        errors.append(str(e))
    refusals = [e for e in errors if "authorization" in e.lower() or "authentication" in e.lower()]
    return refusals[0] if refusals else None


class JoinService(AsyncService):
    """
    The node's part in a pool (a child service of L{kcoral.server.service.KCoralService}).

    @param api: the server's execute pipeline, which runs the pool's jobs
        in process.
    @param run_blocking: runs a blocking call in the server's thread pool.
    @param in_flight: the server's bytes in flight (its HTTP site), which
        the jobs' fetched blobs and results count against.
    """

    log = Logger()

    def __init__(
        self,
        config: ServerConfig,
        reactor: Any,
        api: KcoralAPI,
        run_blocking: Callable[..., Deferred[Any]],
        in_flight: BytesInFlight | None = None,
    ) -> None:
        assert config.join_url is not None and config.join_node_id is not None
        assert config.join_credentials is not None
        self.config = config
        self._reactor = reactor
        self.api = api
        self._in_flight = in_flight
        self._run_blocking = run_blocking
        self.node_id: str = config.join_node_id
        self.servers = [url.strip() for url in config.join_url.split(",")]
        self.bridge: NatsBridge | None = None
        self.queue: NatsJobQueue | None = None
        self.puller: JobPuller | None = None
        self.presence: PresenceAnnouncer | None = None
        self._prepare_retry: IDelayedCall | None = None
        self._stopping = False

    # -- start ------------------------------------------------------------------

    async def start(self) -> None:
        from twisted.web.client import Agent, HTTPConnectionPool

        config = self.config
        credentials: NatsCredentials = await self._run_blocking(
            load_credentials, str(config.join_credentials)
        )
        connections = HTTPConnectionPool(self._reactor, persistent=True)
        connections.maxPersistentPerHost = 64
        agent = Agent(self._reactor, pool=connections)
        health = self.api.local_health()
        target, versions = dict(health["target"]), dict(health["versions"])
        gpus = int(health["gpu_count"])
        workers = self.api.pool
        seats = workers.capacity
        compat = compat_key(target, versions)
        refusal = await self._run_blocking(probe_credentials, self.servers, credentials)
        if refusal is not None:
            raise JoinRefused(
                f"nats-server refused the credentials of node {self.node_id}: {refusal}"
            )
        self.bridge = NatsBridge(
            self._reactor,
            self.servers,
            credentials,
            name=f"kcoral-node-{self.node_id}",
            on_connection=self._connection,
            inbox_prefix=node_inbox(self.node_id),
        )
        self.queue = NatsJobQueue(self.bridge, self.node_id, compat, gpus)
        link = GatewayLink(agent, self._reactor, self.node_id, run_blocking=self._run_blocking)
        runner = JobRunner(
            self.api,
            link,
            self._reactor,
            config.max_request_bytes,
            self._in_flight,
            nats=NatsResults(self.bridge, self.node_id, self._reactor),
        )
        self.presence = PresenceAnnouncer(
            self.queue,
            self._reactor,
            Presence(
                node=self.node_id,
                compat=compat,
                target=target,
                versions=versions,
                gpus=gpus,
                seats=seats,
                free=seats,
            ),
            free=lambda: self.puller.free if self.puller is not None else 0,
        )
        self.puller = JobPuller(
            self.queue,
            self._reactor,
            self.node_id,
            seats,
            lambda: free_seats(workers),
            lambda job, seated, won: Deferred.fromCoroutine(runner.run(job, seated, won)),
            on_change=self.presence.changed,
            reprepare=self.queue.prepare,
        )
        self.log.info(
            "node {node} joining the pool at {servers}: compatibility {compat}, "
            "{gpus} GPU(s), {seats} seat(s), consumers {consumers}",
            kcoral_event="join_starting",
            node=self.node_id,
            servers=self.servers,
            compat=compat,
            gpus=gpus,
            seats=seats,
            consumers=self.queue.consumers(),
        )
        d = self.bridge.start()
        d.addCallback(self._bridged)
        d.addCallbacks(self._connected, self._never_connected)
        d.addErrback(self._bug)

    def _bridged(self, result: object) -> object:
        inline = self.bridge is not None and self.bridge.inline
        self.log.info(
            "node {node}: NATS client on {where}",
            kcoral_event="join_nats_client",
            node=self.node_id,
            where="the reactor's loop" if inline else "a thread of its own",
            inline=inline,
        )
        return result

    def _connected(self, _: object) -> None:
        if self._stopping or self.queue is None:
            return
        d = self.queue.prepare()
        d.addCallbacks(self._prepared, self._prepare_failed)
        d.addErrback(self._bug)

    def _prepared(self, _: object) -> None:
        if self._stopping:
            return
        assert self.presence is not None and self.puller is not None
        self.log.info(
            "node {node} joined the pool: pulling {seats} seat(s)",
            kcoral_event="join_joined",
            node=self.node_id,
            seats=self.puller.seats,
        )
        self.presence.start()
        self.api.pool.line.offered.append(self.puller.seat_freed)
        self.puller.start()

    def _prepare_failed(self, failure: Failure) -> None:
        if self._stopping:
            return
        self.log.warn(
            "node {node} cannot bind the pool's job queue yet ({error}); "
            "is a gateway running? retrying in {delay} s",
            kcoral_event="join_waiting",
            node=self.node_id,
            error=failure.getErrorMessage(),
            delay=PREPARE_RETRY_SECONDS,
        )
        self._prepare_retry = self._reactor.callLater(PREPARE_RETRY_SECONDS, self._connected, None)

    def _never_connected(self, failure: Failure) -> None:
        if not self._stopping:
            self.log.failure("node {node}: NATS connection failed", failure, node=self.node_id)

    def _connection(self, connected: bool) -> None:
        if connected:
            self.log.info(
                "node {node}: NATS connection up",
                kcoral_event="join_nats_up",
                node=self.node_id,
            )
            if self.puller is not None and self.queue is not None and self.queue.prepared:
                self.puller.kick()
            return
        if self._stopping:
            return
        self.log.warn(
            "node {node}: NATS connection lost; running jobs still post their results "
            "over HTTP; reconnecting",
            kcoral_event="join_nats_lost",
            node=self.node_id,
            running=self.puller.busy if self.puller is not None else 0,
        )

    def _bug(self, failure: Failure) -> None:
        self.log.failure("join service error", failure)

    # -- stop -------------------------------------------------------------------

    async def stop(self) -> None:
        self._stopping = True
        if self._prepare_retry is not None and self._prepare_retry.active():
            self._prepare_retry.cancel()
        if self.puller is not None:
            if self.puller.seat_freed in self.api.pool.line.offered:
                self.api.pool.line.offered.remove(self.puller.seat_freed)
            running = self.puller.busy
            if running:
                self.log.info(
                    "node {node} leaving the pool: waiting for {running} job(s)",
                    kcoral_event="join_leaving",
                    node=self.node_id,
                    running=running,
                )
            await self.puller.stop()
        if self.queue is not None:
            # The pull in flight ends now, so the connection closes at once.
            self.queue.close()
        if self.presence is not None and self.bridge is not None and self.bridge.connected:
            await self.presence.stop()
        if self.bridge is not None:
            try:
                await self.bridge.stop()
            except Exception:
                self.log.failure("node {node}: closing NATS failed", node=self.node_id)
