# -*- test-case-name: tests.unit.test_lease -*-
"""
Exclusive, FIFO, per-GPU leases arbitrated in the reactor process.

Workers share a GPU; only the holder of its lease may run device work.  The
arbiter lives on the reactor thread, so a worker that dies can never leave a
lock behind: L{LeaseArbiter.abandon} drops everything its holder held or
waited for.  Requests for a set of GPUs are all-or-nothing, granted in arrival
order, and a waiting request reserves its GPUs against younger requests, so no
one holds part of a set while waiting for the rest (no deadlock, no
starvation).

Two modes share the list.  An C{exclusive} hold is a request's (or a worker's
start-up's) GPU work: nobody else holds the GPU meanwhile.  A C{maintenance}
hold is a CUDA context creation or teardown: several of them may hold a GPU
together (the driver serialises them anyway, and batching them shortens the
time the GPU is closed to requests), but never together with an exclusive
holder, so no context is made or destroyed beside a measurement.  Requests go
first when both wait: a maintenance waiter is placed in the line as if it
had arrived L{LeaseArbiter.maintenance_patience} seconds later than it did,
which also bounds how long requests can keep spares and teardowns waiting.
A maintenance batch admits every maintenance waiter that is due when it is
granted, and later ones while no exclusive waiter is in line ahead of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from typing import TYPE_CHECKING, Protocol

import attrs
from twisted.internet.defer import CancelledError, Deferred, fail, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

if TYPE_CHECKING:
    from kcoral.server.leases.monitor import GpuMonitor

#: The lease modes (see the module docstring).
EXCLUSIVE = "exclusive"
MAINTENANCE = "maintenance"
MODES = (EXCLUSIVE, MAINTENANCE)

#: Label prefixes (C{"warmup:gpu0/w1"}) that name what a hold is for other
#: than a request; a hold labelled otherwise is a request's (its id).
PURPOSES = ("warmup", "context_create", "context_teardown")


class Leases(Protocol):
    """
    What the pool, the workers and the API use of a lease: L{LeaseArbiter}
    in one process, L{kcoral.server.leases.broker.RemoteArbiter} in a front
    end whose leases another process keeps (both a L{LeaseBook}).
    """

    gpus: tuple[int, ...]
    monitor: GpuMonitor | None

    def acquire(
        self,
        holder: Hashable,
        gpus: tuple[int, ...],
        label: str | None = ...,
        mode: str = ...,
        *,
        wake: Callable[[Grant], None] | None = ...,
        next_in_line: Callable[[], None] | None = ...,
    ) -> Deferred[Grant]: ...

    def release(self, holder: Hashable) -> Grant | None: ...

    def abandon(self, holder: Hashable) -> Grant | None: ...

    def close(self) -> None: ...

    def holds(self, holder: Hashable) -> bool: ...

    def grant_of(self, holder: Hashable) -> Grant | None: ...

    def holder_of(self, gpu: int) -> Hashable | None: ...

    def maintainers_of(self, gpu: int) -> frozenset[Hashable]: ...

    def labels_during(self, gpu: int, start: float, end: float) -> set[str | None]: ...

    def depth(self, gpu: int) -> int: ...

    def least_busy(self, count: int) -> tuple[int, ...]: ...


def checked_request(
    configured: tuple[int, ...], gpus: tuple[int, ...], mode: str
) -> tuple[int, ...]:
    """
    The GPU ids a lease request names, sorted without repeats.

    @raise ValueError: an unknown mode, or a GPU the server does not have.
    """
    if mode not in MODES:
        raise ValueError(f"unknown lease mode {mode!r}")
    gpus = tuple(sorted(set(gpus)))
    unknown = set(gpus) - set(configured)
    if unknown:
        raise ValueError(f"unknown GPU id(s): {sorted(unknown)}")
    return gpus


def covers(existing: Grant, gpus: tuple[int, ...], mode: str) -> bool:
    """Whether a holder's grant already serves a request (exclusive is the stronger mode)."""
    return set(gpus) <= set(existing.gpus) and (existing.mode == mode or existing.mode == EXCLUSIVE)


def least_busy_of(
    order: tuple[int, ...], usable: Iterable[int], depth: Callable[[int], int], count: int
) -> tuple[int, ...]:
    """The C{count} C{usable} GPUs of least C{depth} (ties in C{order}), in ascending order."""
    chosen = sorted(usable, key=lambda gpu: (depth(gpu), order.index(gpu)))[:count]
    return tuple(sorted(chosen))


