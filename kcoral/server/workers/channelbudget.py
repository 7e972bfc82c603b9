# -*- test-case-name: tests.unit.test_channelbudget -*-
"""
The server's budget for what workers send it: one L{ChannelBudget} for all
the workers of a server process (issue 32).

Each worker's channel is checked against its request's limits
(L{kcoral.wire.channel.job_limits}), but those allow a frame as large as
the largest response, and decoding a frame's JSON header takes up to ~33
times its size in Python objects: a program that wrote one such frame cost
the server 0.8 GB, and 64 workers 64 times that.  So every frame over
L{kcoral.wire.channel.CONTROL_FRAME_BYTES} first reserves, from this one
budget, what reading and decoding it may cost
(L{kcoral.wire.channel.frame_cost}); a worker whose reservation does not
fit yet is not read (the pipe fills, the worker's write waits) until other
frames are done with theirs.  Frames being read never wait for anything
else, so the reservations always come back.

What a decoded message keeps (its values and binary parts) until its job
ends is counted apart, against the same limit (L{ChannelBudget.keep}), and
never waited for (a job that keeps something may be waiting for its next
frame): a message that would pass it fails its request.  Frames being read
and messages kept together are thus at most twice the budget.

Reservations are granted first come, first served among those that fit
now: a large one waiting does not hold up smaller ones behind it.
"""

from __future__ import annotations

from collections import deque

import attrs
from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import Logger


@attrs.define(eq=False)
class ChannelBudget:
    """
    Bytes of server memory that frames read from workers may hold at once.

    @ivar limit: the budget (C{--max-channel-bytes}).
    @ivar used: what is reserved now.
    @ivar peak: the most ever reserved at once.
    """

    limit: int
    used: int = 0
    peak: int = 0
    #: What decoded messages keep until their jobs end, at most C{limit}
    #: too (L{keep}); C{used} counts only frames being read.
    kept: int = 0
    _waiting: deque[tuple[int, Deferred[None]]] = attrs.field(factory=deque)
    _granting: bool = False

    log = Logger()

    @property
    def decode_share(self) -> int:
        """
        The most one message's JSON header may take to decode (half the
        budget): a larger one is refused, and a worker leaves out results
        that would take more (L{kcoral.wire.channel.Execute.max_decode_bytes}).
        """
        return self.limit // 2

    def try_reserve(self, amount: int) -> bool:
        """Reserve C{amount} now if it fits and nobody waits for less; C{False} otherwise."""
        if self.used + amount > self.limit:
            return False
        self._take(amount)
        return True

    def reserve(self, amount: int) -> Deferred[None]:
        """
        A Deferred that fires once C{amount} is reserved (never at once:
        call L{try_reserve} first).  Cancelling it takes the request back.

        @raise ValueError: C{amount} is over the whole budget.
        """
        if amount > self.limit:
            raise ValueError(f"{amount} bytes is over the channel budget of {self.limit}")

        def cancel(d: Deferred[None]) -> None:
            for entry in self._waiting:
                if entry[1] is d:
                    self._waiting.remove(entry)
                    break

        d: Deferred[None] = Deferred(cancel)
        self._waiting.append((amount, d))
        return d

    def release(self, amount: int) -> None:
        """Give back C{amount}; waiting reservations that now fit are granted."""
        self.used -= amount
        if self.used < 0:  # pragma: no cover - a bookkeeping bug
            self.log.error("channel budget released more than it reserved ({used})", used=self.used)
            self.used = 0
        self._grant()

    def keep(self, amount: int) -> bool:
        """
        Count C{amount} as kept by a decoded message until its job ends;
        C{False} (nothing counted) when the kept total would pass the
        budget.  Never waits: a job that keeps something may be waiting
        for its next frame, so waiting here could wait for ever.
        """
        if self.kept + amount > self.limit:
            return False
        self.kept += amount
        return True

    def release_kept(self, amount: int) -> None:
        """A job ended: what its messages kept is given back."""
        self.kept = max(0, self.kept - amount)

    @property
    def waiting(self) -> int:
        """How many reservations wait."""
        return len(self._waiting)

    def _take(self, amount: int) -> None:
        self.used += amount
        self.peak = max(self.peak, self.used)

    def _grant(self) -> None:
        if self._granting:
            return  # a grant's callback released something: the loop below goes on
        self._granting = True
        try:
            granted = True
            while granted:
                granted = False
                for entry in list(self._waiting):
                    amount, d = entry
                    if self.used + amount <= self.limit:
                        self._waiting.remove(entry)
                        self._take(amount)
                        granted = True
                        d.callback(None)
        finally:
            self._granting = False


def ignore_cancel(failure: object) -> None:
    """An errback for a cancelled L{ChannelBudget.reserve}: nothing to do."""
    if hasattr(failure, "trap"):
        failure.trap(CancelledError)
