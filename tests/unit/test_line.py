"""
Tests for L{kcoral.server.workers.line.WaitingLine}, on a L{task.Clock}.
"""

from __future__ import annotations

from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from kcoral.server.workers.line import PoolBusy, PoolStopping, WaitingLine


class Offers:
    """What the pool would hand out: a stack of items, recording who asked."""

    def __init__(self, *items: str) -> None:
        self.items = list(items)
        self.asked: list[str | None] = []
        self.seat_only: list[bool] = []

    def take(self, client: str | None, seat_only: bool = False) -> Deferred[str] | None:
        self.asked.append(client)
        self.seat_only.append(seat_only)
        if not self.items:
            return None
        return succeed(self.items.pop(0))


class WaitingLineTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.line: WaitingLine[str] = WaitingLine(self.clock)

    def test_fifo(self) -> None:
        """Waiters are served in the order they joined, one item each."""
        first = self.line.join(10, "a")
        second = self.line.join(10, "b")
        third = self.line.join(10, "c")
        offers = Offers("x", "y")
        self.assertEqual(self.line.serve(offers.take), 2)
        self.assertEqual(self.successResultOf(first), "x")
        self.assertEqual(self.successResultOf(second), "y")
        self.assertNoResult(third)
        self.assertEqual(offers.asked, ["a", "b", "c"])
        self.assertEqual(len(self.line), 1)

    def test_seat_only(self) -> None:
        """What each waiter wants (a seat only, or its worker too) reaches C{take}."""
        self.line.join(10, "a", seat_only=True)
        self.line.join(10, "b")
        offers = Offers("x", "y")
        self.line.serve(offers.take)
        self.assertEqual((offers.asked, offers.seat_only), (["a", "b"], [True, False]))

    def test_nothing_to_serve(self) -> None:
        """With nothing on offer the head waiter keeps its place."""
        first = self.line.join(10, "a")
        self.line.join(10, "b")
        self.assertEqual(self.line.serve(Offers().take), 0)
        self.assertEqual(len(self.line), 2)
        self.line.serve(Offers("x").take)
        self.assertEqual(self.successResultOf(first), "x")

    def test_offered_listeners_told_after_serving(self) -> None:
        """
        Listeners hear of each offer once the line has taken what it
        wants; one that fails is logged and the others still hear.
        """
        heard: list[int] = []
        first = self.line.join(10, "a")

        def broken() -> None:
            raise RuntimeError("listener bug")

        self.line.offered += [lambda: heard.append(len(self.line)), broken]
        self.line.offered.append(lambda: heard.append(-1))
        self.line.serve(Offers("x", "y").take)
        self.assertEqual(self.successResultOf(first), "x")
        self.assertEqual(heard, [0, -1])
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.line.serve(Offers().take)
        self.assertEqual(heard, [0, -1, 0, -1])
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    def test_timeout(self) -> None:
        """A waiter not served within its timeout fails with PoolBusy."""
        waiting = self.line.join(5)
        self.clock.advance(4.9)
        self.assertNoResult(waiting)
        self.clock.advance(0.1)
        failure = self.failureResultOf(waiting, PoolBusy)
        self.assertNotIsInstance(failure.value, PoolStopping)
        self.assertEqual(str(failure.value), "server saturated")
        self.assertEqual(len(self.line), 0)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_served_stops_its_timer(self) -> None:
        """A served waiter's timeout is cancelled."""
        waiting = self.line.join(5)
        self.line.serve(Offers("x").take)
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.clock.advance(10)
        self.assertEqual(self.successResultOf(waiting), "x")

    def test_no_wait(self) -> None:
        """A timeout that is not positive fails at once, without joining."""
        self.failureResultOf(self.line.join(0), PoolBusy)
        self.failureResultOf(self.line.join(-1), PoolBusy)
        self.assertEqual(len(self.line), 0)

    def test_limit(self) -> None:
        """A full line refuses the next waiter at once."""
        line: WaitingLine[str] = WaitingLine(self.clock, limit=2)
        line.join(10)
        line.join(10)
        self.failureResultOf(line.join(10), PoolBusy)
        self.assertEqual(len(line), 2)

    def test_cancel_while_waiting(self) -> None:
        """Cancelling leaves the line and stops the timer."""
        waiting = self.line.join(5)
        waiting.cancel()
        self.failureResultOf(waiting, CancelledError)
        self.assertEqual(len(self.line), 0)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_freed_after_head_cancelled(self) -> None:
        """What is freed after the head waiter left goes to the next one."""
        first = self.line.join(5, "a")
        second = self.line.join(5, "b")
        first.cancel()
        offers = Offers("x")
        self.line.serve(offers.take)
        self.assertEqual(self.successResultOf(second), "x")
        self.assertEqual(offers.asked, ["b"])
        self.failureResultOf(first, CancelledError)

    def test_cancel_after_timeout_harmless(self) -> None:
        """Cancelling a waiter whose time ran out changes nothing."""
        waiting = self.line.join(1)
        self.clock.advance(1)
        self.failureResultOf(waiting, PoolBusy)
        waiting.cancel()
        self.assertEqual(len(self.line), 0)

    def test_close(self) -> None:
        """Closing fails every waiter with PoolStopping and refuses new ones."""
        waiting = [self.line.join(5), self.line.join(5)]
        self.line.close()
        for d in waiting:
            self.failureResultOf(d, PoolStopping)
        self.failureResultOf(self.line.join(5), PoolStopping)
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.assertEqual(len(self.line), 0)

    def test_take_cannot_serve_twice(self) -> None:
        """
        A C{take} that sets off another C{serve} (a seat freed while the head
        waiter is being handed one) does not hand the head waiter twice.
        """
        first = self.line.join(5, "a")
        second = self.line.join(5, "b")
        items = ["x", "y"]

        def take(client: str | None, seat_only: bool) -> Deferred[str] | None:
            if not items:
                return None
            item = items.pop(0)
            if item == "x":
                self.line.serve(take)
            return succeed(item)

        self.line.serve(take)
        self.assertEqual(self.successResultOf(first), "x")
        self.assertEqual(self.successResultOf(second), "y")

    def test_served_later(self) -> None:
        """An item handed over later (a Deferred) reaches the waiter when it fires."""
        waiting = self.line.join(5)
        later: Deferred[str] = Deferred()
        self.line.serve(lambda client, seat_only: later)
        self.assertNoResult(waiting)
        self.assertEqual(len(self.line), 0)
        self.clock.advance(10)
        self.assertNoResult(waiting)
        later.callback("x")
        self.assertEqual(self.successResultOf(waiting), "x")
