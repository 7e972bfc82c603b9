# -*- test-case-name: tests.integration.test_front_ends -*-
"""
Several front-end processes behind one port, sharing the GPUs' leases.

One reactor thread runs a server's HTTP, admission, pool and every
worker's channel; on the H200 it is busy all the time from about 600 null
programs a second, while the workers could do ten times more.  With
C{--front-ends N} the server runs N processes:

 - The first is the server as always, plus the lease broker
   (L{kcoral.server.leases.broker}): its L{LeaseArbiter} decides for every
   front end's workers, over a Unix socket in a private directory.  It
   starts the others (L{FrontEndsService}) and restarts one that dies.
 - Each other front end (C{python -m kcoral.server.frontend_main SPEC}) is
   the same server with a L{RemoteArbiter} in place of the arbiter, its
   share of the seats and spares (every N-th), and its share of the caps
   (memory cache, bytes in flight, connections, queue): what each front end
   is, and gets, is decided in one place, L{kcoral.server.topology}.
 - All of them listen on the same TCP port with C{SO_REUSEPORT}: the kernel
   spreads connections evenly over them, and a keep-alive connection (so a
   C{CACHE_MISS} and its retry) stays with one process.  The first checks
   that the port is free first, so a second server on it fails to bind.

Each front end writes its own events (the others under
C{<log dir>/front-end-<n>}); the lease events are all the first's, so one
file keeps every GPU's grants and releases in order.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from twisted.internet import error as twisted_error
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.endpoints import UNIXClientEndpoint, connectProtocol
from twisted.internet.interfaces import IListeningPort, IReactorSocket
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import Logger
from twisted.protocols import amp
from twisted.python.failure import Failure

from kcoral.config import ServerConfig
from kcoral.server.leases.broker import LeaseBroker, RemoteArbiter, broker_factory
from kcoral.server.leases.lease import LeaseArbiter

__all__ = ["BrokerConnection", "FrontEndProcesses", "FrontEndsService", "listen_reusing_port"]

#: Seconds before a front end that died is started again (doubling, at most the second).
RESTART_DELAY = (0.5, 30.0)

#: A front end that ran this long before it died is restarted after the
#: shortest delay again.
STEADY_SECONDS = 60.0


def listen_reusing_port(
    reactor: IReactorSocket, description: str, factory: Any, first: bool
) -> IListeningPort:
    """
    Listen on a C{tcp:} endpoint description with C{SO_REUSEPORT}, so that
    every front end binds the same port and the kernel spreads connections
    over them.  The first front end makes sure the port is free before it
    sets the option, so a second server started on the same port still
    fails to bind instead of sharing it.

    @raise ValueError: the description is not plain TCP (TLS and Unix
        sockets are served by one process only).
    @raise OSError: the port is taken (C{EADDRINUSE}), or cannot be bound.
    """
    fields = re.split(r"(?<!\\):", description)
    if fields[0].lower() not in ("tcp", "tcp6"):
        raise ValueError(f"--front-ends needs plain TCP endpoints, not {description!r}")
    named: dict[str, str] = {}
    positional: list[str] = []
    for item in fields[1:]:
        key, sep, value = item.partition("=")
        value = value.replace("\\:", ":").replace("\\\\", "\\")
        if sep:
            named[key] = value
        else:
            positional.append(key)
    port = int(named.get("port") or positional[0])
    interface = named.get("interface", "::" if fields[0].lower() == "tcp6" else "0.0.0.0")
    backlog = int(named.get("backlog", "50"))
    family = socket.AF_INET6 if ":" in interface else socket.AF_INET
    if first:
        # Without SO_REUSEPORT: fails if anyone holds the port.
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((interface, port))
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((interface, port))
        sock.listen(backlog)
        sock.setblocking(False)
        listening: IListeningPort = reactor.adoptStreamPort(sock.fileno(), family, factory)
    finally:
        sock.close()  # the reactor holds its own descriptor of it
    return listening


#: Seconds between a front end's health reports to the others.
REPORT_INTERVAL = 1.0

#: The longest Unix socket path the broker uses (the kernel takes 107 bytes).
MAX_SOCKET_PATH = 100


def _socket_parent() -> str:
    """
    Where the broker's private directory goes: the temporary directory,
    unless its path is too long for a Unix socket in it (a deep C{TMPDIR}),
    then C{/tmp}.
    """
    parent = tempfile.gettempdir()
    longest = len(os.path.join(parent, "kcoral-front-ends-12345678", "broker.sock"))
    return parent if longest <= MAX_SOCKET_PATH else "/tmp"


class _FrontEnd(ProcessProtocol):
    """One front end process, as its supervisor sees it."""

    def __init__(self, supervisor: FrontEndProcesses, index: int, started_at: float) -> None:
        self.supervisor = supervisor
        self.index = index
        self.started_at = started_at
        self.exited: Deferred[int | None] = Deferred()

    def processEnded(self, reason: Failure) -> None:
        code = getattr(reason.value, "exitCode", None)
        self.exited.callback(code)
        self.supervisor._ended(self, code)


class FrontEndProcesses:
    """
    The other front ends' processes, by index, for the server's first front
    end and the gateway's: each runs C{python -m MODULE SPEC}; one that dies
    on its own is started again after a delay that doubles while it keeps
    dying (L{RESTART_DELAY}); L{stop} asks each to end (SIGTERM), then kills
    what is left after a grace period.
    """

    log = Logger()

    def __init__(self, reactor: Any, module: str) -> None:
        self._reactor = reactor
        self._module = module
        self._processes: dict[int, _FrontEnd] = {}
        self._specs: dict[int, tuple[Path, dict[str, object]]] = {}
        self._delays: dict[int, float] = {}
        self._stopping = False

    def spawn(self, index: int, spec: Path, **fields: object) -> None:
        """Start front end C{index} from C{spec}; C{fields} go on its events."""
        self._specs[index] = (spec, fields)
        process = _FrontEnd(self, index, self._reactor.seconds())
        self._processes[index] = process
        self._reactor.spawnProcess(
            process,
            sys.executable,
            [sys.executable, "-m", self._module, str(spec)],
            env=dict(os.environ),
            childFDs={0: "w", 1: 1, 2: 2},
        )
        self.log.info(
            "front end {index} started (pid {pid})",
            kcoral_event="front_end_started",
            index=index,
            pid=getattr(process.transport, "pid", None),
            **fields,
        )

    def _ended(self, process: _FrontEnd, code: int | None) -> None:
        if self._processes.get(process.index) is not process:
            return
        del self._processes[process.index]
        if self._stopping:
            return
        if self._reactor.seconds() - process.started_at >= STEADY_SECONDS:
            self._delays.pop(process.index, None)  # it had been running well
        delay = self._delays.get(process.index, RESTART_DELAY[0])
        self._delays[process.index] = min(delay * 2, RESTART_DELAY[1])
        self.log.error(
            "front end {index} exited (code {code}); restarting in {delay} s",
            kcoral_event="front_end_exited",
            index=process.index,
            code=code,
            retry_in_seconds=delay,
        )
        self._reactor.callLater(delay, self._restart, process.index)

    def _restart(self, index: int) -> None:
        if not self._stopping and index not in self._processes:
            spec, fields = self._specs[index]
            self.spawn(index, spec, **fields)

    async def stop(self, grace: float) -> None:
        """Ask every front end to stop (SIGTERM); kill any still running after C{grace} s."""
        self._stopping = True
        processes = list(self._processes.values())
        for process in processes:
            try:
                process.transport.signalProcess("TERM")  # type: ignore[union-attr]
            except twisted_error.ProcessExitedAlready:
                pass
        for process in processes:
            timer = self._reactor.callLater(grace, _kill, process)
            await process.exited
            if timer.active():
                timer.cancel()


class FrontEndsService:
    """
    In the first front end: the lease broker, and the other front ends'
    processes (started after the first listens, stopped before it stops).
    """

    def __init__(
        self,
        reactor: Any,
        config: ServerConfig,
        endpoints: Sequence[str],
        leases: LeaseArbiter,
    ) -> None:
        self._reactor = reactor
        self._config = config
        self._endpoints = list(endpoints)
        self.broker = LeaseBroker(leases)
        self.processes = FrontEndProcesses(reactor, "kcoral.server.frontend_main")
        self._dir: Path | None = None
        self._port: IListeningPort | None = None

    @property
    def broker_path(self) -> Path | None:
        return None if self._dir is None else self._dir / "broker.sock"

    def start(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="kcoral-front-ends-", dir=_socket_parent()))
        path = self.broker_path
        assert path is not None
        self._port = self._reactor.listenUNIX(str(path), broker_factory(self.broker), mode=0o600)
        for index in range(1, self._config.front_ends):
            spec = self._dir / f"front-end-{index}.json"
            # The whole server's config and this front end's place: it takes
            # its own share of them (kcoral.server.topology).
            document = {
                "config": self._config.as_log_dict(),
                "front_end": {"index": index, "broker": str(path)},
                "endpoints": self._endpoints,
            }
            spec.write_text(json.dumps(document))
            self.processes.spawn(index, spec, broker=str(path))

    async def stop(self, grace: float) -> None:
        """Ask every other front end to stop (SIGTERM), wait, then close the broker."""
        await self.processes.stop(grace)
        if self._port is not None:
            await maybeDeferred(self._port.stopListening)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def _kill(process: _FrontEnd) -> None:
    try:
        process.transport.signalProcess("KILL")  # type: ignore[union-attr]
    except twisted_error.ProcessExitedAlready:
        pass


class BrokerConnection:
    """
    In a front end other than the first: its L{RemoteArbiter}'s connection.
    When the broker goes away (the first front end ended, however) this
    front end stops too: it could grant nothing, and no one would restart it.
    """

    log = Logger()

    def __init__(self, reactor: Any, leases: RemoteArbiter, path: Path) -> None:
        self._reactor = reactor
        self._leases = leases
        self._path = path
        self._protocol: amp.AMP | None = None
        self._stopping = False
        leases.on_lost = self._lost

    async def start(self) -> None:
        endpoint = UNIXClientEndpoint(self._reactor, str(self._path))
        self._protocol = await connectProtocol(endpoint, self._leases.protocol())

    def stop(self) -> None:
        self._stopping = True
        if self._protocol is not None and self._protocol.transport is not None:
            self._protocol.transport.loseConnection()

    def _lost(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self.log.error(
            "the lease broker ({path}) went away; this front end stops",
            kcoral_event="broker_lost",
            path=str(self._path),
        )
        if self._reactor.running:
            self._reactor.stop()
