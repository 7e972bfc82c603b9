# -*- test-case-name: tests.unit.test_leasebroker -*-
"""
One GPU lease for several front-end processes: a broker that owns the
L{LeaseArbiter}, and a L{RemoteArbiter} that gives a front end the
arbiter's interface over a connection to it.

This is the first part of the next step past one reactor process
(docs/architecture.md, "Next step: several front-end processes, one
lease"): each front end runs its own reactor and its own workers, and
every GPU's holds, waits, FIFO order, maintenance batches and history stay
in one place.  Front ends speak AMP to the broker (a Unix socket):

 - C{Acquire} answers when the lease is granted (or refused); C{Withdraw}
   cancels a waiting one; C{Release} and C{Abandon} give holds back.
 - The broker pushes C{LeaseState} to every front end after each change:
   per GPU its depth, its exclusive holder and label, its maintainers, and
   the holds closed since the last push, so a front end answers
   C{holder_of}, C{depth}, C{labels_during} and C{least_busy} (its
   /health, its interference reports, its multi-GPU placement) locally.
 - A front end whose connection closes has all its holds and waits dropped
   (its workers die with it), as a dead worker's are in one process.

The broker logs the lease events, so one file holds the order of every
GPU's grants and releases.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
from collections.abc import Callable, Hashable
from typing import Any

import attrs
import psutil
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import Factory, connectionDone
from twisted.logger import Logger
from twisted.protocols import amp
from twisted.python.failure import Failure

from kcoral.server.leases.lease import (
    Grant,
    HoldInterval,
    LeaseArbiter,
    LeaseBook,
    LeaseRequest,
    LeaseUnavailable,
    checked_request,
    pid_of,
    seat_of,
)

__all__ = ["LeaseBroker", "RemoteArbiter", "RemoteHolder", "broker_factory"]


class _Json(amp.Argument):
    """A JSON value as an AMP argument (the state pushes)."""

    def toString(self, inObject: object) -> bytes:  # noqa: N802 (AMP's name)
        return json.dumps(inObject, separators=(",", ":")).encode()

    def fromString(self, inString: bytes) -> object:  # noqa: N802
        return json.loads(inString)


class Acquire(amp.Command):
    """Wait for a lease; the answer is the grant."""

    arguments = [
        (b"token", amp.Integer()),
        (b"seat", amp.Unicode(optional=True)),
        (b"pid", amp.Integer(optional=True)),
        (b"gpus", amp.ListOf(amp.Integer())),
        (b"label", amp.Unicode(optional=True)),
        (b"mode", amp.Unicode()),
        # Say when this wait is first in line (L{Next}).
        (b"next_in_line", amp.Boolean(optional=True)),
    ]
    response = [(b"requested_at", amp.Float()), (b"granted_at", amp.Float())]
    errors = {LeaseUnavailable: b"UNAVAILABLE", CancelledError: b"CANCELLED"}


class Next(amp.Command):
    """
    The broker to a front end: the wait C{token} (an L{Acquire} that asked
    for this) is first in line for its GPUs, so its grant is the next
    hand-over.
    """

    arguments = [(b"token", amp.Integer())]
    response = []
    requiresAnswer = False


class Withdraw(amp.Command):
    """Cancel a waiting C{Acquire} (its answer is then C{CANCELLED})."""

    arguments = [(b"token", amp.Integer())]
    response = []
    requiresAnswer = False


class Release(amp.Command):
    """Give back what a holder holds."""

    arguments = [(b"token", amp.Integer())]
    response = []
    requiresAnswer = False


class Abandon(amp.Command):
    """Withdraw a holder's waits and give back its holds (its process died)."""

    arguments = [(b"token", amp.Integer())]
    response = []
    requiresAnswer = False


class LeaseState(amp.Command):
    """The broker's view of every GPU, pushed after each change."""

    arguments = [(b"state", _Json())]
    response = []
    requiresAnswer = False


