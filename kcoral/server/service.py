# -*- test-case-name: tests.unit.test_service,tests.integration.test_server -*-
"""
L{KCoralService}: the root service, a L{MultiService} of the server's parts.

Its children, in start order (as buildbot's master holds its subsystems):

  - C{threads}: the I/O thread pool (blocking file work);
  - C{logs}: the log observers, run directory and program recorder;
  - C{caches}: the disk file cache (evicted to its capacity at start);
  - C{workers}: the sandbox probe and the worker pool, with its leases;
  - C{http}: the listening port (absent from L{create_app}'s service).

Construction does no I/O, so C{create_app(ServerConfig(...))} is cheap and
starts nothing.  The children start one after another, each once the one
before it is up (the order of the server spec), and C{ready} fires when all
are; they stop in reverse order, each once the one after it has stopped, so
the port closes first, in-flight requests finish, every worker exits, and
the logs close last.  With C{lame_duck_seconds}, a lame duck comes before
all that: C{/health} answers 503 C{stopping} for that long while every
request is still served, so a load balancer takes the node out of rotation
before its port closes.
"""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import sys
import traceback
import uuid
from collections.abc import Callable, MutableMapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from klein import Klein
from twisted.application import service
from twisted.internet.defer import CancelledError, Deferred, maybeDeferred
from twisted.internet.interfaces import IListeningPort
from twisted.internet.task import LoopingCall, deferLater
from twisted.internet.threads import deferToThreadPool
from twisted.logger import ILogObserver, Logger, globalLogPublisher
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool
from twisted.web.server import Site

from kcoral.config import ServerConfig
from kcoral.server.cache import BlobStore, DiskFileCache, MemoryBlobCache
from kcoral.server.frontends import (
    REPORT_INTERVAL,
    BrokerConnection,
    FrontEndsService,
    listen_reusing_port,
    share_of,
)
from kcoral.server.http.app import KcoralAPI
from kcoral.server.http.auth import beyond_loopback
from kcoral.server.http.site import (
    AcceptGuard,
    KcoralSite,
    listen_all,
    make_site,
    port_hosts,
    raise_fd_limit,
)
from kcoral.server.leases.broker import RemoteArbiter
from kcoral.server.leases.gpus import GpuDevice, discover_gpus, select_gpus
from kcoral.server.leases.lease import LeaseArbiter, Leases
from kcoral.server.sandbox.bubblewrap import NoSandbox
from kcoral.server.workers.pool import WorkerPool

if TYPE_CHECKING:
    from kcoral.server.observe.logs import LogSetup
    from kcoral.server.observe.metrics import Metrics
    from kcoral.server.observe.sdnotify import SystemdNotifier
    from kcoral.server.observe.status import RecentRequests

#: Runs a blocking callable in the I/O thread pool.
RunBlocking = Callable[..., Deferred[Any]]

#: The reactor the server runs on.  It is used for time, threads, processes
#: and TCP, which no single Twisted interface covers; each part receives it
#: typed as the interface it uses (C{IReactorTime} for the pool and leases).
Reactor = Any


def _reactor(reactor: Reactor | None) -> Reactor:
    if reactor is None:
        from twisted.internet import reactor as global_reactor

        return global_reactor
    return reactor


class AsyncService(service.Service):
    """
    A child service whose start and stop are coroutines: C{startService}
    and C{stopService} return their Deferreds, which the root waits for.
    """

    async def start(self) -> None:
        """Bring the part up (after C{running} is set)."""

    async def stop(self) -> None:
        """Take the part down (after C{running} is cleared)."""

    def startService(self) -> Deferred[None]:  # type: ignore[override]
        super().startService()
        return Deferred.fromCoroutine(self.start())

    def stopService(self) -> Deferred[None]:
        super().stopService()
        return Deferred.fromCoroutine(self.stop())


class ThreadPoolService(service.Service):
    """Starts and stops a L{ThreadPool} with the server."""

    def __init__(self, threadpool: ThreadPool) -> None:
        self.threadpool = threadpool

    def startService(self) -> None:
        super().startService()
        self.threadpool.start()

    def stopService(self) -> None:
        super().stopService()
        self.threadpool.stop()