def labels_between(intervals: Iterable[HoldInterval], start: float, end: float) -> set[str | None]:
    """The labels of the closed holds that overlapped C{[start, end]}."""
    return {i.label for i in intervals if i.start <= end and i.end >= start}


class LeaseUnavailable(Exception):
    """The requested GPUs are quarantined or the arbiter is closed."""


@attrs.frozen
class Grant:
    """A granted lease: who holds which GPUs since when."""

    holder: Hashable
    gpus: tuple[int, ...]
    requested_at: float
    granted_at: float
    mode: str = EXCLUSIVE
    #: The holder's process id when granted (a worker forked by a template
    #: learns its pid a moment after it starts): the grant and its release
    #: are logged with this one, so a log reader can pair them.
    pid: int | None = None

    @property
    def wait_seconds(self) -> float:
        return self.granted_at - self.requested_at


@attrs.frozen
class HoldInterval:
    """One closed hold, kept for overlap checks and interference reports."""

    gpu: int
    holder: Hashable
    label: str | None
    start: float
    end: float
    mode: str = EXCLUSIVE


@attrs.frozen
class LeaseRequest:
    """A checked request of L{LeaseBook.acquire}'s, as a book puts it in line."""

    holder: Hashable
    gpus: tuple[int, ...]
    label: str | None
    mode: str
    wake: Callable[[Grant], None] | None
    next_in_line: Callable[[], None] | None


@attrs.define(eq=False)
class _Waiter:
    holder: Hashable
    gpus: tuple[int, ...]
    requested_at: float
    deferred: Deferred[Grant]
    mode: str = EXCLUSIVE
    #: Arrival order, the tie-break between equal places in line.
    serial: int = 0
    #: Told of the grant before any event is logged (see L{LeaseArbiter.acquire}).
    wake: Callable[[Grant], None] | None = None
    #: Told once when first in line for a GPU another holds.
    next_in_line: Callable[[], None] | None = None
    told_next: bool = False


def seat_of(holder: Hashable) -> str | None:
    """The seat a holder names itself by (a worker's or a remote holder's), if any."""
    seat: str | None = getattr(holder, "seat", None)
    return seat


def pid_of(holder: Hashable) -> int | None:
    """The process id of a holder that runs as a process (a worker), if known yet."""
    pid: int | None = getattr(holder, "pid", None)
    return pid


#: What a lease refuses with while its GPUs cannot be had.
DEVICE_UNAVAILABLE = "worker cleanup failed; device unavailable"


