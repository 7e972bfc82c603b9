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
import sys
import traceback
import uuid
from collections.abc import Callable, MutableMapping, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from klein import Klein
from twisted.application import service
from twisted.internet.defer import CancelledError, Deferred, maybeDeferred
from twisted.internet.interfaces import IReactorFromThreads
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThreadPool
from twisted.logger import ILogObserver, Logger, globalLogPublisher
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool

from kcoral.config import ServerConfig
from kcoral.server.cache import BlobStore, DiskFileCache, MemoryBlobCache
from kcoral.server.children import (
    CacheService,
    LingerService,
    ListeningPortService,
    LogWriterService,
    Reactor,
    ThreadPoolService,
    WorkerPoolService,
)
from kcoral.server.http.app import KcoralAPI
from kcoral.server.http.site import KcoralSite, make_site
from kcoral.server.sandbox.nosandbox import NoSandbox
from kcoral.server.topology import FrontEnd, HealthReports, Topology
from kcoral.server.workers.pool import WorkerPool

if TYPE_CHECKING:
    from kcoral.server.observe.logs import LogSetup
    from kcoral.server.observe.metrics import Metrics
    from kcoral.server.observe.sdnotify import SystemdNotifier
    from kcoral.server.observe.status import RecentRequests
    from kcoral.server.workers.spares import Spare

_P = ParamSpec("_P")
_T = TypeVar("_T")


def _reactor(reactor: Reactor | None) -> Reactor:
    if reactor is None:
        from twisted.internet import reactor as global_reactor

        return global_reactor
    return reactor


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
        front_end: FrontEnd | None = None,
    ) -> None:
        """
        @param config: the whole server's configuration.
        @param endpoint: the HTTP endpoint descriptions to listen on; none
            for L{create_app}'s service.
        @param front_end: which front end this process is, when the first
            front end started it (L{kcoral.server.frontend_main}); the
            first, or the only one, by default.
        """
        super().__init__()
        self.setName("kcoral")
        #: This process's place among the front ends, and what follows from it.
        self.topology = Topology(config, front_end or FrontEnd())
        config = self.topology.config
        self.config = config
        self._reactor = _reactor(reactor)
        self.threadpool = ThreadPool(minthreads=0, maxthreads=4, name="kcoral-io")
        self.leases = self.topology.leases(config.distinct_gpus, self._reactor)
        self.memory_cache = MemoryBlobCache(config.cache_capacity_bytes, self._cache_event)
        self.disk_cache = DiskFileCache(
            config.disk_cache_dir, config.disk_cache_capacity_mbytes, self._cache_event
        )
        self.blobs = BlobStore(self.memory_cache, self.disk_cache, self.threadpool, self._reactor)
        index = self.topology.front_end.index
        # The probed sandbox replaces NoSandbox when the workers start.
        self.pool = WorkerPool(
            config,
            self._reactor,
            self.leases,
            NoSandbox(),
            self.run_blocking,
            Path("."),
            front_end=index,
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
            front_end=index,
        )
        if self.recent is not None:
            from kcoral.server.observe.status import STATUS_PAGE, status_snapshot

            recent = self.recent
            self.api.status_snapshot = lambda health: status_snapshot(health, recent)
            self.api.status_page = STATUS_PAGE
        self.ready: Deferred[None] = Deferred()
        self.start_failure: str | None = None
        self._restore_signals: Callable[[], None] | None = None
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
            *self.topology.before_logs(self._reactor, self.leases),
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
            endpoints = (endpoint,) if isinstance(endpoint, str) else tuple(endpoint)
            site = make_site(self.api.resource(), config, reactor=self._reactor)
            http = ListeningPortService(
                self._reactor,
                endpoints,
                site,
                token_file=config.auth_token_file,
                public_metrics=config.public_metrics,
                run_blocking=self.run_blocking,
                reuse_port=self.topology.several,
                first=self.topology.front_end.first,
            )
            # Stopped in reverse order: the port, the workers, then the linger.
            children.insert(
                children.index(self.logs) + 2, _named(LingerService(self._reactor, site), "linger")
            )
            children.append(_named(http, "http"))
            children.extend(
                self.topology.after_http(self._reactor, self.api, self.leases, endpoints)
            )
            if config.join_url is not None:
                # A node of a gateway's pool (--join): started once the port
                # listens, stopped (its jobs finished) before it closes.
                from kcoral.server.join.service import JoinService

                join = JoinService(config, self._reactor, self.api, self.run_blocking, site)
                children.append(_named(join, "join"))
        if self.topology.role == "alone" and self.leases.gpus and config.gpu_monitor_interval > 0:
            # NVML through a thread (kcoral.server.leases.monitor); with
            # several front ends the workers of the others are not known here.
            from kcoral.server.leases.monitor import GpuMonitorService

            monitor = GpuMonitorService(self.leases, self._reactor, self.run_blocking)
            monitor.monitor.interval = config.gpu_monitor_interval
            children.append(_named(monitor, "gpu-monitor"))
        for child in children:
            child.setServiceParent(self)

    def run_blocking(
        self, f: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs
    ) -> Deferred[_T]:
        """Run blocking C{f} in the server's I/O thread pool."""
        return deferToThreadPool(self._reactor, self.threadpool, f, *args, **kwargs)

    def _cache_event(self, name: str, **fields: object) -> None:
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
        if self.notify_systemd and self.topology.speaks_for_the_server:
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
        if self.start_failure is not None or not self.topology.speaks_for_the_server:
            return
        self.api.stopping = True
        reports = self.namedServices.get("health-reports")
        if isinstance(reports, HealthReports) and reports.running:
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


def _spare_counts(spares: list[Spare]) -> dict[tuple[int | str, str], int]:
    """Spares by (GPU, or C{cpu}; state), for the C{kcoral_spare_workers} gauge."""
    counts: dict[tuple[int | str, str], int] = {}
    for spare in spares:
        key = ("cpu" if spare.gpu_id is None else spare.gpu_id, spare.status)
        counts[key] = counts.get(key, 0) + 1
    return counts


def install_second_signal(
    reactor: IReactorFromThreads, stop_now: Callable[[], None]
) -> Callable[[], None] | None:
    """
    Route the next SIGTERM or SIGINT to C{stop_now} (in the reactor thread)
    while a graceful stop runs; returns a callable that puts the previous
    handlers back.  Off the main thread (tests) nothing is installed.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    previous: dict[int, Callable[[int, FrameType | None], object] | int | None] = {}

    def handler(signum: int, frame: FrameType | None) -> None:
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
    config: ServerConfig,
    endpoint: str | Sequence[str],
    *,
    reactor: Reactor | None = None,
    front_end: FrontEnd | None = None,
) -> KCoralService:
    """
    Build the root service for C{config}, serving HTTP on C{endpoint}.

    This is the twistd entry point (the C{kcoral} plugin and
    C{contrib/kcoral.tac}): a server that fails to start makes the process
    exit with status 1 once twistd has shut down, and under a systemd
    C{Type=notify} unit it sends C{READY=1} once every worker is up and
    C{STOPPING=1} when it begins to stop (L{kcoral.server.observe.sdnotify}).
    C{front_end} is the wiring of a front end other than the first
    (L{kcoral.server.frontend_main}).
    """
    root = KCoralService(config, endpoint, reactor=reactor, front_end=front_end)
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