class LogWriterService(AsyncService):
    """
    The server's log observers: installed at start (in a thread: they
    create the run directory), removed at stop.

    @ivar log_setup: the installed L{kcoral.server.observe.logs.LogSetup}.
    """

    log = Logger()

    def __init__(
        self,
        config: ServerConfig,
        observers: list[ILogObserver],
        run_blocking: RunBlocking,
        on_ready: Callable[[LogSetup], None],
    ) -> None:
        self._config = config
        self._observers = observers
        self._run_blocking = run_blocking
        self._on_ready = on_ready
        self.log_setup: LogSetup | None = None

    async def start(self) -> None:
        from kcoral.server.observe.logs import install_observers

        self.log_setup = await self._run_blocking(
            install_observers, self._config, extra_observers=self._observers, background=True
        )
        self._on_ready(self.log_setup)

    async def stop(self) -> None:
        self.log.info("server stopped", kcoral_event="server_stopped")
        if self.log_setup is not None:
            self.log_setup.close()
            self.log_setup = None


class CacheService(AsyncService):
    """The disk file cache, trimmed to its capacity before any request."""

    def __init__(self, disk_cache: DiskFileCache, run_blocking: RunBlocking) -> None:
        self._disk_cache = disk_cache
        self._run_blocking = run_blocking

    async def start(self) -> None:
        await self._run_blocking(self._disk_cache.evict)


class WorkerPoolService(AsyncService):
    """
    The worker pool: probes the sandbox and starts every worker; at stop,
    refuses new work, lets running requests finish, then stops the workers.
    """

    log = Logger()

    def __init__(
        self,
        config: ServerConfig,
        reactor: Reactor,
        pool: WorkerPool,
        leases: Leases,
        api: KcoralAPI,
        run_blocking: RunBlocking,
    ) -> None:
        self._config = config
        self._reactor = reactor
        self.pool = pool
        self._leases = leases
        self._api = api
        self._run_blocking = run_blocking
        self._root_dir: Path | None = None

    async def start(self) -> None:
        from kcoral.server.sandbox.bubblewrap import choose_sandbox

        config, pool = self._config, self.pool
        minors = None
        if config.device == "gpu":
            pool.gpu_devices = await self._discover_gpus()
            minors = [device.minor for device in pool.gpu_devices.values()]
        from kcoral.server.workers import scratch

        leftovers = await self._run_blocking(scratch.remove_leftovers)
        if leftovers:
            self.log.info(
                "removed {count} scratch directories of servers that are gone",
                kcoral_event="leftovers_removed",
                count=len(leftovers),
                names=leftovers,
            )
        self._root_dir = await self._run_blocking(scratch.make_root)
        sandbox = await choose_sandbox(
            self._reactor, config, self.log, gpu_minors=minors, scratch=self._root_dir
        )
        self._api.sandbox_name = sandbox.name
        pool.sandbox = sandbox
        pool.root_dir = self._root_dir
        compile_cache = await self._run_blocking(_compile_cache_dir, config)
        if compile_cache is not None:
            # Workers share one compile cache, so resubmitting a kernel skips
            # nvcc whichever worker gets it (docs/compilers.md).
            from kcoral.server.sandbox.bubblewrap import COMPILE_CACHE, BubblewrapSandbox

            if isinstance(sandbox, BubblewrapSandbox):
                from kcoral.compilers import COMPILE_IN_PARENT_ENV
                from kcoral.server.workers.compiles import IsolatedCompiles

                # Read-only for workers: the parent compiles into it, in a
                # sandbox where no uploaded code runs (docs/security.md).
                sandbox.compile_cache = str(compile_cache)
                pool.worker_env["KCORAL_COMPILE_CACHE_DIR"] = COMPILE_CACHE
                pool.worker_env[COMPILE_IN_PARENT_ENV] = "1"
                pool.compiler = IsolatedCompiles(
                    self._reactor, sandbox, str(compile_cache), self._root_dir, self._run_blocking
                )
            else:
                pool.worker_env["KCORAL_COMPILE_CACHE_DIR"] = str(compile_cache)
        await pool.start()
        self.log.info(
            "pool ready: {workers} workers, sandbox {sandbox}",
            kcoral_event="pool_ready",
            sandbox=sandbox.name,
            mode=config.device,
            target=pool.target,
            versions=pool.versions,
            workers=len(pool.seats),
        )

    async def _discover_gpus(self) -> dict[int, GpuDevice]:
        """The configured GPUs' device nodes and UUIDs, found without CUDA (in a thread)."""
        found = await self._run_blocking(discover_gpus)
        selected = select_gpus(found, self._config.distinct_gpus)
        self.log.info(
            "GPUs: {gpus}",
            kcoral_event="gpus_discovered",
            gpus=[device.as_log_dict() for device in selected.values()],
            discovered=len(found),
        )
        return selected

    async def stop(self) -> None:
        self._leases.close()
        # Queued requests get 503 now; running ones finish with their budgets.
        self.pool.stop_waiters()
        await self._api.wait_idle()
        await self.pool.stop()
        if self._root_dir is not None:
            await self._run_blocking(shutil.rmtree, self._root_dir, True)
        self.log.info("shutdown complete", kcoral_event="shutdown_complete")


