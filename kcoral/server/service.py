# -*- test-case-name: tests.integration.test_server -*-
"""
L{KCoralService}: the root service that owns a server's workers, caches,
leases, logs and HTTP port.

Construction does no I/O, so C{create_app(ServerConfig(...))} is cheap and
starts nothing.  C{startService} brings things up in the order of the server
spec (logs, caches, sandbox probe, workers, then the port) and exposes the
result as C{ready}; C{stopService} stops accepting, lets in-flight requests
finish, then stops every worker.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import traceback
import uuid
from pathlib import Path
from typing import Any

from twisted.application import service
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import serverFromString
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger, globalLogPublisher
from twisted.python.threadpool import ThreadPool

from kcoral.config import ServerConfig
from kcoral.server.app import KcoralAPI
from kcoral.server.cache import BlobStore, DiskFileCache, MemoryBlobCache
from kcoral.server.gpus import GpuDevice, discover_gpus, select_gpus
from kcoral.server.http import KcoralSite
from kcoral.server.lease import LeaseArbiter
from kcoral.server.pool import WorkerPool

#: Set when a server started by twistd failed to start, so `kcoral server`
#: can exit non-zero after the reactor stops.
start_failures: list[str] = []


def _reactor(reactor: Any) -> Any:
    if reactor is None:
        from twisted.internet import reactor as global_reactor

        return global_reactor
    return reactor


class KCoralService(service.MultiService):
    """The whole server, as a Twisted service."""

    log = Logger()

    def __init__(
        self, config: ServerConfig, endpoint: str | None = None, *, reactor: Any = None
    ) -> None:
        super().__init__()
        self.setName("kcoral")
        self.config = config
        self.endpoint = endpoint
        self._reactor = _reactor(reactor)
        self.threadpool = ThreadPool(minthreads=0, maxthreads=4, name="kcoral-io")
        gpus = () if config.device == "cpu" else tuple(dict.fromkeys(config.gpus))
        self.leases = LeaseArbiter(gpus, self._reactor)
        self.memory_cache = MemoryBlobCache(config.cache_capacity_bytes, self._cache_event)
        self.disk_cache = DiskFileCache(
            config.disk_cache_dir, config.disk_cache_capacity_mbytes, self._cache_event
        )
        self.blobs = BlobStore(self.memory_cache, self.disk_cache, self.threadpool, self._reactor)
        self.pool = WorkerPool(
            config, self._reactor, self.leases, None, self.run_blocking, Path(".")
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
            from kcoral.server.status import STATUS_PAGE, status_snapshot

            recent = self.recent
            self.api.status_snapshot = lambda health: status_snapshot(health, recent)
            self.api.status_page = STATUS_PAGE
        self.ready: Deferred[None] = Deferred()
        self.port: Any = None
        self.log_setup: Any = None
        self._root_dir: Path | None = None
        #: The process's exit status when the server fails to start under
        #: twistd; C{None} leaves the exit status to the caller.
        self.exit_status_on_failure: int | None = None

    def run_blocking(self, f: Any, *args: Any, **kwargs: Any) -> Deferred[Any]:
        """Run blocking C{f} in the server's I/O thread pool."""
        return deferToThreadPool(self._reactor, self.threadpool, f, *args, **kwargs)

    def _cache_event(self, name: str, **fields: Any) -> None:
        if name in ("cache_hit", "cache_miss", "cache_stored"):
            self.log.debug("{kcoral_event} {cache}", kcoral_event=name, **fields)
        else:
            self.log.info("{kcoral_event} {cache}", kcoral_event=name, **fields)

    # -- start ------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self.threadpool.start()
        d = Deferred.fromCoroutine(self._start())
        d.addCallbacks(self.ready.callback, self._start_failed)

    def _start_failed(self, failure: Any) -> None:
        message = f"{failure.type.__name__}: {failure.getErrorMessage()}"
        console = None
        if self.log_setup is None and self.config.log_console:
            # The console mirror is not installed yet (the log directory
            # itself may be the cause): show the cause on the console anyway.
            # (Under plain twistd log_console is off: twistd's log shows it.)
            from kcoral.server.logs import ConsoleObserver

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
        start_failures.append(message)
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

    def _announce_unavailable(self) -> None:
        """Say at start-up which endpoints cannot work here, and why."""
        for endpoint, reason in self.unavailable.items():
            self.log.warn(
                "{endpoint} is unavailable: {error}",
                kcoral_event="endpoint_unavailable",
                endpoint=endpoint,
                error=reason,
            )

    async def _start(self) -> None:
        config = self.config
        from kcoral.server.logs import install_observers

        observers = [o for o in (self.metrics, self.recent) if o is not None]
        self.log_setup = await self.run_blocking(
            install_observers, config, extra_observers=observers
        )
        started = self._reactor.seconds()
        self.api.started_at = started
        self.api.instance_id = str(uuid.uuid4())
        run_dir = getattr(self.log_setup, "run_dir", None)
        self.log.info(
            "kcoral server starting",
            kcoral_event="server_started",
            run_dir=None if run_dir is None else str(getattr(run_dir, "path", run_dir)),
            config=config.as_log_dict(),
        )
        self._announce_unavailable()
        recorder = getattr(self.log_setup, "recorder", None)
        if recorder is not None:
            self.api.save_program = lambda rid, data: self.run_blocking(recorder.save, rid, data)
        self._start_retention(getattr(run_dir, "path", None))
        await self.run_blocking(self.disk_cache.evict)

        from kcoral.server.sandbox import choose_sandbox

        minors = None
        if config.device == "gpu":
            self.pool.gpu_devices = await self._discover_gpus()
            minors = [device.minor for device in self.pool.gpu_devices.values()]
        from kcoral.server import scratch

        leftovers = await self.run_blocking(scratch.remove_leftovers)
        if leftovers:
            self.log.info(
                "removed {count} scratch directories of servers that are gone",
                kcoral_event="leftovers_removed",
                count=len(leftovers),
                names=leftovers,
            )
        self._root_dir = await self.run_blocking(scratch.make_root)
        sandbox = await choose_sandbox(
            self._reactor, config, self.log, gpu_minors=minors, scratch=self._root_dir
        )
        self.api.sandbox_name = sandbox.name
        self.pool.sandbox = sandbox
        self.pool.root_dir = self._root_dir
        compile_cache = await self.run_blocking(_compile_cache_dir, config)
        if compile_cache is not None:
            # Workers share one compile cache, so resubmitting a kernel skips
            # nvcc whichever worker gets it (docs/compilers.md).
            from kcoral.server.sandbox import COMPILE_CACHE, BubblewrapSandbox

            if isinstance(sandbox, BubblewrapSandbox):
                sandbox.compile_cache = str(compile_cache)
                self.pool.worker_env["KCORAL_COMPILE_CACHE_DIR"] = COMPILE_CACHE
            else:
                self.pool.worker_env["KCORAL_COMPILE_CACHE_DIR"] = str(compile_cache)
        await self.pool.start()
        self.log.info(
            "pool ready: {workers} workers, sandbox {sandbox}",
            kcoral_event="pool_ready",
            sandbox=sandbox.name,
            mode=config.device,
            target=self.pool.target,
            versions=self.pool.versions,
            workers=len(self.pool.seats),
        )
        if self.endpoint is not None:
            site = KcoralSite(self.api.resource(), max_request_bytes=config.max_request_bytes)
            self.port = await serverFromString(self._reactor, self.endpoint).listen(site)
            address = self.port.getHost()
            self.log.info(
                "listening on {host}:{port}",
                kcoral_event="server_listening",
                host=getattr(address, "host", None),
                port=getattr(address, "port", None),
            )

    async def _discover_gpus(self) -> dict[int, GpuDevice]:
        """The configured GPUs' device nodes and UUIDs, found without CUDA (in a thread)."""
        found = await self.run_blocking(discover_gpus)
        selected = select_gpus(found, self.config.distinct_gpus)
        self.log.info(
            "GPUs: {gpus}",
            kcoral_event="gpus_discovered",
            gpus=[device.as_log_dict() for device in selected.values()],
            discovered=len(found),
        )
        return selected

    def _start_retention(self, run_path: Path | None) -> None:
        """Prune old runs and saved programs hourly (docs/logs.md)."""
        from kcoral.server.retention import RetentionPolicy, RetentionService

        policy = RetentionPolicy.from_config(self.config)
        if run_path is None or not policy.enabled:
            return
        RetentionService(
            run_path.parent, run_path, policy, self.run_blocking, self._reactor
        ).setServiceParent(self)

    # -- stop -------------------------------------------------------------------

    def stopService(self) -> Deferred[None]:
        super().stopService()
        return Deferred.fromCoroutine(self._stop())

    async def _stop(self) -> None:
        try:
            await self._stop_all()
        except Exception:
            self.log.failure("error while stopping the server")
        finally:
            # Whatever failed above, the I/O threads must end: they are not
            # daemon threads and would keep the process alive after the
            # reactor has stopped.
            if self.log_setup is not None:
                self.log_setup.close()
            self.threadpool.stop()

    async def _stop_all(self) -> None:
        remaining = self.api.in_flight
        self.log.info(
            "shutdown requested; finishing {remaining} request(s)",
            kcoral_event="shutdown_started",
            remaining=remaining,
        )
        if self.port is not None:
            await self.port.stopListening()
            self.port = None
        self.leases.close()
        # Queued requests get 503 now; running ones finish with their budgets.
        self.pool.stop_waiters()
        await self.api.wait_idle()
        await self.pool.stop()
        if self._root_dir is not None:
            await self.run_blocking(shutil.rmtree, self._root_dir, True)
        self.log.info("shutdown complete", kcoral_event="shutdown_complete")
        self.log.info("server stopped", kcoral_event="server_stopped")


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


