# -*- test-case-name: tests.unit.test_service,tests.integration.test_server -*-
"""
The root service's children (L{kcoral.server.service.KCoralService}): each
part of the server as a service whose start and stop the root waits for.

  - L{ThreadPoolService}: the I/O thread pool;
  - L{LogWriterService}: the log observers, run directory and recorder;
  - L{CacheService}: the disk file cache, evicted to its capacity at start;
  - L{WorkerPoolService}: the sandbox probe and the worker pool;
  - L{LingerService}: at stop, the wait for the last HTTP connections;
  - L{ListeningPortService}: the HTTP ports.

The children that wire several front ends together are the topology's
(L{kcoral.server.topology}).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from twisted.application import service
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.interfaces import IListeningPort, IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import ILogObserver, Logger
from twisted.python.threadpool import ThreadPool
from twisted.web.server import Site

from kcoral.config import ServerConfig
from kcoral.server.cache import DiskFileCache
from kcoral.server.frontends import listen_reusing_port
from kcoral.server.http.accept import AcceptGuard, raise_fd_limit
from kcoral.server.http.auth import beyond_loopback
from kcoral.server.http.site import listen_all, port_hosts
from kcoral.server.leases.gpus import GpuDevice, discover_gpus, select_gpus
from kcoral.server.workers.reactor import RunBlocking

if TYPE_CHECKING:
    from kcoral.server.http.app import KcoralAPI
    from kcoral.server.leases.lease import Leases
    from kcoral.server.observe.logs import LogSettings, LogSetup
    from kcoral.server.workers.pool import WorkerPool

__all__ = [
    "DRAIN_LINGER_SECONDS",
    "AsyncService",
    "CacheService",
    "LingerService",
    "ListeningPortService",
    "LogWriterService",
    "Reactor",
    "RunBlocking",
    "ThreadPoolService",
    "WorkerPoolService",
]

#: The reactor the server runs on.  It is used for time, threads, processes
#: and TCP, which no single Twisted interface covers; each part receives it
#: typed as the interface it uses (C{IReactorTime} for the pool and leases).
Reactor = Any


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
        config: LogSettings,
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
        from kcoral.server.sandbox.probe import choose_sandbox

        config, pool = self._config, self.pool
        minors = None
        if config.device == "gpu":
            pool.maker.gpu_devices = await self._discover_gpus()
            minors = [device.minor for device in pool.maker.gpu_devices.values()]
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
                pool.maker.worker_env["KCORAL_COMPILE_CACHE_DIR"] = COMPILE_CACHE
                pool.maker.worker_env[COMPILE_IN_PARENT_ENV] = "1"
                compiler = IsolatedCompiles(
                    self._reactor, sandbox, str(compile_cache), self._root_dir, self._run_blocking
                )
                pool.maker.compiler = compiler
                from kcoral.server.workers.compileonly import (
                    ParentCompiles,
                    parent_compiles_allowed,
                )

                if config.device == "cpu" and parent_compiles_allowed():
                    # A program that only compiles needs no worker: the
                    # server compiles for it as it would for its worker.
                    self._api.parent_compiles = ParentCompiles(
                        compiler, self._reactor, self._run_blocking
                    )
            else:
                pool.maker.worker_env["KCORAL_COMPILE_CACHE_DIR"] = str(compile_cache)
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


class OpenConnections(Protocol):
    """What L{LingerService} reads of a site (a L{kcoral.server.http.site.KcoralSite})."""

    open_connections: int


class LingerService(AsyncService):
    """
    At stop, after the workers: wait until every HTTP connection has
    closed, at most L{DRAIN_LINGER_SECONDS}.  A proxy's pooled connection
    that carries one more request meanwhile gets a 503 and is closed (the
    site drains); only one idle for the whole linger is dropped at exit.
    Behind HAProxy a request sent on such a connection as the process
    exited was lost, in about one failover in five (test_haproxy).
    """

    def __init__(
        self, reactor: IReactorTime, site: OpenConnections, linger: float = DRAIN_LINGER_SECONDS
    ) -> None:
        self._reactor = reactor
        self._site = site
        self._linger = linger

    async def stop(self) -> None:
        deadline = self._reactor.seconds() + self._linger
        while self._site.open_connections > 0 and self._reactor.seconds() < deadline:
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
            # Heads are checked before their bodies are read (kcoral.server.http.request).
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