#: How long a stopping server keeps answering (503, then closing the
#: connection) on keep-alive connections that are still open once its
#: programs are done, before it exits and drops them.
DRAIN_LINGER_SECONDS = 0.5


class LingerService(AsyncService):
    """
    At stop, after the workers: wait until every HTTP connection has
    closed, at most L{DRAIN_LINGER_SECONDS}.  A proxy's pooled connection
    that carries one more request meanwhile gets a 503 and is closed (the
    site drains); only one idle for the whole linger is dropped at exit.
    Behind HAProxy a request sent on such a connection as the process
    exited was lost, in about one failover in five (test_haproxy).
    """

    def __init__(self, reactor: Reactor, site: Any, linger: float = DRAIN_LINGER_SECONDS) -> None:
        self._reactor = reactor
        self._site = site
        self._linger = linger

    async def stop(self) -> None:
        deadline = self._reactor.seconds() + self._linger
        while getattr(self._site, "open_connections", 0) > 0 and self._reactor.seconds() < deadline:
            await deferLater(self._reactor, 0.02, lambda: None)


def _socket_mode(path: str | bytes) -> str | None:
    """The permission bits of the socket at C{path}, in octal (C{None}: gone)."""
    try:
        return oct(os.stat(path).st_mode & 0o777)
    except OSError:
        return None


class ListeningPortService(AsyncService):
    """
    The HTTP ports: listen at start, stop listening at stop.

    Like L{twisted.application.strports.service} for each C{--listen}
    endpoint, but its start returns the listening Deferred, so a port that
    cannot be bound fails the server's start, and the bound addresses are
    logged.  Before listening it raises the open-file limit and, with
    C{token_file}, puts the API behind L{kcoral.server.http.auth.TokenGuard}
    (the file is read in a thread); listening beyond loopback without a
    token is announced as a CRITICAL event.
    """

    log = Logger()

    def __init__(
        self,
        reactor: Reactor,
        endpoint: str | Sequence[str],
        site: Site,
        *,
        token_file: Path | None = None,
        public_metrics: bool = False,
        run_blocking: RunBlocking | None = None,
        reuse_port: bool = False,
        first: bool = True,
    ) -> None:
        self._reactor = reactor
        self._reuse_port = reuse_port
        self._first = first
        self._endpoints = (endpoint,) if isinstance(endpoint, str) else tuple(endpoint)
        self._site = site
        self._token_file = token_file
        self._public_metrics = public_metrics
        self._run_blocking = run_blocking
        self.ports: list[IListeningPort] = []
        self._guards: list[AcceptGuard] = []

    @property
    def port(self) -> IListeningPort | None:
        """The first listening port (C{None} when not listening)."""
        return self.ports[0] if self.ports else None

    async def start(self) -> None:
        limits = raise_fd_limit()
        if limits is not None and limits[0] != limits[1]:
            self.log.info(
                "open file limit raised from {old} to {new}",
                kcoral_event="fd_limit_raised",
                old=limits[0],
                new=limits[1],
            )
        fit = getattr(self._site, "fit_to_fd_limit", None)
        if fit is not None and limits is not None:
            wanted = self._site.max_connections  # type: ignore[attr-defined]
            cap = fit(limits[1])
            if cap != wanted:
                self.log.warn(
                    "serving at most {cap} connections, below the open-file limit {limit}",
                    kcoral_event="connection_cap_lowered",
                    cap=cap,
                    wanted=wanted,
                    limit=limits[1],
                )
        tokens = None
        if self._token_file is not None:
            from kcoral.server.http.auth import TokenGuard, load_tokens

            if self._run_blocking is None:
                tokens = load_tokens(self._token_file)
            else:
                tokens = await self._run_blocking(load_tokens, self._token_file)
            guard = TokenGuard(self._site.resource, tokens, public_metrics=self._public_metrics)
            self._site.resource = guard
            # Heads are checked before their bodies are read (kcoral.server.http.site).
            self._site.guard = guard  # type: ignore[attr-defined]
        if self._reuse_port:
            # Several front ends: each binds the same port (kcoral.server.frontends).
            self.ports = [
                listen_reusing_port(self._reactor, d, self._site, self._first)
                for d in self._endpoints
            ]
        else:
            self.ports = await listen_all(self._reactor, self._endpoints, self._site)
        for port in self.ports:
            # Running out of descriptors pauses accepting, quietly.
            accepting = AcceptGuard.install(port, self._site, self._reactor)  # type: ignore[arg-type]
            if accepting is not None:
                self._guards.append(accepting)
            address = port.getHost()
            self.log.info(
                "listening on {host}:{port}",
                kcoral_event="server_listening",
                host=getattr(address, "host", None),
                port=getattr(address, "port", None),
                path=getattr(address, "name", None),
                clients=None if tokens is None else [name for _, name in tokens.entries],
            )
        sockets = [
            path
            for path in (getattr(port.getHost(), "name", None) for port in self.ports)
            if path is not None
        ]
        if sockets and tokens is None:
            self.log.warn(
                "UNIX socket {paths} without --auth-token-file: every local user who can "
                "open it can run code on this machine",
                kcoral_event="unauthenticated_unix_socket",
                paths=[
                    p.decode("utf-8", "replace") if isinstance(p, bytes) else p for p in sockets
                ],
                modes=[_socket_mode(p) for p in sockets],
            )
        exposed = beyond_loopback(port_hosts(self.ports))
        if exposed and tokens is None:
            self.log.critical(
                "LISTENING BEYOND LOOPBACK ({addresses}) WITHOUT --auth-token-file: "
                "anyone who can reach this port can run code on this machine",
                kcoral_event="unauthenticated_exposure",
                addresses=exposed,
            )

    async def stop(self) -> None:
        ports, self.ports = self.ports, []
        guards, self._guards = self._guards, []
        for guard in guards:
            guard.stop()
        for port in ports:
            await maybeDeferred(port.stopListening)
        drain = getattr(self._site, "drain", None)
        if drain is not None:
            drain()