class Report(amp.Command):
    """A front end's own /health figures, every second."""

    arguments = [(b"index", amp.Integer()), (b"health", _Json())]
    response = []
    requiresAnswer = False


class PeerReport(amp.Command):
    """
    One front end's last report (C{None}: it is gone), passed on to every
    front end after it arrives.  One report a message: an AMP value holds
    at most 64 KiB, which every front end's reports together could pass.
    """

    arguments = [(b"index", amp.Integer()), (b"health", _Json(optional=True))]
    response = []
    requiresAnswer = False


@attrs.frozen
class RemoteHolder:
    """A holder in another process: its connection's number and its token there."""

    front_end: int
    token: int
    seat: str | None = attrs.field(default=None, eq=False)
    pid: int | None = attrs.field(default=None, eq=False)


@attrs.define(eq=False)
class LeaseBroker:
    """
    The arbiter of every front end's workers, and the state it pushes.
    """

    arbiter: LeaseArbiter
    _connections: dict[int, _BrokerProtocol] = attrs.field(factory=dict)
    _numbers: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1))
    _sent: dict[int, HoldInterval | None] = attrs.field(factory=dict)
    _push: IDelayedCall | None = None
    #: Every front end's last health report, by index (the first's too).
    reports: dict[int, dict[str, Any]] = attrs.field(factory=dict)

    log = Logger()

    def report(self, index: int, health: dict[str, Any] | None) -> None:
        """Keep front end C{index}'s report (C{None}: it is gone) and pass them all on."""
        if health is None:
            self.reports.pop(index, None)
        else:
            self.reports[index] = health
        for protocol in list(self._connections.values()):
            protocol.callRemote(PeerReport, index=index, health=health)

    def attach(self, protocol: _BrokerProtocol) -> int:
        number = next(self._numbers)
        self._connections[number] = protocol
        protocol.callRemote(LeaseState, state=self.state(full=True))
        for index, health in self.reports.items():
            protocol.callRemote(PeerReport, index=index, health=health)
        return number

    def detach(self, number: int, holders: list[RemoteHolder]) -> None:
        """
        A front end went away: its waits are withdrawn at once; a hold ends
        only once its worker process is gone.  That worker may still be
        running a kernel (it dies with its front end, but not at the same
        instant), so it is killed, and the GPU stays closed to everyone
        else until it has exited, as when a worker of this process dies.
        """
        self._connections.pop(number, None)
        for holder in holders:
            grant = self.arbiter.grant_of(holder)
            if grant is None or holder.pid is None or not _alive(holder.pid):
                self.arbiter.abandon(holder)
                continue
            self.log.warn(
                "front end went away while {holder} (pid {pid}) held GPU(s) {gpu_ids}: "
                "the worker is killed and the GPUs wait for its end",
                kcoral_event="orphan_holder_killed",
                holder=holder.seat,
                pid=holder.pid,
                gpu_ids=list(grant.gpus),
            )
            with contextlib.suppress(OSError):
                os.kill(holder.pid, signal.SIGKILL)
            self._release_when_gone(holder)
        self.changed()

    def _release_when_gone(self, holder: RemoteHolder) -> None:
        assert holder.pid is not None
        if _alive(holder.pid):
            self.arbiter.clock.callLater(ORPHAN_POLL_SECONDS, self._release_when_gone, holder)
            return
        self.arbiter.abandon(holder)
        self.changed()

    def changed(self) -> None:
        """
        Push the new state to every front end after a change: once per
        reactor turn, however many changes the turn made (a release and the
        grant it wakes are one push).
        """
        if self._push is None or not self._push.active():
            self._push = self.arbiter.clock.callLater(0, self._push_state)

    def _push_state(self) -> None:
        state = self.state(full=False)
        for protocol in list(self._connections.values()):
            protocol.callRemote(LeaseState, state=state)

    def state(self, full: bool) -> dict[str, Any]:
        """Per GPU: depth, exclusive holder, maintainers, and the holds closed since the last push."""
        arbiter = self.arbiter
        gpus: dict[str, Any] = {}
        for gpu in arbiter.gpus:
            holder = arbiter.holder_of(gpu)
            grant = None if holder is None else arbiter.grant_of(holder)
            history = list(arbiter.history.get(gpu, ()))
            if not full:
                # What the last push to everyone did not carry (a full
                # state goes to one new front end only: it moves nothing).
                last = self._sent.get(gpu)
                if last is not None and last in history:
                    history = history[history.index(last) + 1 :]
                if history:
                    self._sent[gpu] = history[-1]
            gpus[str(gpu)] = {
                "depth": arbiter.depth(gpu),
                "holder": _name(holder),
                "label": None if holder is None else arbiter.label_of(holder),
                "since": None if grant is None else grant.granted_at,
                "maintainers": sorted(str(_name(m)) for m in arbiter.maintainers_of(gpu)),
                "closed": [[i.label, i.start, i.end, i.mode] for i in history],
            }
        return {"gpus": gpus, "full": full}


