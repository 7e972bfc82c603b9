# -*- test-case-name: tests.unit.test_template,tests.integration.test_template -*-
"""
The parent's side of a worker template (L{kcoral.worker.template}).

L{WorkerTemplate} starts the template process (inside the sandbox's
command line, like a worker), waits for it to report ready, and forks
workers through it: L{WorkerTemplate.fork_transport} makes the worker's
pipes, sends the child's ends over the template's Unix socket
(C{SCM_RIGHTS}) and returns a L{ForkedTransport}, a Twisted process
transport whose pid arrives when the template reports the fork and whose
end arrives when the template reports the child's C{waitpid} status.  A
L{kcoral.server.workers.workerproc.WorkerProcess} runs on it exactly as on a
spawned process, so the pool does not care how a worker was made.

Pids come back as the template sees them; inside a bubblewrap sandbox that
is its own PID namespace, and L{host_pid} finds the host pid (the C{NSpid}
line of C{/proc/<pid>/status}) for psutil's kills and orphan checks.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import attrs
from twisted.internet import process
from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.interfaces import IAddress, IDelayedCall, IProcessTransport, IReactorSocket
from twisted.internet.protocol import ProcessProtocol, ServerFactory
from twisted.logger import Logger
from twisted.protocols.basic import LineOnlyReceiver
from twisted.python.failure import Failure

from kcoral.server.workers.backoff import Backoff
from kcoral.server.workers.reactor import WorkerReactor

#: The template's end of its socket (L{kcoral.worker.template.TEMPLATE_FD}).
TEMPLATE_FD = 3

#: How long a template may take to import everything and report ready
#: (torch alone costs seconds of CPU).
TEMPLATE_START_TIMEOUT = 120.0

#: The C{waitpid} status reported for a child whose template died first.
LOST_STATUS = 9  # killed by SIGKILL

#: Bytes of the template's stdout/stderr kept for diagnostics.
TAIL_BYTES = 8192


class TemplateError(Exception):
    """The template cannot fork a worker (not started, gone, or its socket is full)."""


def _children(pid: int) -> list[int]:
    """The children of C{pid}, from C{/proc/<pid>/task/*/children} (no scan of every process)."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as f:
                found.extend(int(child) for child in f.read().split())
        except (OSError, ValueError):
            continue
    return found


def host_pid(root: int, template_pid: int) -> int | None:
    """
    BLOCKING (a few C{/proc} reads of the sandbox's own processes): the host
    pid of the process that the template's PID namespace calls
    C{template_pid}, searched below C{root} (the sandbox's outermost
    process); C{None} when it is gone.
    """
    pending = _children(root)
    seen: set[int] = set()
    while pending:
        candidate = pending.pop()
        if candidate in seen:
            continue
        seen.add(candidate)
        try:
            with open(f"/proc/{candidate}/status", encoding="ascii") as f:
                for line in f:
                    if line.startswith("NSpid:"):
                        ids = line.split()[1:]
                        if len(ids) >= 2 and int(ids[1]) == template_pid:
                            return candidate
                        break
        except (OSError, ValueError):
            continue
        pending.extend(_children(candidate))
    return None


class ForkedTransport(process.Process):
    """
    A Twisted process transport for a worker forked by a template: the
    same pipes as a spawned process (made here, the child's ends sent to
    the template) and the same passed descriptors (an C{int} in
    C{child_fds}, as C{spawnProcess} takes them), no reaping of its own
    (the template reaps and reports).

    @ivar started: fires with the host pid once the template forked.
    """

    processReaderFactory = process.ProcessReader

    def __init__(
        self,
        reactor: Any,
        proto: ProcessProtocol,
        child_fds: Mapping[int, int | str],
        start: Callable[[dict[int, int]], None],
        reader_factory: Any = None,
    ) -> None:
        self._reactor = reactor
        process._BaseProcess.__init__(self, proto)
        if reader_factory is not None:
            self.processReaderFactory = reader_factory
        self.pipes: dict[int, Any] = {}
        self.started: Deferred[int | None] = Deferred()
        self._pending_signals: list[str | int] = []
        fdmap: dict[int, int] = {}
        helpers: dict[int, int] = {}
        opened: list[int] = []
        try:
            for child_fd, target in child_fds.items():
                if isinstance(target, int):
                    fdmap[child_fd] = target  # passed as it is; the caller owns it
                    continue
                r, w = os.pipe()
                opened += [r, w]
                if target == "r":
                    fdmap[child_fd], helpers[child_fd] = w, r
                else:
                    fdmap[child_fd], helpers[child_fd] = r, w
            start(fdmap)
        except BaseException:
            for fd in opened:
                os.close(fd)
            raise
        self.proto = proto
        for child_fd, parent_fd in helpers.items():
            os.close(fdmap[child_fd])
            if child_fds[child_fd] == "r":
                self.pipes[child_fd] = self.processReaderFactory(reactor, self, child_fd, parent_fd)
            else:
                self.pipes[child_fd] = self.processWriterFactory(
                    reactor, self, child_fd, parent_fd, forceReadHack=True
                )
        # Nothing the child says is read before its pid is known, so every
        # message (a lease request, say) is handled with the worker's pid.
        self._paused = [pipe for pipe in self.pipes.values() if child_fds_role(pipe) == "r"]
        for pipe in self._paused:
            pipe.stopReading()
        proto.makeConnection(self)

    def _resume(self) -> None:
        paused, self._paused = self._paused, []
        for pipe in paused:
            if not pipe.disconnected:
                pipe.startReading()

    def forked(self, pid: int | None) -> None:
        """The template forked the child: host pid C{pid} (C{None}: already gone)."""
        if self.lostProcess:
            return
        self._resume()
        self.pid = pid
        pending, self._pending_signals = self._pending_signals, []
        for signal_id in pending:
            try:
                self.signalProcess(signal_id)
            except ProcessExitedAlready:
                pass
        if not self.started.called:
            self.started.callback(pid)

    def exited(self, status: int) -> None:
        """The template reaped the child with C{waitpid} status C{status}."""
        if self.lostProcess:
            return
        self._resume()  # what it wrote before it ended is still read
        if not self.started.called:
            self.started.callback(None)
        self.processEnded(status)

    def reapProcess(self) -> None:
        """The template reaps its children; nothing to do here."""

    def signalProcess(self, signalID: str | int) -> None:
        if self.pid is None and not self.lostProcess and not self.started.called:
            # Not forked yet: deliver once the pid is known.
            self._pending_signals.append(signalID)
            return
        super().signalProcess(signalID)


def child_fds_role(pipe: object) -> str:
    """C{"r"} for a pipe the parent reads, C{"w"} for one it writes."""
    return "r" if isinstance(pipe, process.ProcessReader) else "w"


class _TemplateConnection(LineOnlyReceiver):
    """The parent's end of the template socket: one JSON object per line."""

    delimiter = b"\n"
    MAX_LENGTH = 1 << 16

    def __init__(self, template: WorkerTemplate) -> None:
        self.template = template

    def lineReceived(self, line: bytes) -> None:
        try:
            message = json.loads(line)
            if not isinstance(message, dict):
                raise ValueError("not an object")
        except ValueError as e:
            self.template.broken(f"unreadable message: {e}")
            return
        self.template.message(message)

    def lineLengthExceeded(self, line: bytes) -> None:
        self.template.broken("message over the length limit")

    def connectionLost(self, reason: Failure = Failure(ConnectionError())) -> None:
        self.template.broken("socket closed")


class _ConnectionFactory(ServerFactory):
    """Builds the one L{_TemplateConnection} of a template."""

    def __init__(self, template: WorkerTemplate) -> None:
        self.template = template

    def buildProtocol(self, addr: IAddress | None) -> _TemplateConnection:
        return _TemplateConnection(self.template)


class _TemplateProcess(ProcessProtocol):
    """The template process itself: its output tail and its end."""

    def __init__(self) -> None:
        self.tail = bytearray()
        self.ended: Deferred[None] = Deferred()

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        self.tail += data
        del self.tail[:-TAIL_BYTES]

    def processEnded(self, reason: Failure) -> None:
        self.ended.callback(None)


@attrs.define(eq=False)
class WorkerTemplate:
    """
    One template process and the workers forked through it.

    @ivar name: what logs call it (C{cpu}, C{gpu0}).
    @ivar state: C{"starting"}, C{"ready"} or C{"failed"} (C{error} says why).
    """

    name: str
    _reactor: WorkerReactor
    state: str = "starting"
    error: str | None = None
    pid: int | None = None
    template_pid: int | None = None
    ready: Deferred[None] = attrs.field(factory=Deferred)
    _send: Callable[[bytes, list[int]], object] | None = None
    _transport: IProcessTransport | None = None
    _process: _TemplateProcess | None = None
    _next_id: int = 0
    _children: dict[int, ForkedTransport] = attrs.field(factory=dict)
    _socket: socket.socket | None = None
    _timer: IDelayedCall | None = None
    #: Called with this template when it fails after it was ready (the
    #: pool restarts it).
    on_failure: Callable[[WorkerTemplate], object] | None = None
    #: Maps a template pid to a host pid (L{host_pid} in a thread-free
    #: call: a few C{/proc} reads); C{None}: the template shares our PID
    #: namespace.
    map_pid: Callable[[int], int | None] | None = None

    log = Logger()

    # -- starting and stopping ---------------------------------------------

    def start(
        self,
        executable: str,
        args: list[str],
        env: dict[str, str],
        *,
        timeout: float = TEMPLATE_START_TIMEOUT,
        path: str | None = None,
    ) -> Deferred[None]:
        """
        Start the template process in directory C{path}; C{ready} fires
        once it can fork.
        """
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._process = _TemplateProcess()
            fds: dict[int, int | str] = {0: "w", 1: "r", 2: "r", TEMPLATE_FD: theirs.fileno()}
            self._transport = self._reactor.spawnProcess(
                self._process, executable, args, env=env, path=path, childFDs=fds
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.pid = self._transport.pid
        try:
            self._transport.closeStdin()
        except Exception:
            pass
        self._process.ended.addCallback(lambda _: self.broken("template process exited"))
        ours.setblocking(False)
        self._socket = ours
        self.connect(lambda data, fds: socket.send_fds(ours, [data], fds))
        IReactorSocket(self._reactor).adoptStreamConnection(
            ours.fileno(), socket.AF_UNIX, _ConnectionFactory(self)
        )
        self._timer = self._reactor.callLater(timeout, self._start_timed_out, timeout)
        return self.ready

    def connect(self, send: Callable[[bytes, list[int]], object]) -> None:
        """Send requests with C{send(data, fds)} (L{start} uses the socket)."""
        self._send = send

    def _start_timed_out(self, timeout: float) -> None:
        self._timer = None
        if self.state == "starting":
            self.broken(f"not ready after {timeout:.0f}s")

    def stop(self) -> Deferred[None]:
        """End the template (its sandbox and every child it still has go with it)."""
        if self.state != "failed":
            self.state = "stopped"
        self._end()
        if self._transport is not None and self._process is not None:
            d: Deferred[None] = Deferred()
            self._process.ended.addBoth(lambda _: d.callback(None))
            return d
        return succeed(None)

    def _end(self) -> None:
        """No more forks: close the socket, kill the process, count the children as killed."""
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        if self._transport is not None and self._process is not None:
            if not self._process.ended.called:
                try:
                    self._transport.signalProcess("KILL")
                except ProcessExitedAlready:
                    pass
        children, self._children = self._children, {}
        for child in children.values():
            child.exited(LOST_STATUS)

    def output_tail(self) -> str:
        """The template's own output, last few KiB."""
        return bytes(self._process.tail if self._process else b"").decode("utf-8", "replace")

    # -- messages from the template -----------------------------------------

    def message(self, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op == "ready" and self.state == "starting":
            self.state = "ready"
            self.template_pid = message.get("pid")
            if self.map_pid is None and self.pid is not None and self.template_pid != self.pid:
                # The template has a PID namespace of its own (bubblewrap).
                root = self.pid
                self.map_pid = lambda pid: host_pid(root, pid)
            if self._timer is not None and self._timer.active():
                self._timer.cancel()
            self.log.info(
                "worker template {template} ready (pid {pid})",
                kcoral_event="template_ready",
                template=self.name,
                pid=self.pid,
            )
            self.ready.callback(None)
            return
        child = self._children.get(message.get("id", -1))
        if child is None:
            self.broken(f"a {op!r} message for no request")
        elif op == "forked":
            pid = message.get("pid")
            if not isinstance(pid, int):
                self.broken("a fork without a pid")
                return
            child.forked(self.map_pid(pid) if self.map_pid is not None else pid)
        elif op == "exited":
            del self._children[message["id"]]
            status = message.get("status")
            child.exited(status if isinstance(status, int) else LOST_STATUS)
        elif op == "failed":
            del self._children[message["id"]]
            self.log.warn(
                "worker template {template} could not fork: {error}",
                kcoral_event="template_fork_failed",
                template=self.name,
                error=str(message.get("error")),
            )
            child.exited(LOST_STATUS)
        else:
            self.broken(f"unexpected {op!r} message")

    def broken(self, reason: str) -> None:
        """The template is gone or misbehaved: no more forks; its children count as killed."""
        if self.state in ("failed", "stopped"):
            return
        was_ready = self.state == "ready"
        self.state = "failed"
        self.error = reason
        self._end()
        tail = self.output_tail()
        self.log.error(
            "worker template {template} failed: {reason}",
            kcoral_event="template_failed",
            template=self.name,
            reason=reason + (f": {tail[-2048:]}" if tail and not was_ready else ""),
        )
        if not self.ready.called:
            self.ready.errback(TemplateError(f"worker template {self.name}: {reason}"))
        elif was_ready and self.on_failure is not None:
            self.on_failure(self)

    # -- forking --------------------------------------------------------------

    def fork_transport(
        self,
        proto: ProcessProtocol,
        child_fds: Mapping[int, int | str],
        *,
        argv: list[str],
        env: Mapping[str, str],
        cwd: str,
        workspace: str | None = None,
        capture_bytes: int | None = None,
        workspace_bytes: int | None = None,
        reader_factory: Any = None,
    ) -> ForkedTransport:
        """
        Fork a worker running C{python -m kcoral.worker *argv}; its
        descriptors as C{child_fds} says (C{"r"}: a pipe the parent reads,
        C{"w"}: one it writes, an C{int}: that descriptor of ours, as
        C{spawnProcess} takes them).

        @raise TemplateError: the template cannot fork now.
        """
        if self.state != "ready" or self._send is None:
            raise TemplateError(f"worker template {self.name} is {self.state}")
        self._next_id += 1
        request_id = self._next_id
        send = self._send

        def start(fdmap: dict[int, int]) -> None:
            numbers = sorted(fdmap)
            request = {
                "op": "fork",
                "id": request_id,
                "fds": numbers,
                "argv": list(argv),
                "env": dict(env),
                "cwd": cwd,
                "workspace": workspace,
                "capture_bytes": capture_bytes,
                "workspace_bytes": workspace_bytes,
            }
            try:
                send(json.dumps(request).encode() + b"\n", [fdmap[n] for n in numbers])
            except OSError as e:
                # A full socket or a dead template: this worker cannot start.
                raise TemplateError(f"worker template {self.name}: {e}") from None

        transport = ForkedTransport(self._reactor, proto, child_fds, start, reader_factory)
        self._children[request_id] = transport
        return transport


@attrs.define(eq=False)
class WorkerTemplates(Mapping[int | None, WorkerTemplate]):
    """
    A pool's worker templates, one per device kind by key (a GPU id; C{None}:
    the CPU template), and their life cycle: started together, a template
    that fails while serving started again after a back-off (doubling while
    restarts keep failing), stopped together.  A key whose template is
    missing or failed has its workers spawned instead.

    How one template's process is started (its sandbox command line, its
    directory, its devices) is the pool's: C{launch(template, key)}, which
    fires once the template is ready.
    """

    _reactor: WorkerReactor
    _launch: Callable[[WorkerTemplate, int | None], Deferred[None]]
    #: The wait before a failed template is started again.
    backoff: Backoff = Backoff()
    templates: dict[int | None, WorkerTemplate] = attrs.field(factory=dict)
    closing: bool = False
    #: Restarts in a row that failed, and the pending restart, by key.
    _failures: dict[int | None, int] = attrs.field(factory=dict)
    _restarts: dict[int | None, IDelayedCall] = attrs.field(factory=dict)

    log = Logger()

    def __getitem__(self, key: int | None) -> WorkerTemplate:
        return self.templates[key]

    def __iter__(self) -> Iterator[int | None]:
        return iter(self.templates)

    def __len__(self) -> int:
        return len(self.templates)

    async def start(self, keys: Iterable[int | None]) -> None:
        """
        Start a template per key and wait until each is ready; any that
        fails is logged (C{template_failed}) and its workers are spawned
        instead (C{worker_start_fallback}).
        """
        starting = []
        for key in dict.fromkeys(keys):
            name = "cpu" if key is None else f"gpu{key}"
            template = WorkerTemplate(name, self._reactor)
            self.templates[key] = template
            starting.append(self._launch(template, key))
        results = await DeferredList(starting, consumeErrors=True)
        for template in self.templates.values():
            template.on_failure = self.lost
        names = [t.name for t in self.templates.values()]
        failed = [name for (ok, _), name in zip(results, names, strict=True) if not ok]
        if failed:
            self.log.error(
                "worker templates {templates} did not start: new workers are spawned, "
                "each paying its imports",
                kcoral_event="worker_start_fallback",
                templates=failed,
                errors=[t.error for t in self.templates.values() if t.state == "failed"],
            )

    def lost(self, template: WorkerTemplate) -> None:
        """
        A template failed while serving: its workers spawn meanwhile, and it
        is started again after the back-off.
        """
        key = next((k for k, t in self.templates.items() if t is template), None)
        if self.closing or self.templates.get(key) is not template:
            return
        failures = self._failures.get(key, 0) + 1
        self._failures[key] = failures
        pending = self._restarts.get(key)
        if pending is not None and pending.active():
            return
        self._restarts[key] = self._reactor.callLater(
            self.backoff.delay(failures), self._restart, key
        )

    def _restart(self, key: int | None) -> None:
        self._restarts.pop(key, None)
        if self.closing:
            return
        template = WorkerTemplate(self.templates[key].name, self._reactor)
        template.on_failure = self.lost
        self.templates[key] = template

        def started(_: object) -> None:
            self._failures.pop(key, None)

        def failed(failure: Failure) -> None:
            # template_failed is logged; try again later.
            if template.on_failure is not None and not self.closing:
                template.on_failure(template)

        self._launch(template, key).addCallbacks(started, failed)

    @property
    def worker_start(self) -> str:
        """
        How new workers are made now: C{"fork"} when every template is
        ready, else C{"spawn"} (configured so, or a template failed: its
        workers spawn).
        """
        templates = list(self.templates.values())
        if templates and all(t.state == "ready" for t in templates):
            return "fork"
        return "spawn"

    def ready_for(self, gpus: tuple[int, ...], isolated: bool) -> WorkerTemplate | None:
        """
        The ready template that can fork a worker for C{gpus}, if any.

        @param isolated: each template sees only its own GPU's device node
            (bubblewrap): multi-GPU workers are spawned.
        """
        if len(gpus) > 1 and isolated:
            return None
        template = self.templates.get(gpus[0] if gpus else None)
        if template is None or template.state != "ready":
            return None
        return template

    def close(self) -> None:
        """Restart nothing any more (the pool is closing)."""
        self.closing = True

    async def stop(self) -> None:
        """Stop every template (after their workers)."""
        for call in self._restarts.values():
            if call.active():
                call.cancel()
        self._restarts.clear()
        templates, self.templates = list(self.templates.values()), {}
        for template in templates:
            template.on_failure = None
        await DeferredList([t.stop() for t in templates], consumeErrors=True)