class _BrokerConnectionService(AsyncService):
    """A front end other than the first connects to the lease broker before anything else."""

    def __init__(self, reactor: Reactor, leases: RemoteArbiter, config: ServerConfig) -> None:
        assert config.lease_broker is not None
        self._connection = BrokerConnection(reactor, leases, config.lease_broker)

    async def start(self) -> None:
        await self._connection.start()

    async def stop(self) -> None:
        self._connection.stop()


#: The most packed metrics a front end's report carries (bytes).
METRICS_REPORT_LIMIT = 32_000


class _HealthReports(AsyncService):
    """Every second, this front end's own /health figures go to the others."""

    log = Logger()

    def __init__(
        self, reactor: Reactor, api: KcoralAPI, report: Callable[[int, dict[str, Any]], None]
    ) -> None:
        self._api = api
        self._report = report
        self._too_large_said = False
        self._loop = LoopingCall(self._send)
        self._loop.clock = reactor

    def send_now(self) -> None:
        """Report at once (the lame duck has begun: the others must say so too)."""
        try:
            self._send()
        except Exception:
            self.log.failure("a health report failed")

    def _send(self) -> None:
        health = self._api.local_health()
        if self._api.metrics is not None:
            from kcoral.server.observe.metrics import METRICS_REPORT_KEY, pack_families

            packed = pack_families(self._api.metrics.families())
            if len(packed) <= METRICS_REPORT_LIMIT:
                health[METRICS_REPORT_KEY] = packed
            elif not self._too_large_said:
                # An AMP value holds 64 KiB: the health figures must still go.
                self._too_large_said = True
                self.log.warn(
                    "this front end's metrics ({size} bytes packed) are too large to "
                    "report: the others' /metrics leave them out",
                    size=len(packed),
                )
        self._report(self._api.config.front_end_index, health)

    async def start(self) -> None:
        self._loop.start(REPORT_INTERVAL, now=True).addErrback(
            lambda failure: self.log.failure("health reports stopped", failure)
        )

    async def stop(self) -> None:
        if self._loop.running:
            self._loop.stop()


class _FrontEndsChild(AsyncService):
    """The first front end starts the others once it listens, and stops them first."""

    def __init__(self, front_ends: FrontEndsService, grace: float) -> None:
        self.front_ends = front_ends
        self._grace = grace

    async def start(self) -> None:
        self.front_ends.start()

    async def stop(self) -> None:
        await self.front_ends.stop(self._grace)


