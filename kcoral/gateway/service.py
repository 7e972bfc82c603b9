# -*- test-case-name: tests.unit.test_gateway_service -*-
"""
The gateway's service tree: L{GatewayConfig} and L{makeService}.

The root L{GatewayService} owns, in start order: the I/O thread pool, the
NATS bridge and the job queue on it (stream and buckets created, presence
and claims watched), the dispatcher's checks, and the HTTP ports.  It stops
in reverse: the ports first, then every waiting job is answered, then NATS.
"""

from __future__ import annotations

import asyncio
import ssl
import traceback
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import attrs
from attrs import field
from attrs.validators import ge, gt, in_, instance_of, optional
from twisted.application.service import MultiService
from twisted.internet.defer import CancelledError, Deferred, maybeDeferred
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool

from kcoral.config import LOG_LEVELS, ServerConfig
from kcoral.gateway.api import GatewayAPI, GatewaySettings, GatewaySite, PoolGuard
from kcoral.gateway.dispatch import Dispatcher
from kcoral.gateway.frontends import FrontEndsService, endpoint_port, node_port, node_url
from kcoral.gateway.jobs import DEFAULT_PRESENCE_TIMEOUT, Claim, Presence
from kcoral.gateway.natsbridge import NatsBridge, NatsCredentials, load_credentials
from kcoral.gateway.natsqueue import NatsJobQueue
from kcoral.gateway.pool import PoolView
from kcoral.server.cache import BlobStore, DiskFileCache, MemoryBlobCache
from kcoral.server.children import LogWriterService
from kcoral.server.frontends import listen_reusing_port
from kcoral.server.http.accept import AcceptGuard, raise_fd_limit
from kcoral.server.http.site import listen_all

__all__ = ["GatewayConfig", "GatewayService", "makeService"]

_P = ParamSpec("_P")
_T = TypeVar("_T")

#: Seconds between reads of the job stream's depth (for /health).
DEPTH_INTERVAL = 1.0

_SERVER_DEFAULTS = ServerConfig(disk_cache_dir=None)

#: Set when a gateway built with C{exit_on_failure} failed to start (the
#: C{kcoral gateway} command's exit status).
START_FAILED: list[str] = []


