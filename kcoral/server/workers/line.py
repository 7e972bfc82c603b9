# -*- test-case-name: tests.unit.test_line -*-
"""
The waiting line for seats: requests that found no idle seat wait here, in
arrival order, each for at most its timeout on the injected clock.

L{WaitingLine} knows nothing of seats or workers: it hands whatever the pool
offers (L{WaitingLine.serve}) to the waiter at its head.  A waiter leaves the
line when it is served, when its timeout passes (L{PoolBusy}), when its
Deferred is cancelled (its client left), or when the line closes
(L{PoolStopping}).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

import attrs
from twisted.internet.defer import Deferred, fail
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger

from kcoral.server.workers.reactor import Clock

T = TypeVar("T")


class PoolBusy(Exception):
    """
    No worker could be had: the wait timed out or the pool is closing.

    @ivar queue_ms: how long the request waited, when it did.
    """

    def __init__(self, message: str = "server saturated", queue_ms: float | None = None) -> None:
        super().__init__(message)
        self.queue_ms = queue_ms


#: The message of the 503 a stopping server answers a request it cannot run.
STOPPING_MESSAGE = "server stopping"


class PoolStopping(PoolBusy):
    """The pool is closing (the server is stopping): the request did not run."""

    def __init__(self, queue_ms: float | None = None) -> None:
        super().__init__(STOPPING_MESSAGE, queue_ms)


@attrs.define(eq=False)
class _Waiter(Generic[T]):
    deferred: Deferred[T]
    client: str | None
    seat_only: bool = False
    timer: IDelayedCall | None = None


@attrs.define(eq=False)
class WaitingLine(Generic[T]):
    """
    A FIFO line of requests waiting for something the pool hands out.

    @ivar limit: how many may wait at once (each waiter holds its request's
        blobs); C{0}: no limit.
    """

    _clock: Clock
    limit: int = 0
    _waiters: deque[_Waiter[T]] = attrs.field(factory=deque)
    closed: bool = False
    #: Called after each L{serve} (the pool offered a seat): what the line
    #: did not take is free now (a joined node pulls a job for it,
    #: L{kcoral.server.join.puller}).
    offered: list[Callable[[], None]] = attrs.field(factory=list)

    log = Logger()

    def __len__(self) -> int:
        return len(self._waiters)

    def join(
        self, timeout: float, client: str | None = None, *, seat_only: bool = False
    ) -> Deferred[T]:
        """
        Wait at the end of the line for at most C{timeout} seconds.

        The Deferred fires with what L{serve} hands this waiter, or fails
        with L{PoolBusy} when the timeout passes, at once when C{timeout} is
        not positive or the line is full, and with L{PoolStopping} when the
        line is (or gets) closed.  Cancelling it leaves the line.

        @param client: who waits (the request's client address), for
            L{serve}'s C{take}.
        @param seat_only: what the waiter wants, for L{serve}'s C{take}
            too: a seat only, not its worker (a program the server runs
            itself).
        """
        if self.closed:
            return fail(PoolStopping())
        if timeout <= 0 or (self.limit and len(self._waiters) >= self.limit):
            return fail(PoolBusy("server saturated"))

        def cancel(_: Deferred[T]) -> None:
            self._leave(waiter)

        waiter: _Waiter[T] = _Waiter(Deferred(cancel), client, seat_only)
        waiter.timer = self._clock.callLater(timeout, self._expired, waiter)
        self._waiters.append(waiter)
        return waiter.deferred

    def serve(self, take: Callable[[str | None, bool], Deferred[T] | None]) -> int:
        """
        Serve waiters from the head of the line while C{take} has something
        for them: C{take(client, seat_only)} returns what the head waiter
        gets (a Deferred, chained to the waiter's) or C{None} when nothing
        is left, which leaves the head waiter in line.  Returns how many
        were served.
        """
        served = 0
        while self._waiters:
            # Out of the line while C{take} runs: whatever it sets off cannot
            # serve this waiter twice.
            head = self._waiters.popleft()
            given = take(head.client, head.seat_only)
            if given is None:
                self._waiters.appendleft(head)
                break
            self._leave(head)
            given.chainDeferred(head.deferred)
            served += 1
        for listener in list(self.offered):
            try:
                listener()
            except Exception:
                self.log.failure("a listener of the waiting line failed")
        return served

    def close(self) -> None:
        """Refuse new waiters and fail every waiting one with L{PoolStopping}."""
        self.closed = True
        while self._waiters:
            waiter = self._waiters[0]
            self._leave(waiter)
            waiter.deferred.errback(PoolStopping())

    def _leave(self, waiter: _Waiter[T]) -> None:
        if waiter in self._waiters:
            self._waiters.remove(waiter)
        if waiter.timer is not None and waiter.timer.active():
            waiter.timer.cancel()
        waiter.timer = None

    def _expired(self, waiter: _Waiter[T]) -> None:
        waiter.timer = None
        if waiter in self._waiters:
            self._waiters.remove(waiter)
            waiter.deferred.errback(PoolBusy("server saturated"))