class KCoralService(service.MultiService):
    """
    The whole server, as a Twisted service tree.

    @ivar ready: fires when every child has started, or fails with the
        reason the server could not start (twistd ignores a Deferred from
        C{startService}).
    @ivar start_failure: that reason, as one line, once start has failed.
    """

    log = Logger()

    def __init__(
        self,
        config: ServerConfig,
        endpoint: str | Sequence[str] | None = None,
        *,
        reactor: Reactor | None = None,
    ) -> None:
        super().__init__()
        self.setName("kcoral")
        whole = config
        if config.front_ends > 1 and config.lease_broker is None:
            # The first of several front ends: its share of the caps (the
            # others get theirs from it, kcoral.server.frontends).
            config = share_of(config, 0, None)
        self.config = config
        self._reactor = _reactor(reactor)
        self.threadpool = ThreadPool(minthreads=0, maxthreads=4, name="kcoral-io")
        gpus = () if config.device == "cpu" else tuple(dict.fromkeys(config.gpus))
        self.leases: LeaseArbiter | RemoteArbiter
        if config.lease_broker is not None:
            # A front end other than the first: the first's broker decides.
            self.leases = RemoteArbiter(gpus, self._reactor)
        else:
            self.leases = LeaseArbiter(gpus, self._reactor)
        self.memory_cache = MemoryBlobCache(config.cache_capacity_bytes, self._cache_event)
        self.disk_cache = DiskFileCache(
            config.disk_cache_dir, config.disk_cache_capacity_mbytes, self._cache_event
        )
        self.blobs = BlobStore(self.memory_cache, self.disk_cache, self.threadpool, self._reactor)
        # The probed sandbox replaces NoSandbox when the workers start.
        self.pool = WorkerPool(
            config, self._reactor, self.leases, NoSandbox(), self.run_blocking, Path(".")
        )
        #: Endpoints that cannot work in this installation -> why.
        self.unavailable: dict[str, str] = {}
        self.metrics, self.recent = _observability(self)
        self.api = KcoralAPI(
            config,
            self.pool,
            self.leases,
            self.blobs,
            self.threadpool,
            self._reactor,
            metrics=self.metrics,
        )
        if self.recent is not None:
            from kcoral.server.observe.status import STATUS_PAGE, status_snapshot

            recent = self.recent
            self.api.status_snapshot = lambda health: status_snapshot(health, recent)
            self.api.status_page = STATUS_PAGE
        self.ready: Deferred[None] = Deferred()
        self.start_failure: str | None = None
        self._restore_signals: Any = None
        #: The lame duck's wait while it runs (L{_lame_duck_period}).
        self._lame_duck: Deferred[None] | None = None
        #: The process's exit status when the server fails to start under
        #: twistd; C{None} leaves the exit status to the caller.
        self.exit_status_on_failure: int | None = None
        #: Freeze the objects made while starting once the server is ready
        #: (L{gc.freeze}): they live as long as the process, and every full
        #: collection under load walked them again (60,000 objects, 26-38 ms
        #: a collection on a 2-core machine).  Set where the process is the
        #: server's own (L{makeService}); an embedding application keeps its
        #: collector as it is.
        self.freeze_when_ready = False
        #: Tell systemd (C{$NOTIFY_SOCKET}, a C{Type=notify} unit) when the
        #: server is ready (every worker is up) and when it begins to stop.
        #: Set where the process is the server's own (L{makeService}).
        self.notify_systemd = False
        #: Where C{$NOTIFY_SOCKET} is read from (and removed).
        self.environ: MutableMapping[str, str] = os.environ
        self._notifier: SystemdNotifier | None = None

        observers: list[ILogObserver] = [o for o in (self.metrics, self.recent) if o is not None]
        self.logs = LogWriterService(config, observers, self.run_blocking, self._logs_ready)
        children: list[service.Service] = [
            _named(ThreadPoolService(self.threadpool), "threads"),
            *(
                [_named(_BrokerConnectionService(self._reactor, self.leases, config), "broker")]
                if isinstance(self.leases, RemoteArbiter)
                else []
            ),
            _named(self.logs, "logs"),
            _named(CacheService(self.disk_cache, self.run_blocking), "caches"),
            _named(
                WorkerPoolService(
                    config, self._reactor, self.pool, self.leases, self.api, self.run_blocking
                ),
                "workers",
            ),
        ]
        if endpoint is not None and endpoint != ():
            site = make_site(self.api.resource(), config, reactor=self._reactor)
            http = ListeningPortService(
                self._reactor,
                endpoint,
                site,
                token_file=config.auth_token_file,
                public_metrics=config.public_metrics,
                run_blocking=self.run_blocking,
                reuse_port=config.front_ends > 1,
                first=config.lease_broker is None,
            )
            # Stopped in reverse order: the port, the workers, then the linger.
            children.insert(
                children.index(self.logs) + 2, _named(LingerService(self._reactor, site), "linger")
            )
            children.append(_named(http, "http"))
            if config.front_ends > 1 and isinstance(self.leases, LeaseArbiter):
                endpoints = (endpoint,) if isinstance(endpoint, str) else tuple(endpoint)
                front_ends = FrontEndsService(self._reactor, whole, endpoints, self.leases)
                children.append(
                    _named(
                        _FrontEndsChild(
                            front_ends, config.worker_termination_grace_seconds * 2 + 10
                        ),
                        "front-ends",
                    )
                )
                broker = front_ends.broker
                self.api.peer_health = lambda: broker.reports
                report: Callable[[int, dict[str, Any]], None] = broker.report
            elif config.front_ends > 1 and isinstance(self.leases, RemoteArbiter):
                remote = self.leases
                self.api.peer_health = lambda: remote.peer_reports
                report = remote.report
            if config.front_ends > 1:
                children.append(
                    _named(_HealthReports(self._reactor, self.api, report), "health-reports")
                )
        for child in children:
            child.setServiceParent(self)

    def run_blocking(self, f: Callable[..., Any], *args: Any, **kwargs: Any) -> Deferred[Any]:
        """Run blocking C{f} in the server's I/O thread pool."""
        return deferToThreadPool(self._reactor, self.threadpool, f, *args, **kwargs)

    def _cache_event(self, name: str, **fields: Any) -> None:
        if name in ("cache_hit", "cache_miss", "cache_stored"):
            self.log.debug("{kcoral_event} {cache}", kcoral_event=name, **fields)
        else:
            self.log.info("{kcoral_event} {cache}", kcoral_event=name, **fields)

    def _logs_ready(self, log_setup: LogSetup) -> None:
        """The logs are up: the run starts now (its first event)."""
        self.api.started_at = self._reactor.seconds()
        self.api.instance_id = str(uuid.uuid4())
        run_dir = log_setup.run_dir
        self.log.info(
            "kcoral server starting",
            kcoral_event="server_started",
            run_dir=None if run_dir is None else str(run_dir.path),
            config=self.config.as_log_dict(),
        )
        self._announce_unavailable()
        recorder = log_setup.recorder
        if recorder is not None:
            self.api.save_program = lambda rid, data: self.run_blocking(recorder.save, rid, data)
        self._start_retention(None if run_dir is None else run_dir.path)

    def _announce_unavailable(self) -> None:
        """Say at start-up which endpoints cannot work here, and why."""
        for endpoint, reason in self.unavailable.items():
            self.log.warn(
                "{endpoint} is unavailable: {error}",
                kcoral_event="endpoint_unavailable",
                endpoint=endpoint,
                error=reason,
            )

    def _start_retention(self, run_path: Path | None) -> None:
        """Prune old runs and saved programs hourly (docs/logs.md): a child started now."""
        from kcoral.server.observe.retention import RetentionPolicy, RetentionService

        policy = RetentionPolicy.from_config(self.config)
        if run_path is None or not policy.enabled:
            return
        RetentionService(
            run_path.parent, run_path, policy, self.run_blocking, self._reactor
        ).setServiceParent(self)

    # -- start and stop ---------------------------------------------------------

    def startService(self) -> None:
        service.Service.startService(self)
        if self.notify_systemd and self.config.lease_broker is None:
            # Only the first front end speaks for the server (NotifyAccess=main).
            from kcoral.server.observe.sdnotify import SystemdNotifier

            self._notifier = SystemdNotifier.from_environment(self.environ)
        d = Deferred.fromCoroutine(self._start_children())
        d.addCallbacks(self._started, self._start_failed)

    def _started(self, _: object) -> None:
        if self.freeze_when_ready:
            gc.collect()
            gc.freeze()
        if self._notifier is not None:
            workers = len(self.pool.seats)
            self._notifier.notify("READY=1", f"STATUS=serving with {workers} worker(s)")
        self.ready.callback(None)

    async def _start_children(self) -> None:
        for child in list(self):
            await maybeDeferred(child.startService)

    def _start_failed(self, failure: Failure) -> None:
        message = f"{failure.type.__name__}: {failure.getErrorMessage()}"  # type: ignore[union-attr]
        console = None
        if self.logs.log_setup is None and self.config.log_console:
            # The console mirror is not installed yet (the log directory
            # itself may be the cause): show the cause on the console anyway.
            # (Under plain twistd log_console is off: twistd's log shows it.)
            from kcoral.server.observe.logs import ConsoleObserver

            console = ConsoleObserver()
            globalLogPublisher.addObserver(console)
        try:
            self.log.error(
                "server failed to start: {error}",
                kcoral_event="server_start_failed",
                error=message,
                traceback="".join(traceback.format_exception(failure.value))[-8192:],
            )
        finally:
            if console is not None:
                globalLogPublisher.removeObserver(console)
        self.start_failure = message
        if self._notifier is not None:
            self._notifier.notify(f"STATUS=failed to start: {message}")
        self.ready.errback(failure)
        if self.running and self.parent is not None:
            # Under twistd (kcoral server, twistd -n kcoral, a .tac): stop
            # the process, and make it exit non-zero so a supervisor sees
            # the failure (systemd Restart=on-failure).
            if self._reactor.running:
                self._reactor.stop()
            else:
                self._reactor.callWhenRunning(self._reactor.stop)
            if self.exit_status_on_failure is not None:
                atexit.register(_exit_with, self.exit_status_on_failure)

    def stopService(self) -> Deferred[None]:
        service.Service.stopService(self)
        if self._notifier is not None:
            self._notifier.notify("STOPPING=1", "STATUS=stopping")
        self.log.info(
            "shutdown requested; finishing {remaining} request(s)",
            kcoral_event="shutdown_started",
            remaining=self.api.in_flight,
        )
        self._restore_signals = install_second_signal(self._reactor, self.stop_now)
        d = Deferred.fromCoroutine(self._stop())

        def restore(result: object) -> object:
            restore_signals, self._restore_signals = self._restore_signals, None
            if restore_signals is not None:
                restore_signals()
            return result

        return d.addBoth(restore)

    def stop_now(self) -> None:
        """
        A second SIGTERM or SIGINT during a graceful stop: kill every worker
        now.  Their requests are answered at once (FAILED C{runtime} inside an
        instruction, else 500 C{worker crashed});
        queued ones already had their 503; the stop then completes without
        waiting for any budget or grace.
        """
        lame_duck, self._lame_duck = self._lame_duck, None
        if lame_duck is not None:
            lame_duck.cancel()
        killed = self.pool.kill_now()
        self.log.warn(
            "second stop signal: killed {killed} worker(s), failing {remaining} request(s)",
            kcoral_event="shutdown_forced",
            killed=killed,
            remaining=self.api.in_flight,
        )

    async def _stop(self) -> None:
        await self._lame_duck_period()
        await self._stop_children()

    async def _lame_duck_period(self) -> None:
        """
        With C{lame_duck_seconds}, before anything stops: C{/health} answers
        503 C{stopping} while every request, new ones included, is still
        served, so a load balancer marks the node down and sends it nothing
        more before its ports close (docs/deployment.md).  Only a server
        with ports has one, and only the first of several front ends (the
        others' C{/health} follows its report; it stops them afterwards).
        """
        seconds = self.config.lame_duck_seconds
        if seconds <= 0 or "http" not in self.namedServices or not self.ready.called:
            return  # no lame duck, or the server never came up
        if self.start_failure is not None or self.config.lease_broker is not None:
            return
        self.api.stopping = True
        reports = self.namedServices.get("health-reports")
        if isinstance(reports, _HealthReports) and reports.running:
            reports.send_now()
        self.log.info(
            "lame duck: /health answers 503 for {seconds} s while requests are still served",
            kcoral_event="lame_duck_started",
            seconds=seconds,
            remaining=self.api.in_flight,
        )
        self._lame_duck = deferLater(self._reactor, seconds, lambda: None)
        try:
            await self._lame_duck
        except CancelledError:
            pass  # a second stop signal: stop at once
        self._lame_duck = None

    async def _stop_children(self) -> None:
        # Whatever fails, the children before it still stop: the logs close
        # and the I/O threads (not daemon threads) end.
        for child in reversed(list(self)):
            if child.running:
                try:
                    await maybeDeferred(child.stopService)
                except Exception:
                    self.log.failure("error while stopping {child}", child=child.name)