#: How often the broker looks whether a lost front end's holder has exited.
ORPHAN_POLL_SECONDS = 0.02


def _alive(pid: int) -> bool:
    """Whether process C{pid} still exists (a zombie has ended: its GPU work is over)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _name(holder: Hashable | None) -> str | None:
    if holder is None:
        return None
    return seat_of(holder) or str(holder)


class _BrokerProtocol(amp.AMP):
    """One front end's connection to the broker."""

    def __init__(self, broker: LeaseBroker) -> None:
        super().__init__()
        self._broker = broker
        self._number = 0
        self._holders: dict[int, RemoteHolder] = {}
        self._waits: dict[int, Deferred[Grant]] = {}
        self._index: int | None = None

    def connectionMade(self) -> None:
        super().connectionMade()
        self._number = self._broker.attach(self)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        super().connectionLost(reason)
        holders = list(self._holders.values())
        self._holders.clear()
        self._broker.detach(self._number, holders)
        if self._index is not None:
            self._broker.report(self._index, None)

    @Report.responder
    def report(self, index: int, health: dict[str, Any]) -> dict[str, object]:
        self._index = index
        self._broker.report(index, health)
        return {}

    @Acquire.responder
    def acquire(
        self,
        token: int,
        gpus: list[int],
        mode: str,
        seat: str | None = None,
        pid: int | None = None,
        label: str | None = None,
        next_in_line: bool | None = None,
    ) -> Deferred[dict[str, float]]:
        # Refused before a holder is recorded for it.
        checked_request(self._broker.arbiter.gpus, tuple(gpus), mode)
        holder = self._holders.setdefault(
            token, RemoteHolder(self._number, token, seat=seat, pid=pid)
        )

        def tell() -> None:
            self.callRemote(Next, token=token)

        d = self._broker.arbiter.acquire(
            holder, tuple(gpus), label=label, mode=mode, next_in_line=tell if next_in_line else None
        )
        self._waits[token] = d

        def granted(grant: Grant) -> dict[str, float]:
            return {"requested_at": grant.requested_at, "granted_at": grant.granted_at}

        def done(result: object) -> object:
            self._waits.pop(token, None)
            if isinstance(result, Failure) and not self._broker.arbiter.holds(holder):
                self._holders.pop(token, None)
            self._broker.changed()
            return result

        d.addBoth(done)
        self._broker.changed()
        return d.addCallback(granted)

    @Withdraw.responder
    def withdraw(self, token: int) -> dict[str, object]:
        wait = self._waits.pop(token, None)
        if wait is not None:
            wait.cancel()
        return {}

    @Release.responder
    def release(self, token: int) -> dict[str, object]:
        holder = self._holders.pop(token, None)
        if holder is not None:
            self._broker.arbiter.release(holder)
            self._broker.changed()
        return {}

    @Abandon.responder
    def abandon(self, token: int) -> dict[str, object]:
        holder = self._holders.pop(token, None)
        if holder is not None:
            self._broker.arbiter.abandon(holder)
            self._broker.changed()
        return {}