def _observability(server: KCoralService) -> tuple[Any, Any]:
    """
    The metrics and recent-requests observers, when their modules import.

    An endpoint that cannot work is recorded in C{server.unavailable}
    (endpoint -> reason) and announced at start-up, never dropped silently.
    """
    try:
        from kcoral.server.metrics import Metrics
    except ImportError as e:
        server.unavailable["/metrics"] = (
            f"{e} (install the server extra: pip install 'kcoral-server[server]')"
        )
        Metrics = None  # type: ignore[assignment,misc]
    try:
        from kcoral.server.status import RecentRequests
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
        }

    return (
        None if Metrics is None else Metrics(state),
        None if RecentRequests is None else RecentRequests(),
    )


def makeService(config: ServerConfig, endpoint: str, *, reactor: Any = None) -> KCoralService:
    """
    Build the root service for C{config}, serving HTTP on C{endpoint}.

    This is the twistd entry point (the C{kcoral} plugin and
    C{contrib/kcoral.tac}): a server that fails to start makes the process
    exit with status 1 once twistd has shut down.
    """
    root = KCoralService(config, endpoint, reactor=reactor)
    root.exit_status_on_failure = 1
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


def create_app(config: ServerConfig | None = None, *, reactor: Any = None) -> Any:
    """
    The Klein app for C{config}; nothing starts until its service does.

    The service that owns the workers is C{app.kcoral_service}: attach it to
    an application (C{setServiceParent}) or call C{startService()} and wait
    for C{service.ready} before serving C{app.resource()}.
    """
    server = KCoralService(config or ServerConfig(), None, reactor=reactor)
    app = server.api.app
    app.kcoral_service = server  # type: ignore[attr-defined]
    return app