def _named(child: service.Service, name: str) -> service.Service:
    child.setName(name)
    return child


def _compile_cache_dir(config: ServerConfig) -> Path | None:
    """
    Blocking: the compile cache directory beside the disk file cache
    (C{~/.cache/kcoral/compile} by default), created 0700; C{None} when the
    disk cache is disabled or the directory cannot be made.
    """
    if config.disk_cache_dir is None or config.disk_cache_capacity_mbytes == 0:
        return None
    path = Path(config.disk_cache_dir).parent / "compile"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return None
    return path


def _observability(server: KCoralService) -> tuple[Metrics | None, RecentRequests | None]:
    """
    The metrics and recent-requests observers, when their modules import.

    An endpoint that cannot work is recorded in C{server.unavailable}
    (endpoint -> reason) and announced at start-up, never dropped silently.
    """
    try:
        from kcoral.server.observe.metrics import Metrics
    except ImportError as e:
        server.unavailable["/metrics"] = (
            f"{e} (install the server extra: pip install 'kcoral-server[server]')"
        )
        Metrics = None  # type: ignore[assignment,misc]
    try:
        from kcoral.server.observe.status import RecentRequests
    except ImportError as e:
        for endpoint in ("/status", "/status.json"):
            server.unavailable[endpoint] = str(e)
        RecentRequests = None  # type: ignore[assignment,misc]

    def state() -> dict[str, Any]:
        pool = server.pool
        return {
            "queue_length": pool.queue_length,
            "active_requests": pool.active,
            "request_capacity": pool.capacity,
            "cache_bytes": {
                "memory": server.memory_cache.size_bytes,
                "disk": server.disk_cache.tally_bytes or 0,
            },
            "lease_depth": {gpu: server.leases.depth(gpu) for gpu in server.leases.gpus},
            "spare_workers": _spare_counts(pool.spares),
        }

    return (
        None if Metrics is None else Metrics(state),
        None if RecentRequests is None else RecentRequests(),
    )