@attrs.define
class LeaseBook(ABC):
    """
    The bookkeeping every kind of lease keeps for its own holders, whoever
    decides the grants: L{LeaseArbiter} decides them in this process,
    L{kcoral.server.leases.broker.RemoteArbiter} asks the broker.

    It owns the grants and labels of its holders, the re-entrant and
    refused answers of L{acquire}, L{release}'s bookkeeping, the closed
    holds' history, and the queries over them; a subclass says how a
    request waits (L{_wait}) and what a GPU's state is now.

    @ivar history: the last C{history_size} closed hold intervals per GPU.
    """

    gpus: tuple[int, ...]
    _clock: IReactorTime
    history_size: int = 256
    closed: bool = False
    _labels: dict[Hashable, str | None] = attrs.field(factory=dict)
    _grants: dict[Hashable, Grant] = attrs.field(factory=dict)
    history: dict[int, deque[HoldInterval]] = attrs.field(factory=dict)
    #: The GPU monitor watching these GPUs, once it runs
    #: (L{kcoral.server.leases.monitor.GpuMonitorService}): workers have
    #: their timed loops judged by it.
    monitor: GpuMonitor | None = None

    def acquire(
        self,
        holder: Hashable,
        gpus: tuple[int, ...],
        label: str | None = None,
        mode: str = EXCLUSIVE,
        *,
        wake: Callable[[Grant], None] | None = None,
        next_in_line: Callable[[], None] | None = None,
    ) -> Deferred[Grant]:
        """
        Ask for every GPU in C{gpus} at once.

        Re-entrant: a holder that already holds them gets its grant back at
        once (an exclusive hold also serves a maintenance request: it is the
        stronger of the two).  Cancelling the returned Deferred withdraws the
        request.

        @param label: recorded with the hold (the request id), so a report
            can name the request that held a GPU at some moment.
        @param mode: L{EXCLUSIVE} (GPU work) or L{MAINTENANCE} (a context
            creation or teardown; see the module docstring).
        @param wake: called with the grant the moment it is made, before the
            release that freed it and the grant itself are logged and before
            the Deferred fires: the one write that lets a waiting worker go,
            taken off the hand-over's path through the log observers.  It
            must not log (the log's order is release, grant, then whatever
            the Deferred's callbacks do).
        @param next_in_line: called once, when this request becomes the
            first in line for a GPU another holds: its grant is the next
            hand-over (L{kcoral.server.workers.runningjob} lets the worker watch
            for it without sleeping).
        """
        gpus = checked_request(self.gpus, gpus, mode)
        existing = self._grants.get(holder)
        if existing is not None and covers(existing, gpus, mode):
            if wake is not None:
                wake(existing)
            return succeed(existing)
        if existing is not None or self._waits_for(holder):
            raise RuntimeError(f"{holder!r} already holds or waits for GPUs")
        refusal = self._refusal(gpus)
        if refusal is not None:
            return fail(LeaseUnavailable(refusal))
        self._labels[holder] = label
        return self._wait(LeaseRequest(holder, gpus, label, mode, wake, next_in_line))

    def release(self, holder: Hashable) -> Grant | None:
        """
        Give back everything C{holder} holds (a wait of its stands).

        @return: the grant that ended, or C{None} if nothing was held.
        """
        grant = self._grants.pop(holder, None)
        if grant is None:
            return None
        self._released(grant, self._labels.pop(holder, None))
        return grant

    @property
    def clock(self) -> IReactorTime:
        """The clock the book's times are read on (a broker times its pushes by it)."""
        return self._clock

    def close(self) -> None:
        """Refuse new requests (shutdown); grants and waiters already queued stand."""
        self.closed = True

    def holds(self, holder: Hashable) -> bool:
        """Whether C{holder} holds a grant now (either mode)."""
        return holder in self._grants

    def grant_of(self, holder: Hashable) -> Grant | None:
        """What C{holder} holds now, if anything."""
        return self._grants.get(holder)

    def label_of(self, holder: Hashable) -> str | None:
        """The label C{holder} acquired with."""
        return self._labels.get(holder)

    def labels_during(self, gpu: int, start: float, end: float) -> set[str | None]:
        """
        The labels of every hold of C{gpu} that overlapped C{[start, end]},
        the current hold included (which request held a GPU at some moment).
        """
        labels = labels_between(self.history.get(gpu, ()), start, end)
        current = self._exclusive_hold(gpu)
        if current is not None and current[0] <= end:
            labels.add(current[1])
        return labels

    def least_busy(self, count: int) -> tuple[int, ...]:
        """
        The C{count} usable GPUs with the fewest holders and waiters (ties in
        configured order), in ascending order: where a multi-GPU program
        starts its worker, before it holds anything.

        @raise LeaseUnavailable: fewer than C{count} GPUs can be leased.
        """
        if count < 1:
            raise ValueError(f"cannot lease {count} GPUs")
        usable = self._usable()
        if self.closed or count > len(usable):
            raise LeaseUnavailable(DEVICE_UNAVAILABLE)
        return least_busy_of(self.gpus, usable, self.depth, count)

    def _remember(self, interval: HoldInterval) -> None:
        """Keep a closed hold in its GPU's history."""
        intervals = self.history.setdefault(interval.gpu, deque(maxlen=self.history_size))
        intervals.append(interval)

    @abstractmethod
    def holder_of(self, gpu: int) -> Hashable | None:
        """Who holds C{gpu} exclusively now."""

    @abstractmethod
    def maintainers_of(self, gpu: int) -> frozenset[Hashable]:
        """Who holds C{gpu} for a context creation or teardown now."""

    @abstractmethod
    def depth(self, gpu: int) -> int:
        """
        Waiters that want C{gpu}, plus one if it is held (the /health
        C{lease_depth}); a maintenance batch counts as one holder.
        """

    @abstractmethod
    def _waits_for(self, holder: Hashable) -> bool:
        """Whether a second request of C{holder}'s, while one waits, is a mistake."""

    @abstractmethod
    def _refusal(self, gpus: tuple[int, ...]) -> str | None:
        """Why a request for C{gpus} cannot be granted now, if it cannot."""

    @abstractmethod
    def _wait(self, request: LeaseRequest) -> Deferred[Grant]:
        """Put a checked request in line (see L{acquire})."""

    @abstractmethod
    def _released(self, grant: Grant, label: str | None) -> None:
        """A grant ended (L{release}); its holder's books are already cleared."""

    @abstractmethod
    def _exclusive_hold(self, gpu: int) -> tuple[float, str | None] | None:
        """Since when, and with what label, C{gpu} is held exclusively now."""

    @abstractmethod
    def _usable(self) -> tuple[int, ...]:
        """The GPUs a new request may be granted."""