def broker_factory(broker: LeaseBroker) -> Factory[_BrokerProtocol]:
    """What the broker listens with (a Unix socket only front ends can reach)."""
    factory = Factory.forProtocol(lambda: _BrokerProtocol(broker))
    factory.noisy = False
    return factory


class _FrontEndProtocol(amp.AMP):
    """A front end's connection to the broker: it takes in the pushed state."""

    def __init__(self, arbiter: RemoteArbiter) -> None:
        super().__init__()
        self._arbiter = arbiter

    def connectionMade(self) -> None:
        super().connectionMade()
        self._arbiter._connected(self)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        super().connectionLost(reason)
        self._arbiter._disconnected()

    @LeaseState.responder
    def lease_state(self, state: dict[str, Any]) -> dict[str, object]:
        self._arbiter._update(state)
        return {}

    @Next.responder
    def next_in_line(self, token: int) -> dict[str, object]:
        self._arbiter._next_in_line(token)
        return {}

    @PeerReport.responder
    def peer_report(self, index: int, health: dict[str, Any] | None) -> dict[str, object]:
        if health is None:
            self._arbiter.peer_reports.pop(index, None)
        else:
            self._arbiter.peer_reports[index] = health
        return {}


@attrs.define(eq=False)
class RemoteArbiter(LeaseBook):
    """
    L{LeaseArbiter}'s interface in a front end, for its own workers, with
    the broker deciding.  Holds and waits are this front end's; the state
    of every GPU is the broker's last push.
    """

    _protocol: _FrontEndProtocol | None = None
    _counter: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1))
    _tokens: dict[Hashable, int] = attrs.field(factory=dict)
    _waits: dict[Hashable, Deferred[Grant]] = attrs.field(factory=dict)
    #: What to call when the broker says a wait is first in line, by token.
    _next: dict[int, Callable[[], None]] = attrs.field(factory=dict)
    _gpu_state: dict[int, dict[str, Any]] = attrs.field(factory=dict)
    #: Called once the broker's connection is gone (the front end that
    #: keeps the leases ended): nothing can be granted any more.
    on_lost: Callable[[], None] | None = None
    #: Every front end's last health report, as the broker passed them on.
    peer_reports: dict[int, dict[str, Any]] = attrs.field(factory=dict)

    def report(self, index: int, health: dict[str, Any]) -> None:
        """Send this front end's own /health figures to the broker."""
        if self._protocol is not None:
            self._protocol.callRemote(Report, index=index, health=health)

    def protocol(self) -> amp.AMP:
        """A protocol that connects this arbiter to the broker."""
        return _FrontEndProtocol(self)

    def _waits_for(self, holder: Hashable) -> bool:
        return holder in self._waits

    def _refusal(self, gpus: tuple[int, ...]) -> str | None:
        if self.closed or self._protocol is None:
            return "the lease broker is not reachable"
        return None

    def _wait(self, request: LeaseRequest) -> Deferred[Grant]:
        """
        Ask the broker (L{Acquire}).  The request's C{wake} is called as the
        broker's answer arrives, its C{next_in_line} when the broker says
        this wait is first in line (L{Next}).
        """
        protocol = self._protocol
        assert protocol is not None  # L{_refusal} saw to it
        holder = request.holder
        token = next(self._counter)
        self._tokens[holder] = token
        pid = pid_of(holder)

        if request.next_in_line is not None:
            self._next[token] = request.next_in_line

        def withdraw(_: Deferred[Grant]) -> None:
            self._waits.pop(holder, None)
            self._next.pop(token, None)
            protocol.callRemote(Withdraw, token=token)

        waiting: Deferred[Grant] = Deferred(withdraw)
        self._waits[holder] = waiting
        remote = protocol.callRemote(
            Acquire,
            token=token,
            seat=seat_of(holder),
            pid=pid,
            gpus=list(request.gpus),
            label=request.label,
            mode=request.mode,
            next_in_line=request.next_in_line is not None,
        )

        def granted(answer: dict[str, float]) -> None:
            self._next.pop(token, None)
            if waiting.called or self._tokens.get(holder) != token:
                # Withdrawn or abandoned while the grant was on its way.
                protocol.callRemote(Release, token=token)
                return
            self._waits.pop(holder, None)
            grant = Grant(
                holder,
                request.gpus,
                answer["requested_at"],
                answer["granted_at"],
                request.mode,
                pid,
            )
            self._grants[holder] = grant
            if request.wake is not None:
                request.wake(grant)
            waiting.callback(grant)

        def refused(failure: Failure) -> None:
            self._next.pop(token, None)
            if waiting.called:
                return
            self._waits.pop(holder, None)
            if self._tokens.get(holder) == token:
                del self._tokens[holder]
                self._labels.pop(holder, None)
            if not failure.check(LeaseUnavailable, CancelledError):
                failure = Failure(LeaseUnavailable(f"the lease broker failed: {failure.value}"))
            waiting.errback(failure)

        remote.addCallbacks(granted, refused)
        return waiting

    def _next_in_line(self, token: int) -> None:
        """The broker says wait C{token} is first in line: tell its waiter, once."""
        tell = self._next.pop(token, None)
        if tell is not None:
            tell()

    def _released(self, grant: Grant, label: str | None) -> None:
        """Tell the broker (L{Release}); its holds come back in its pushes."""
        token = self._tokens.pop(grant.holder)
        if self._protocol is not None:
            self._protocol.callRemote(Release, token=token)

    def abandon(self, holder: Hashable) -> Grant | None:
        """Withdraw C{holder}'s wait and give back its hold."""
        grant = self._grants.pop(holder, None)
        token = self._tokens.pop(holder, None)
        self._labels.pop(holder, None)
        waiting = self._waits.pop(holder, None)
        if token is not None and self._protocol is not None:
            self._protocol.callRemote(Abandon, token=token)
        if waiting is not None and not waiting.called:
            waiting.errback(CancelledError(f"{holder!r} abandoned its lease"))
        return grant

    def holder_of(self, gpu: int) -> str | None:
        """The seat (in whichever front end) that holds C{gpu} exclusively."""
        holder: str | None = self._gpu_state.get(gpu, {}).get("holder")
        return holder

    def maintainers_of(self, gpu: int) -> frozenset[str]:
        return frozenset(self._gpu_state.get(gpu, {}).get("maintainers", ()))

    def depth(self, gpu: int) -> int:
        depth: int = self._gpu_state.get(gpu, {}).get("depth", 0)
        return depth

    def _exclusive_hold(self, gpu: int) -> tuple[float, str | None] | None:
        """Over every front end's holds, as the broker last pushed them."""
        state = self._gpu_state.get(gpu, {})
        since: float | None = state.get("since")
        if state.get("holder") is None or since is None:
            return None
        return (since, state.get("label"))

    def _usable(self) -> tuple[int, ...]:
        """Every GPU while the broker is there (it says which it refuses)."""
        return () if self._protocol is None else self.gpus

    def _connected(self, protocol: _FrontEndProtocol) -> None:
        self._protocol = protocol

    def _disconnected(self) -> None:
        """The broker is gone: nothing can be granted; waits fail, holds are void."""
        self._protocol = None
        self.closed = True
        waits, self._waits = self._waits, {}
        for waiting in waits.values():
            if not waiting.called:
                waiting.errback(LeaseUnavailable("the lease broker went away"))
        if self.on_lost is not None:
            self.on_lost()

    def _update(self, state: dict[str, Any]) -> None:
        for key, gpu_state in state["gpus"].items():
            gpu = int(key)
            if state.get("full"):
                self.history.pop(gpu, None)
            for label, start, end, mode in gpu_state["closed"]:
                self._remember(HoldInterval(gpu, None, label, start, end, mode))
            self._gpu_state[gpu] = gpu_state
