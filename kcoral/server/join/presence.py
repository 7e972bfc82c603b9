# -*- test-case-name: tests.unit.test_join -*-
"""
The node's presence key: who it is, what it can run, how many seats are
free.

L{PresenceAnnouncer} puts the node's L{kcoral.gateway.jobs.Presence} in the
C{kcoral-nodes} bucket every C{interval} seconds and when its free seats
change, at most once every C{min_gap} seconds for changes: the gateway
watches the bucket, so a busy node putting its key at each job's start and
end would cost the gateway an event per put (several per job).  The bucket's TTL (the presence timeout, a few seconds)
removes the key of a node that stops putting it: a node killed mid-job
vanishes from the pool within the timeout, and the gateway answers its
claimed jobs 502.  A clean stop deletes the key at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from kcoral.gateway.jobs import Presence
from kcoral.server.join.queue import IJobQueue

__all__ = ["PresenceAnnouncer"]


@attrs.define(eq=False)
class PresenceAnnouncer:
    """
    Puts C{base} with the current free seats and time, every C{interval}
    seconds, and on L{changed} when the free seats differ from the last
    put's, no sooner than C{min_gap} seconds after it; one put at a time.
    """

    queue: IJobQueue
    _clock: IReactorTime
    base: Presence
    free: Callable[[], int]
    interval: float = 1.0
    min_gap: float = 0.1
    _loop: LoopingCall | None = None
    #: When the last put started, and the free seats it put.
    _last_at: float | None = None
    _last_free: int | None = None
    #: A put of a change, waiting out C{min_gap}.
    _later: IDelayedCall | None = None
    _putting: bool = False
    _again: bool = False
    _failing: bool = False
    #: Puts that succeeded (for tests and /health).
    puts: int = 0

    log = Logger()

    def start(self) -> None:
        loop = LoopingCall(self.refresh)
        loop.clock = self._clock
        self._loop = loop
        d = loop.start(self.interval, now=True)
        d.addErrback(lambda f: self.log.failure("presence loop failed", f))

    def current(self) -> Presence:
        """The record to put now."""
        return attrs.evolve(self.base, free=self.free(), at=self._clock.seconds())

    def changed(self) -> None:
        """
        The free seats may have changed: put the key if they did, now or
        once C{min_gap} has passed since the last put.
        """
        if self._later is not None or self.free() == self._last_free:
            return
        now = self._clock.seconds()
        if self._last_at is not None and now - self._last_at < self.min_gap:
            self._later = self._clock.callLater(self._last_at + self.min_gap - now, self._due)
            return
        self.refresh()

    def _due(self) -> None:
        self._later = None
        self.changed()

    def refresh(self) -> None:
        """Put the key now (or right after the put in flight)."""
        if self._putting:
            self._again = True
            return
        self._putting = True
        self._again = False
        record = self.current()
        self._last_at, self._last_free = self._clock.seconds(), record.free
        d = self.queue.put_presence(record)
        d.addCallbacks(self._put, self._failed)
        d.addBoth(self._settled)

    def _put(self, _: object) -> None:
        self.puts += 1
        if self._failing:
            self._failing = False
            self.log.info(
                "presence of {node} restored",
                kcoral_event="join_presence_restored",
                node=self.base.node,
            )

    def _failed(self, failure: Failure) -> None:
        if not self._failing:
            self._failing = True
            self.log.warn(
                "cannot put the presence of {node} ({error}); the gateway stops counting "
                "this node once its key expires",
                kcoral_event="join_presence_failed",
                node=self.base.node,
                error=failure.getErrorMessage(),
            )

    def _settled(self, _: object) -> None:
        self._putting = False
        if self._again and self._loop is not None:
            self.refresh()

    def stop(self) -> Deferred[Any]:
        """Stop putting, and delete the key (a failure is logged, not raised)."""
        loop, self._loop = self._loop, None
        if loop is not None and loop.running:
            loop.stop()
        later, self._later = self._later, None
        if later is not None and later.active():
            later.cancel()
        d = self.queue.delete_presence()

        def failed(failure: Failure) -> None:
            self.log.info(
                "presence of {node} not deleted ({error}); it expires by itself",
                kcoral_event="join_presence_left",
                node=self.base.node,
                error=failure.getErrorMessage(),
            )

        d.addErrback(failed)
        return d