def _strings(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(str(v) for v in values)


@attrs.frozen(kw_only=True)
class GatewayConfig:
    """
    @ivar nats_urls: the NATS servers (C{nats://} or C{tls://}).
    @ivar credentials_file: the gateway's NATS credentials
        (L{kcoral.gateway.natsbridge.load_credentials}), or C{None}.
    @ivar nats_ca_file: CA bundle for C{tls://} NATS servers, or C{None}.
    @ivar endpoints: the HTTP listening ports (endpoint descriptions).
    @ivar public_url: the base URL nodes reach this gateway at.
    @ivar queue_size: the job stream's message limit.
    @ivar queue_timeout: seconds a job waits for a node before 503.
    @ivar presence_timeout: seconds a silent node counts as present.
    @ivar preference_window: seconds a job waits for the node a client named.
    @ivar log_dir: where the run directory with C{events.jsonl} goes
        (C{None}: no file logging); C{log_console} mirrors the events to
        standard error, C{log_level} is the least severe one kept (the
        server's C{--log-*} flags, L{kcoral.server.observe.logs}).
    """

    nats_urls: tuple[str, ...] = field(converter=_strings)
    credentials_file: Path | None = field(default=None, validator=optional(instance_of(Path)))
    nats_ca_file: Path | None = field(default=None, validator=optional(instance_of(Path)))
    endpoints: tuple[str, ...] = field(converter=_strings)
    public_url: str = field(validator=instance_of(str))
    auth_token_file: Path | None = field(default=None, validator=optional(instance_of(Path)))
    public_metrics: bool = False
    queue_size: int = field(default=1024, validator=[instance_of(int), ge(1)])
    queue_timeout: float = field(default=300.0, validator=gt(0))
    presence_timeout: float = field(default=DEFAULT_PRESENCE_TIMEOUT, validator=gt(0))
    preference_window: float = field(default=2.0, validator=ge(0))
    result_grace: float = field(default=60.0, validator=gt(0))
    max_request_bytes: int = field(default=_SERVER_DEFAULTS.max_request_bytes, validator=ge(1))
    max_response_bytes: int = field(default=_SERVER_DEFAULTS.max_response_bytes, validator=ge(1))
    cache_capacity_bytes: int = field(
        default=_SERVER_DEFAULTS.cache_capacity_bytes, validator=ge(0)
    )
    disk_cache_dir: Path | None = field(default=None, validator=optional(instance_of(Path)))
    disk_cache_mbytes: int = field(
        default=_SERVER_DEFAULTS.disk_cache_capacity_mbytes, validator=ge(0)
    )
    default_timeout_seconds: float = _SERVER_DEFAULTS.default_timeout_seconds
    max_timeout_seconds: float = _SERVER_DEFAULTS.max_timeout_seconds
    node_name: str = "kcoral-gateway"
    log_dir: Path | None = field(default=None, validator=optional(instance_of(Path)))
    log_console: bool = True
    log_level: str = field(default="info", validator=in_(LOG_LEVELS))
    #: The gateway saves no programs (its nodes do, with --log-dir).
    log_programs: bool = False
    #: Gateway processes sharing the client port (L{kcoral.gateway.frontends}).
    front_ends: int = field(default=1, validator=[instance_of(int), ge(1)])
    #: Which of them this process is (0: the first, which starts the others).
    front_end_index: int = field(default=0, validator=[instance_of(int), ge(0)])
    #: With several front ends: front end I{i}'s node port is this + I{i}
    #: (C{None}: the client port + 1).
    node_port: int | None = None


def _tls_context(ca_file: Path | None) -> ssl.SSLContext | None:
    if ca_file is None:
        return None
    return ssl.create_default_context(cafile=str(ca_file))


class GatewayService(MultiService):
    """The gateway: thread pool, NATS, dispatcher, HTTP."""

    log = Logger()

    def __init__(self, config: GatewayConfig, reactor: Any) -> None:
        super().__init__()
        self.config = config
        self._reactor = reactor
        self.threadpool = ThreadPool(minthreads=0, maxthreads=4, name="kcoral-gateway-io")
        # The events (request_finished, job_queued, node_joined...) go where
        # the server's go: the console and, with log_dir, events.jsonl.
        # Started first and stopped last by this service itself (not a
        # child), so that no event of the gateway's start or stop is lost.
        self.logs = LogWriterService(config, [], self._run_blocking, lambda _: None)
        self.pool = PoolView(presence_timeout=config.presence_timeout)
        several = config.front_ends > 1
        public_url = config.public_url
        if several:
            public_url = node_url(public_url, node_port(config))
        # Small results come back over NATS, on subjects of this process's own.
        results_key = uuid.uuid4().hex
        self.bridge = NatsBridge(
            reactor,
            list(config.nats_urls),
            credentials=NatsCredentials(),
            tls=_tls_context(config.nats_ca_file),
            name=config.node_name,
            on_connection=self._connection,
        )
        self.queue = NatsJobQueue(
            bridge=self.bridge,
            queue_size=config.queue_size,
            presence_timeout=config.presence_timeout,
            on_presence=self._presence,
            on_node_removed=self._node_removed,
            on_presence_loaded=self.pool.mark_loaded,
            on_claim=self._claim,
            queued_jobs=lambda: [
                job for job, pending in self.dispatcher.jobs.items() if pending.state == "queued"
            ],
            results_key=results_key,
            on_result=lambda node, headers, payload: self.api.result_message(
                node, headers, payload
            ),
        )
        self.dispatcher = Dispatcher(
            self.queue,
            self.pool,
            reactor,
            queue_timeout=config.queue_timeout,
            result_grace=config.result_grace,
        )
        memory = MemoryBlobCache(config.cache_capacity_bytes // config.front_ends)
        disk = DiskFileCache(config.disk_cache_dir, config.disk_cache_mbytes)
        self.blobs = BlobStore(memory, disk, self.threadpool, reactor)
        self.api = GatewayAPI(
            settings=GatewaySettings(
                public_url=public_url,
                queue_size=config.queue_size,
                queue_timeout=config.queue_timeout,
                preference_window=config.preference_window,
                max_request_bytes=config.max_request_bytes,
                default_timeout=config.default_timeout_seconds,
                max_timeout=config.max_timeout_seconds,
                front_end=config.front_end_index,
                front_ends=config.front_ends,
                results_key=results_key,
            ),
            dispatcher=self.dispatcher,
            pool=self.pool,
            queue=self.queue,
            blobs=self.blobs,
            threadpool=self.threadpool,
            reactor=reactor,
        )
        # Client tokens are read at start (L{_start}).
        self.guard = PoolGuard(self.api.resource(), self.dispatcher)
        defaults = _SERVER_DEFAULTS
        self.site = GatewaySite(
            self.guard,
            max_result_bytes=config.max_response_bytes + (1 << 20),
            max_request_bytes=config.max_request_bytes,
            header_timeout=defaults.header_timeout_seconds,
            body_timeout=defaults.body_timeout_seconds,
            max_connections=defaults.max_connections,
            max_connections_per_client=defaults.max_connections_per_client,
            first_header_timeout=defaults.first_header_timeout_seconds,
            max_bytes_in_flight=defaults.max_bytes_in_flight,
            max_bytes_per_client=defaults.max_bytes_per_client,
            body_stall_timeout=defaults.body_stall_seconds,
            reactor=reactor,
        )
        self.site.guard = self.guard
        self.site.relay_result = self.api.relay_result
        self.ports: list[Any] = []
        #: The other front ends, in the first of several (started once it listens).
        self.front_ends: FrontEndsService | None = None
        if several and config.front_end_index == 0:
            self.front_ends = FrontEndsService(config, reactor)
        self._guards: list[AcceptGuard] = []
        self._depth_call: Any = None
        #: Fires once the gateway listens (twistd ignores startService's result).
        self.ready: Deferred[None] = Deferred()
        self.ready.addErrback(lambda _: None)
        #: Stop the reactor when the start fails (C{twistd}, C{kcoral gateway}).
        self.exit_on_failure = False

    # -- NATS events, on the reactor thread ----------------------------------------

    def _connection(self, connected: bool) -> None:
        now = self._reactor.seconds()
        if connected:
            self.pool.resume(now)
            self.queue.connection_changed(True)
        else:
            self.pool.suspend()

    def _presence(self, presence: Presence) -> None:
        if self.pool.update(presence, self._reactor.seconds()):
            self.log.info(
                "node {node} joined: {seats} seats, {gpus} GPUs, class {compat}",
                kcoral_event="node_joined",
                node=presence.node,
                seats=presence.seats,
                gpus=presence.gpus,
                compat=presence.compat,
            )

    def _node_removed(self, node: str) -> None:
        if self.pool.remove(node):
            self.log.info("node {node} left", kcoral_event="node_left", node=node)

    def _claim(self, job: str, claim: Claim) -> None:
        self.dispatcher.claimed(job, claim)

    # -- life --------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self.threadpool.start()
        self.api.started_at = self._reactor.seconds()
        d = Deferred.fromCoroutine(self._start())

        def failed(failure: Any) -> None:
            self._start_failed("gateway failed to start: {error}", failure)
            if not self.ready.called:
                self.ready.errback(failure)
            if self.exit_on_failure:
                START_FAILED.append(str(failure.value))
                self._reactor.stop()

        d.addCallbacks(lambda _: self.ready.callback(None), failed)

    async def _start(self) -> None:
        config = self.config
        await self.logs.startService()
        if config.credentials_file is not None:
            self.bridge.credentials = load_credentials(str(config.credentials_file))
        if config.auth_token_file is not None:
            from kcoral.server.http.auth import TokenGuard, load_tokens

            self.guard.clients = TokenGuard(
                self.api.resource(),
                load_tokens(config.auth_token_file),
                public_metrics=config.public_metrics,
            )
        # NATS may come later: until it does, new work is answered 503 and
        # /health says so; nats-py keeps trying meanwhile.
        connected = self.bridge.start()
        connected.addCallback(lambda _: self.queue.setup())
        connected.addCallbacks(self._nats_ready, self._nats_failed)
        self.dispatcher.start()
        raise_fd_limit()
        if config.front_ends > 1:
            self.ports = self._listen_shared()
        else:
            self.ports = await listen_all(self._reactor, config.endpoints, self.site)
        for port in self.ports:
            accepting = AcceptGuard.install(port, self.site, self._reactor)
            if accepting is not None:
                self._guards.append(accepting)
            address = port.getHost()
            self.log.info(
                "gateway listening on {host}:{port}, nodes reach it at {public_url}",
                kcoral_event="server_listening",
                host=getattr(address, "host", None),
                port=getattr(address, "port", None),
                public_url=self.api.settings.public_url,
                front_end=config.front_end_index,
            )
        if self.front_ends is not None:
            self.front_ends.startService()

    def _listen_shared(self) -> list[Any]:
        """The client port shared with the other front ends, and this one's node port."""
        config = self.config
        first = config.front_end_index == 0
        shared = listen_reusing_port(self._reactor, config.endpoints[0], self.site, first)
        interface, _ = endpoint_port(config.endpoints[0])
        try:
            own = self._reactor.listenTCP(
                node_port(config), self.site, backlog=1024, interface=interface
            )
        except BaseException:
            shared.stopListening()
            raise
        return [shared, own]

    def _nats_ready(self, _: object) -> None:
        self.log.info(
            "job queue ready on {servers}",
            kcoral_event="nats_connection",
            name=self.bridge.name,
            state="ready",
            connected=True,
            servers=list(self.config.nats_urls),
        )
        self._refresh_depth()

    def _nats_failed(self, failure: Any) -> None:
        if failure.check(CancelledError, asyncio.CancelledError) or not self.running:
            return
        self._start_failed("gateway could not set up its job queue: {error}", failure)
        if self.exit_on_failure and self.running:
            START_FAILED.append(str(failure.value))
            self._reactor.stop()

    def _start_failed(self, text: str, failure: Failure) -> None:
        """The C{server_start_failed} event, naming the cause as the server's does."""
        self.log.error(
            text,
            kcoral_event="server_start_failed",
            error=f"{failure.type.__name__}: {failure.getErrorMessage()}",  # type: ignore[union-attr]
            traceback="".join(traceback.format_exception(failure.value))[-8192:],
        )

    def _refresh_depth(self) -> None:
        def again(_: object) -> None:
            if self.running:
                self._depth_call = self._reactor.callLater(DEPTH_INTERVAL, self._refresh_depth)

        self.queue.refresh_depth().addBoth(again)

    def stopService(self) -> Deferred[None]:
        return Deferred.fromCoroutine(self._stop())

    async def _stop(self) -> None:
        if self.front_ends is not None and self.front_ends.running:
            await self.front_ends.stopService()
        await maybeDeferred(super().stopService)
        if self._depth_call is not None and self._depth_call.active():
            self._depth_call.cancel()
        for guard in self._guards:
            guard.stop()
        for port in self.ports:
            await maybeDeferred(port.stopListening)
        self.ports = []
        self.dispatcher.stop()
        self.queue.stop()
        try:
            await self.bridge.stop()
        except Exception:
            self.log.failure("NATS bridge did not stop cleanly")
        if self.logs.running:
            await self.logs.stopService()
        self.threadpool.stop()

    def _run_blocking(
        self, f: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs
    ) -> Deferred[_T]:
        return deferToThreadPool(self._reactor, self.threadpool, f, *args, **kwargs)

    @property
    def port(self) -> Any:
        """The first listening port, or C{None}."""
        return self.ports[0] if self.ports else None


def makeService(config: GatewayConfig, reactor: Any = None) -> GatewayService:
    """The gateway's root service for C{config}."""
    if reactor is None:
        from twisted.internet import reactor as default

        reactor = default
    return GatewayService(config, reactor)