def _spare_counts(spares: list[Any]) -> dict[tuple[Any, str], int]:
    """Spares by (GPU, or C{cpu}; state), for the C{kcoral_spare_workers} gauge."""
    counts: dict[tuple[Any, str], int] = {}
    for spare in spares:
        key = ("cpu" if spare.gpu_id is None else spare.gpu_id, spare.status)
        counts[key] = counts.get(key, 0) + 1
    return counts


def install_second_signal(reactor: Reactor, stop_now: Callable[[], None]) -> Any:
    """
    Route the next SIGTERM or SIGINT to C{stop_now} (in the reactor thread)
    while a graceful stop runs; returns a callable that puts the previous
    handlers back.  Off the main thread (tests) nothing is installed.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    previous: dict[int, Any] = {}

    def handler(signum: int, frame: Any) -> None:
        reactor.callFromThread(stop_now)

    for signum in (signal.SIGTERM, signal.SIGINT):
        try:
            previous[signum] = signal.signal(signum, handler)
        except (ValueError, OSError):
            pass

    def restore() -> None:
        for signum, old in previous.items():
            try:
                signal.signal(signum, old)
            except (ValueError, OSError, TypeError):
                pass

    return restore


def makeService(
    config: ServerConfig, endpoint: str | Sequence[str], *, reactor: Reactor | None = None
) -> KCoralService:
    """
    Build the root service for C{config}, serving HTTP on C{endpoint}.

    This is the twistd entry point (the C{kcoral} plugin and
    C{contrib/kcoral.tac}): a server that fails to start makes the process
    exit with status 1 once twistd has shut down, and under a systemd
    C{Type=notify} unit it sends C{READY=1} once every worker is up and
    C{STOPPING=1} when it begins to stop (L{kcoral.server.observe.sdnotify}).
    """
    root = KCoralService(config, endpoint, reactor=reactor)
    root.exit_status_on_failure = 1
    root.freeze_when_ready = True
    root.notify_systemd = True
    return root


def _exit_with(status: int) -> None:
    """
    End the process with C{status} (an C{atexit} hook: twistd itself always
    exits 0 after its reactor stops).
    """
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass
    os._exit(status)


def create_app(config: ServerConfig | None = None, *, reactor: Reactor | None = None) -> Klein:
    """
    The Klein app for C{config}; nothing starts until its service does.

    The service that owns the workers is C{app.kcoral_service}: attach it to
    an application (C{setServiceParent}) or call C{startService()} and wait
    for C{service.ready} before serving; serve it with L{create_site}.
    """
    server = KCoralService(config or ServerConfig(), None, reactor=reactor)
    app = server.api.app
    app.kcoral_service = server  # type: ignore[attr-defined]
    return app


def create_site(app: Klein) -> KcoralSite:
    """
    The site to serve C{app} (made by L{create_app}) with: the server's own
    L{kcoral.server.http.site.KcoralSite}, under its config's request limits and
    deadlines (C{max_request_bytes}, the head and body timeouts, the
    connection cap, C{max_bytes_in_flight}), with request bodies parsed as
    they arrive, behind the token guard when C{auth_token_file} is set (the
    file is read now).  A plain L{Site} over C{app.resource()} has none of
    these: it would buffer any body, wait on any trickle, and skip the tokens.

    Listen with it as you would with any site, for instance
    C{strports.service("tcp:8000:interface=127.0.0.1", create_site(app))}.
    """
    server: KCoralService = app.kcoral_service  # type: ignore[attr-defined]
    config = server.config
    tokens = None
    if config.auth_token_file is not None:
        from kcoral.server.http.auth import load_tokens

        tokens = load_tokens(config.auth_token_file)
    return make_site(app.resource(), config, tokens, reactor=server._reactor)
