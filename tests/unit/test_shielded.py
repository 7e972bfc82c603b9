"""
L{kcoral.server.workers.reactor.shielded}: a wait that may be given up
without stopping what it waits for.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from kcoral.server.workers.reactor import shielded


class ShieldedTests(SynchronousTestCase):
    def test_result_passes_through(self) -> None:
        """Until it is cancelled the copy takes the work's result, and the work keeps none."""
        work: Deferred[int] = Deferred()
        copy = shielded(work)
        work.callback(7)
        self.assertEqual(self.successResultOf(copy), 7)
        self.assertIsNone(self.successResultOf(work))

    def test_failure_passes_through(self) -> None:
        """A failure before the copy is cancelled is the copy's, not the orphan handler's."""
        orphans: list[Failure] = []
        work: Deferred[int] = Deferred()
        copy = shielded(work, orphans.append)
        work.errback(ValueError("no"))
        self.failureResultOf(copy, ValueError)
        self.assertEqual(orphans, [])

    def test_cancel_leaves_the_work(self) -> None:
        """
        Cancelling the copy does not cancel the work; its later result stays
        with it, for whoever cleans up after it.
        """
        cancelled: list[Any] = []
        work: Deferred[int] = Deferred(cancelled.append)
        copy = shielded(work)
        copy.cancel()
        self.failureResultOf(copy, CancelledError)
        self.assertEqual(cancelled, [])
        work.callback(7)
        self.assertEqual(self.successResultOf(work), 7)

    def test_failure_after_cancel_is_orphaned(self) -> None:
        """A failure after the copy was cancelled goes to the orphan handler."""
        orphans: list[Failure] = []
        work: Deferred[int] = Deferred()
        copy = shielded(work, orphans.append)
        copy.cancel()
        self.failureResultOf(copy, CancelledError)
        work.errback(ValueError("late"))
        self.assertEqual([f.type for f in orphans], [ValueError])
        self.assertIsNone(self.successResultOf(work))