@attrs.define
class LeaseArbiter(LeaseBook):
    """
    One lease per configured GPU, decided in this process.

    @ivar maintenance_patience: how far back in line a maintenance waiter
        is placed (seconds): exclusive requests that arrive up to this long
        after it go first; older ones never wait for it.
    """

    maintenance_patience: float = 1.0
    #: The exclusive holder of each held GPU.
    _holders: dict[int, Hashable] = attrs.field(factory=dict)
    #: The maintenance holders of each GPU in maintenance (never empty sets).
    _maintainers: dict[int, set[Hashable]] = attrs.field(factory=dict)
    _serial: int = 0
    _waiters: deque[_Waiter] = attrs.field(factory=deque)
    _quarantined: set[int] = attrs.field(factory=set)

    log = Logger()

    def _event(
        self,
        name: str,
        holder: Hashable,
        gpus: tuple[int, ...],
        label: str | None,
        **fields: object,
    ) -> None:
        purpose = "request"
        if isinstance(label, str):
            prefix = label.partition(":")[0]
            if prefix in PURPOSES and ":" in label:
                purpose = prefix
        self.log.info(
            "{kcoral_event} GPU(s) {gpu_ids} for {holder}",
            kcoral_event=name,
            gpu_ids=list(gpus),
            holder=seat_of(holder) or getattr(holder, "request_id", None),
            request_id=None if purpose != "request" or not isinstance(label, str) else label,
            purpose=purpose,
            **fields,
        )

    def _waits_for(self, holder: Hashable) -> bool:
        # A holder may queue more than one request here (L{abandon} withdraws them all).
        return False

    def _refusal(self, gpus: tuple[int, ...]) -> str | None:
        if self.closed or self._quarantined & set(gpus):
            return DEVICE_UNAVAILABLE
        return None

    def _wait(self, request: LeaseRequest) -> Deferred[Grant]:
        def cancel(d: Deferred[Grant]) -> None:
            self._waiters.remove(waiter)
            self._dispatch()

        self._serial += 1
        waiter = _Waiter(
            request.holder,
            request.gpus,
            self._clock.seconds(),
            Deferred(cancel),
            mode=request.mode,
            serial=self._serial,
            wake=request.wake,
            next_in_line=request.next_in_line,
        )
        self._waiters.append(waiter)
        self._dispatch()
        return waiter.deferred

    def _released(self, grant: Grant, label: str | None) -> None:
        """Free the grant's GPUs, keep its holds in the history, wake the next waiters."""
        now = self._clock.seconds()
        holder = grant.holder

        def log_release() -> None:
            self._event(
                "lease_released",
                holder,
                grant.gpus,
                label,
                mode=grant.mode,
                pid=grant.pid,
                held_ms=(now - grant.granted_at) * 1000.0,
            )

        for gpu in grant.gpus:
            if grant.mode == EXCLUSIVE:
                del self._holders[gpu]
            else:
                maintainers = self._maintainers[gpu]
                maintainers.discard(holder)
                if not maintainers:
                    del self._maintainers[gpu]
            self._remember(HoldInterval(gpu, holder, label, grant.granted_at, now, grant.mode))
        self._dispatch(log_release)

    def abandon(self, holder: Hashable) -> Grant | None:
        """Withdraw C{holder}'s pending requests and release what it holds."""
        for waiter in [w for w in self._waiters if w.holder == holder]:
            self._waiters.remove(waiter)
            waiter.deferred.errback(CancelledError(f"{holder!r} abandoned its lease"))
        grant = self.release(holder)
        self._labels.pop(holder, None)
        self._dispatch()
        return grant

    def quarantine(self, gpus: tuple[int, ...]) -> None:
        """Never grant C{gpus} again; fail the waiters that need them."""
        self._quarantined.update(gpus)
        for waiter in [w for w in self._waiters if self._quarantined & set(w.gpus)]:
            self._waiters.remove(waiter)
            waiter.deferred.errback(LeaseUnavailable(DEVICE_UNAVAILABLE))
        self._dispatch()

    def holder_of(self, gpu: int) -> Hashable | None:
        """Who holds C{gpu} exclusively now."""
        return self._holders.get(gpu)

    def maintainers_of(self, gpu: int) -> frozenset[Hashable]:
        """Who holds C{gpu} for a context creation or teardown now."""
        return frozenset(self._maintainers.get(gpu, ()))

    def _exclusive_hold(self, gpu: int) -> tuple[float, str | None] | None:
        holder = self._holders.get(gpu)
        if holder is None:
            return None
        return (self._grants[holder].granted_at, self._labels.get(holder))

    def depth(self, gpu: int) -> int:
        """
        Waiters that want C{gpu}, plus one if it is held (the /health
        C{lease_depth}); a maintenance batch counts as one holder.
        """
        waiting = sum(1 for w in self._waiters if gpu in w.gpus)
        held = gpu in self._holders or gpu in self._maintainers
        return waiting + (1 if held else 0)

    def _usable(self) -> tuple[int, ...]:
        return tuple(gpu for gpu in self.gpus if gpu not in self._quarantined)

    def _place(self, waiter: _Waiter) -> tuple[float, int]:
        """A waiter's place in line: a maintenance waiter stands back."""
        delay = self.maintenance_patience if waiter.mode == MAINTENANCE else 0.0
        return (waiter.requested_at + delay, waiter.serial)

    def _dispatch(self, log_release: Callable[[], None] | None = None) -> None:
        """
        Grant, in line order (L{_place}), every request whose GPUs are free
        for its mode and not reserved by a waiter ahead of it.

        A waiting exclusive request reserves its GPUs against everyone behind
        it; a waiting maintenance request only against exclusive requests
        behind it (maintenance waiters behind it may still join a batch).

        The new holders are woken first; then the release that freed the
        GPUs (C{log_release}) and the grants are logged, in that order, and
        the grants' Deferreds fire; last, the first waiter in line for each
        GPU still held is told it is next.
        """
        reserved: set[int] = set()
        reserved_by_maintenance: set[int] = set()
        granted: list[tuple[_Waiter, Grant]] = []
        first_in_line: list[_Waiter] = []
        lined_up: set[int] = set()
        for waiter in sorted(self._waiters, key=self._place):
            wanted = set(waiter.gpus)
            if waiter.mode == EXCLUSIVE:
                blocked = (
                    bool(wanted & (reserved | reserved_by_maintenance))
                    or any(g in self._holders for g in wanted)
                    or any(g in self._maintainers for g in wanted)
                )
                if blocked:
                    reserved |= wanted
                    if wanted - lined_up:
                        first_in_line.append(waiter)
                    lined_up |= wanted
                    continue
            else:
                blocked = bool(wanted & reserved) or any(g in self._holders for g in wanted)
                if blocked:
                    reserved_by_maintenance |= wanted
                    lined_up |= wanted
                    continue
            grant = Grant(
                waiter.holder,
                waiter.gpus,
                waiter.requested_at,
                self._clock.seconds(),
                waiter.mode,
                pid_of(waiter.holder),
            )
            for gpu in waiter.gpus:
                if waiter.mode == EXCLUSIVE:
                    self._holders[gpu] = waiter.holder
                else:
                    self._maintainers.setdefault(gpu, set()).add(waiter.holder)
            self._grants[waiter.holder] = grant
            granted.append((waiter, grant))
        for waiter, _grant in granted:
            self._waiters.remove(waiter)
        for waiter, grant in granted:
            if waiter.wake is not None:
                try:
                    waiter.wake(grant)
                except Exception:
                    # Its Deferred still fires: the grant stands either way.
                    self.log.failure("waking a lease holder failed", holder=waiter.holder)
        if log_release is not None:
            log_release()
        for waiter, grant in granted:
            self._event(
                "lease_granted",
                waiter.holder,
                grant.gpus,
                self._labels.get(waiter.holder),
                mode=grant.mode,
                pid=grant.pid,
                wait_ms=grant.wait_seconds * 1000.0,
            )
            waiter.deferred.callback(grant)
        for waiter in first_in_line:
            # A Deferred's callback above may have withdrawn it.
            if waiter.next_in_line is None or waiter.told_next or waiter not in self._waiters:
                continue
            waiter.told_next = True
            try:
                waiter.next_in_line()
            except Exception:
                self.log.failure("telling a lease waiter it is next failed", holder=waiter.holder)
