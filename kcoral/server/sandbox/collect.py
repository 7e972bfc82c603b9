# -*- test-case-name: tests.unit.test_collect,tests.integration.test_sandbox_probe -*-
"""
Run a short helper process, keep a bounded part of its output, kill it on a timeout.

The server runs a few processes of its own besides its workers: the
sandbox's start-up probe (L{kcoral.server.sandbox.probe}) and the compiles
for the shared cache (L{kcoral.server.workers.compiles}).  Each writes what
it likes, so what is kept of each output is bounded (L{Sink}), and each may
hang, so it is killed once its time is up.  L{run_bounded} does both and
fires with a L{Finished} once the process has ended (never before: a killed
process is waited for).  L{start_bounded} does the same and hands back the
running process (L{BoundedRun}), whose wait kills it when cancelled: a
compile whose client left, or whose program's budget ran out.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.interfaces import IProcessTransport, IReactorProcess, IReactorTime
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure


@attrs.frozen
class Sink:
    """
    Where some of a child's output descriptors go, and how much of it is kept.

    @ivar fds: the child's descriptors written into this sink, in arrival order.
    @ivar limit: bytes kept at most.
    @ivar tail: keep the last C{limit} bytes (the end of a failure's
        message) rather than the first ones.
    """

    fds: tuple[int, ...]
    limit: int
    tail: bool = False


@attrs.frozen
class Finished:
    """
    How a helper process ended, and what was kept of its output.

    @ivar exit_code: its exit status, or C{None} when a signal ended it.
    @ivar signal: the signal that ended it, or C{None}.
    @ivar output: the bytes kept of each L{Sink}, by name (not copied: an
        answer may be large).
    @ivar overflowed: the sinks that were written more than their limit.
    @ivar timed_out: whether it was killed because its time was up.
    """

    exit_code: int | None
    signal: int | None
    output: Mapping[str, bytearray]
    overflowed: frozenset[str]
    timed_out: bool

    @property
    def status(self) -> int:
        """The exit status, or minus the signal number (C{0} when neither is known)."""
        if self.exit_code is not None:
            return self.exit_code
        return -(self.signal or 0)


class BoundedOutputProtocol(ProcessProtocol):
    """
    Writes C{stdin} to the child and closes it; keeps what the child writes
    to each L{Sink} within its limit; fires C{ended} with a L{Finished}
    (C{timed_out} as set by whoever killed it) in C{processEnded}.
    """

    def __init__(self, sinks: Mapping[str, Sink], stdin: bytes = b"") -> None:
        self._stdin = stdin
        self._sinks = dict(sinks)
        self._by_fd = {fd: name for name, sink in self._sinks.items() for fd in sink.fds}
        self.output: dict[str, bytearray] = {name: bytearray() for name in self._sinks}
        self.overflowed: set[str] = set()
        self.timed_out = False
        self.ended: Deferred[Finished] = Deferred()

    def connectionMade(self) -> None:
        transport = self.transport
        assert transport is not None
        if self._stdin:
            transport.writeToChild(0, self._stdin)
        transport.closeStdin()

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        name = self._by_fd.get(childFD)
        if name is None:
            return
        sink, kept = self._sinks[name], self.output[name]
        if sink.tail:
            kept += data
            if len(kept) > sink.limit:
                self.overflowed.add(name)
                del kept[: len(kept) - sink.limit]
            return
        room = sink.limit - len(kept)
        if len(data) > room:
            self.overflowed.add(name)
        if room > 0:
            kept += data[:room]

    def processEnded(self, reason: Failure) -> None:
        value = reason.value
        code = getattr(value, "exitCode", None)
        sig = getattr(value, "signal", None)
        self.ended.callback(
            Finished(
                exit_code=code if isinstance(code, int) else None,
                signal=sig if isinstance(sig, int) else None,
                output=dict(self.output),
                overflowed=frozenset(self.overflowed),
                timed_out=self.timed_out,
            )
        )


def kill_process(transport: IProcessTransport) -> None:
    """SIGKILL the process itself (it may have ended already)."""
    try:
        transport.signalProcess("KILL")
    except ProcessExitedAlready:
        pass


def kill_group(transport: IProcessTransport) -> None:
    """
    SIGKILL the process group the process leads (it started a session of
    its own, so whatever it started goes too); the process itself while it
    leads none yet.
    """
    pid = transport.pid
    if pid is None:
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        kill_process(transport)


@attrs.define(eq=False)
class BoundedRun:
    """
    A helper process started by L{start_bounded}.

    @ivar finished: fires with a L{Finished} once the process has ended
        (never before, killed or not); do not cancel it: wait on L{wait}
        instead.
    """

    transport: IProcessTransport
    finished: Deferred[Finished]
    _kill: Callable[[IProcessTransport], None]

    def kill(self) -> None:
        """End it now (its L{Finished} is not C{timed_out})."""
        self._kill(self.transport)

    def wait(self) -> Deferred[Finished]:
        """
        A new Deferred that fires with its L{Finished} once it has ended;
        cancelling it kills the process: the wait fails at once with
        C{CancelledError}, and L{finished} fires once the process has ended.
        """
        copy: Deferred[Finished] = Deferred(lambda _: self.kill())
        self.finished.addCallback(_forward, copy)
        return copy


def _forward(finished: Finished, copy: Deferred[Finished]) -> Finished:
    if not copy.called:
        copy.callback(finished)
    return finished


def run_bounded(
    reactor: IReactorProcess,
    executable: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    sinks: Mapping[str, Sink],
    timeout: float,
    stdin: bytes = b"",
    kill: Callable[[IProcessTransport], None] = kill_process,
) -> Deferred[Finished]:
    """
    L{start_bounded}'s process's L{BoundedRun.finished}: fires with a
    L{Finished} once the process has ended.
    """
    return start_bounded(
        reactor, executable, argv, env=env, sinks=sinks, timeout=timeout, stdin=stdin, kill=kill
    ).finished


def start_bounded(
    reactor: IReactorProcess,
    executable: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    sinks: Mapping[str, Sink],
    timeout: float,
    stdin: bytes = b"",
    kill: Callable[[IProcessTransport], None] = kill_process,
    fds: Mapping[int, int] | None = None,
) -> BoundedRun:
    """
    Spawn C{executable} with C{argv} and C{env}; stdin is a pipe given
    C{stdin} and then closed, each sink's descriptors are pipes read into
    it.  After C{timeout} seconds C{kill} ends it.

    @param reactor: an C{IReactorProcess} that also provides C{IReactorTime}.
    @param fds: more of the child's descriptors: each a copy of one of this
        process's (C{{child: parent}}, as C{childFDs} maps them); the
        caller closes its own once this returns.
    """
    protocol = BoundedOutputProtocol(sinks, stdin)
    child_fds: dict[int, Any] = {0: "w"}
    for sink in sinks.values():
        child_fds.update(dict.fromkeys(sink.fds, "r"))
    child_fds.update(fds or {})
    transport = reactor.spawnProcess(
        protocol, executable, list(argv), env=dict(env), childFDs=child_fds
    )

    def time_up() -> None:
        protocol.timed_out = True
        kill(transport)

    timer = IReactorTime(reactor).callLater(timeout, time_up)

    def done(finished: Finished) -> Finished:
        if timer.active():
            timer.cancel()
        return finished

    return BoundedRun(transport, protocol.ended.addCallback(done), kill)
