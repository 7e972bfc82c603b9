"""
Tests for L{kcoral.server.leases.lease}: exclusive, FIFO, all-or-nothing GPU leases.
"""

from __future__ import annotations

from twisted.internet.defer import CancelledError
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from kcoral.server.leases.lease import MAINTENANCE, LeaseArbiter, LeaseUnavailable


class LeaseArbiterTests(SynchronousTestCase):
    """One holder per GPU, granted in arrival order, with exact accounting."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.leases = LeaseArbiter((0, 1), self.clock)

    def test_exclusive_and_fifo(self) -> None:
        """The second and third requesters wait and are granted in arrival order."""
        first = self.successResultOf(self.leases.acquire("a", (0,)))
        self.assertEqual(first.holder, "a")
        second = self.leases.acquire("b", (0,))
        third = self.leases.acquire("c", (0,))
        self.assertNoResult(second)
        self.assertNoResult(third)
        self.clock.advance(2.5)
        self.leases.release("a")
        grant = self.successResultOf(second)
        self.assertEqual(grant.wait_seconds, 2.5)
        self.assertNoResult(third)
        self.leases.release("b")
        self.assertEqual(self.successResultOf(third).holder, "c")

    def test_reentrant(self) -> None:
        """A holder asking again gets its grant at once."""
        grant = self.successResultOf(self.leases.acquire("a", (0,)))
        self.assertIs(self.successResultOf(self.leases.acquire("a", (0,))), grant)

    def test_disjoint_gpus_pass(self) -> None:
        """Requests on different GPUs do not wait for each other."""
        self.successResultOf(self.leases.acquire("a", (0,)))
        self.successResultOf(self.leases.acquire("b", (1,)))

    def test_set_is_all_or_nothing_and_reserves(self) -> None:
        """A waiting two-GPU request holds nothing, and younger requests cannot overtake it."""
        self.successResultOf(self.leases.acquire("a", (0,)))
        both = self.leases.acquire("big", (0, 1))
        later = self.leases.acquire("small", (1,))
        self.assertNoResult(both)
        self.assertNoResult(later)
        self.assertIsNone(self.leases.holder_of(1))
        self.leases.release("a")
        self.assertEqual(self.successResultOf(both).gpus, (0, 1))
        self.assertNoResult(later)
        self.leases.release("big")
        self.successResultOf(later)

    def test_cancel_withdraws(self) -> None:
        """Cancelling a waiting request removes it from the line."""
        self.successResultOf(self.leases.acquire("a", (0,)))
        waiting = self.leases.acquire("b", (0,))
        waiting.cancel()
        self.failureResultOf(waiting, CancelledError)
        self.assertEqual(self.leases.depth(0), 1)
        self.leases.release("a")
        self.assertIsNone(self.leases.holder_of(0))

    def test_abandon_releases_and_withdraws(self) -> None:
        """A dead worker's hold and waits are dropped, waking the next waiter."""
        self.successResultOf(self.leases.acquire("a", (0,)))
        waiting = self.leases.acquire("b", (0,))
        self.leases.abandon("a")
        self.assertEqual(self.successResultOf(waiting).holder, "b")

    def test_depth(self) -> None:
        """lease_depth counts the holder plus the waiters for that GPU."""
        self.assertEqual(self.leases.depth(0), 0)
        self.successResultOf(self.leases.acquire("a", (0,)))
        self.leases.acquire("b", (0,))
        self.leases.acquire("c", (0, 1))
        self.assertEqual(self.leases.depth(0), 3)
        self.assertEqual(self.leases.depth(1), 1)

    def test_history_records_hold_intervals(self) -> None:
        """Closed holds are kept with their label so overlaps can be checked."""
        self.successResultOf(self.leases.acquire("a", (0,), label="req-1"))
        self.clock.advance(1.0)
        self.leases.release("a")
        (interval,) = self.leases.history[0]
        self.assertEqual((interval.label, interval.start, interval.end), ("req-1", 0.0, 1.0))

    def test_quarantine_fails_waiters(self) -> None:
        """Quarantined GPUs are never granted again."""
        self.successResultOf(self.leases.acquire("a", (0,)))
        waiting = self.leases.acquire("b", (0,))
        self.leases.quarantine((0,))
        self.failureResultOf(waiting, LeaseUnavailable)
        self.failureResultOf(self.leases.acquire("c", (0,)), LeaseUnavailable)

    def test_unknown_gpu(self) -> None:
        """Asking for a GPU the server does not have is a programming error."""
        self.assertRaises(ValueError, self.leases.acquire, "a", (7,))


class LabelsDuringTests(SynchronousTestCase):
    """Which requests held a GPU during a span: for gpu_access reports."""

    def test_closed_and_open_holds(self) -> None:
        """Closed holds that overlap the span count, and so does the current hold."""
        clock = Clock()
        leases = LeaseArbiter((0,), clock)
        self.successResultOf(leases.acquire("a", (0,), label="req-a"))
        clock.advance(1.0)
        leases.release("a")
        clock.advance(1.0)
        self.successResultOf(leases.acquire("b", (0,), label="req-b"))
        clock.advance(1.0)
        self.assertEqual(leases.labels_during(0, 0.5, 0.9), {"req-a"})
        self.assertEqual(leases.labels_during(0, 0.5, 2.5), {"req-a", "req-b"})
        self.assertEqual(leases.labels_during(0, 1.2, 1.8), set())
        self.assertEqual(leases.labels_during(0, 2.5, 3.0), {"req-b"})


def test_single_other_request() -> None:
    """Only one other request (not a warm-up, not ourselves) is named."""
    from kcoral.server.http.app import _single_other_request

    assert _single_other_request({"me", "other"}, "me") == "other"
    assert _single_other_request({"me", "warmup:gpu0/w1"}, "me") is None
    assert _single_other_request({"x", "y"}, "me") is None
    assert _single_other_request(set(), "me") is None


class MultiGpuTests(SynchronousTestCase):
    """Multi-GPU requests: the least busy GPUs, all or nothing, never starved."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.leases = LeaseArbiter((0, 1), self.clock)

    def test_least_busy_in_ascending_order(self) -> None:
        """Both GPUs of two; one of two goes to the GPU with fewer holders and waiters."""
        self.assertEqual(self.leases.least_busy(2), (0, 1))
        self.assertEqual(self.leases.least_busy(1), (0,))
        self.successResultOf(self.leases.acquire("a", (0,)))
        self.assertEqual(self.leases.least_busy(1), (1,))
        self.successResultOf(self.leases.acquire("b", (1,)))
        self.leases.acquire("c", (1,))
        self.assertEqual(self.leases.least_busy(1), (0,))
        # Choosing holds nothing.
        self.assertEqual(self.leases.depth(0), 1)

    def test_set_waits_without_holding_a_subset_and_blocks_newcomers(self) -> None:
        """A waiting two-GPU request holds nothing, and later single-GPU requests queue behind it."""
        self.successResultOf(self.leases.acquire("a", (0,)))
        big = self.leases.acquire("big", (1, 0))
        small = self.leases.acquire("small", (1,))
        self.assertNoResult(big)
        self.assertNoResult(small)
        self.assertIsNone(self.leases.holder_of(1))
        self.assertEqual(self.leases.depth(1), 2)
        self.leases.release("a")
        self.assertEqual(self.successResultOf(big).gpus, (0, 1))
        self.assertNoResult(small)
        self.leases.release("big")
        self.successResultOf(small)

    def test_more_than_usable_is_unavailable(self) -> None:
        self.assertRaises(LeaseUnavailable, self.leases.least_busy, 3)
        self.leases.quarantine((1,))
        self.assertRaises(LeaseUnavailable, self.leases.least_busy, 2)
        self.assertEqual(self.leases.least_busy(1), (0,))
        self.assertRaises(ValueError, self.leases.least_busy, 0)


class LeaseEventTests(SynchronousTestCase):
    """Grants and releases are logged, so lease holds can be audited from the log."""

    def test_grant_and_release_events(self) -> None:
        """lease_granted carries the wait, lease_released the hold, both the request id."""
        from twisted.internet.testing import EventLoggingObserver
        from twisted.logger import globalLogPublisher

        events = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)
        clock = Clock()
        leases = LeaseArbiter((0,), clock)
        self.successResultOf(leases.acquire("a", (0,), label="req-a"))
        waiting = leases.acquire("b", (0,), label="warmup:gpu0/w1")
        clock.advance(2.0)
        leases.release("a")
        self.successResultOf(waiting)
        mine = [e for e in events if "kcoral_event" in e]
        self.assertEqual(
            [(e["kcoral_event"], e["request_id"], e["purpose"], e["gpu_ids"]) for e in mine],
            [
                ("lease_granted", "req-a", "request", [0]),
                ("lease_released", "req-a", "request", [0]),
                ("lease_granted", None, "warmup", [0]),
            ],
        )
        self.assertEqual(mine[1]["held_ms"], 2000.0)
        self.assertEqual(mine[2]["wait_ms"], 2000.0)

    def test_what_a_grant_starts_is_logged_after_the_hand_over(self) -> None:
        """
        The release and the grant are logged before the new holder's
        callback runs, so an event it logs at once (a context creation on a
        maintenance hold, say) follows them in the file:
        C{bench/lease_overlap.py} replays the file in order and would see
        the creation start under the previous holder's lease otherwise.
        """
        from twisted.logger import Logger, capturedLogs

        clock = Clock()
        leases = LeaseArbiter((0,), clock)
        self.successResultOf(leases.acquire("a", (0,), label="req-a"))
        started = Logger()
        with capturedLogs() as events:
            leases.acquire("s", (0,), label="warmup:s", mode=MAINTENANCE).addCallback(
                lambda _grant: started.info("{kcoral_event}", kcoral_event="context_create_started")
            )
            leases.release("a")
        self.assertEqual(
            [(e["kcoral_event"], e.get("purpose")) for e in events if "kcoral_event" in e],
            [
                ("lease_released", "request"),
                ("lease_granted", "warmup"),
                ("context_create_started", None),
            ],
        )


class HandOverTests(SynchronousTestCase):
    """A worker's grant is written before the log, and the next in line is told."""

    def test_wake_comes_before_the_log_and_the_callback(self) -> None:
        """
        C{wake} runs before the release and the grant are logged and before
        the Deferred fires: the hand-over does not wait for the observers.
        """
        from twisted.logger import capturedLogs

        clock = Clock()
        leases = LeaseArbiter((0,), clock)
        self.successResultOf(leases.acquire("a", (0,), label="req-a"))
        seen: list[str] = []
        with capturedLogs() as events:

            def wake(grant: object) -> None:
                logged = [e["kcoral_event"] for e in events if "kcoral_event" in e]
                seen.append(f"wake after {logged}")

            leases.acquire("b", (0,), label="req-b", wake=wake).addCallback(
                lambda grant: seen.append(f"callback holding {grant.gpus}")
            )
            self.assertEqual(seen, [])
            leases.release("a")
        self.assertEqual(seen, ["wake after []", "callback holding (0,)"])
        self.assertEqual(
            [e["kcoral_event"] for e in events if "kcoral_event" in e],
            ["lease_released", "lease_granted"],
        )

    def test_wake_on_an_immediate_and_a_reentrant_grant(self) -> None:
        clock = Clock()
        leases = LeaseArbiter((0,), clock)
        woken: list[str] = []
        self.successResultOf(leases.acquire("a", (0,), wake=lambda g: woken.append("first")))
        self.successResultOf(leases.acquire("a", (0,), wake=lambda g: woken.append("again")))
        self.assertEqual(woken, ["first", "again"])

    def test_a_failing_wake_still_grants(self) -> None:
        """The grant stands and its Deferred fires; the failure is logged."""
        clock = Clock()
        leases = LeaseArbiter((0,), clock)

        def wake(grant: object) -> None:
            raise OSError("pipe closed")

        grant = self.successResultOf(leases.acquire("a", (0,), wake=wake))
        self.assertEqual(grant.gpus, (0,))
        self.assertEqual(len(self.flushLoggedErrors(OSError)), 1)
        self.assertEqual(leases.holder_of(0), "a")

    def test_the_first_in_line_is_told_once(self) -> None:
        clock = Clock()
        leases = LeaseArbiter((0,), clock)
        told: list[str] = []
        self.successResultOf(leases.acquire("a", (0,), next_in_line=lambda: told.append("a")))
        self.assertEqual(told, [], "granted at once: never told")
        b = leases.acquire("b", (0,), next_in_line=lambda: told.append("b"))
        c = leases.acquire("c", (0,), next_in_line=lambda: told.append("c"))
        self.assertEqual(told, ["b"])
        leases.acquire("d", (0,), next_in_line=lambda: told.append("d"))
        self.assertEqual(told, ["b"], "told once, and only the first")
        leases.release("a")
        self.successResultOf(b)
        self.assertEqual(told, ["b", "c"])
        leases.release("b")
        self.successResultOf(c)
        self.assertEqual(told, ["b", "c", "d"])

    def test_each_gpu_has_its_first(self) -> None:
        clock = Clock()
        leases = LeaseArbiter((0, 1), clock)
        told: list[str] = []
        self.successResultOf(leases.acquire("a", (0,)))
        self.successResultOf(leases.acquire("b", (1,)))
        leases.acquire("c", (0,), next_in_line=lambda: told.append("c"))
        leases.acquire("d", (1,), next_in_line=lambda: told.append("d"))
        leases.acquire("e", (0, 1), next_in_line=lambda: told.append("e"))
        self.assertEqual(told, ["c", "d"])

    def test_a_withdrawn_waiter_is_not_told(self) -> None:
        """A grant's callback that withdraws the next waiter leaves nobody to tell."""
        clock = Clock()
        leases = LeaseArbiter((0,), clock)
        told: list[str] = []
        self.successResultOf(leases.acquire("a", (0,)))
        b = leases.acquire("b", (0,))
        c = leases.acquire("c", (0,), next_in_line=lambda: told.append("c"))
        c.addErrback(lambda f: f.trap(CancelledError))
        b.addCallback(lambda _grant: c.cancel())
        leases.release("a")
        self.assertEqual(told, [])


class MaintenanceModeTests(SynchronousTestCase):
    """
    Context creations and teardowns (maintenance holds) share a GPU with each
    other, never with an exclusive holder; requests go first, within patience.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.leases = LeaseArbiter((0, 1), self.clock, maintenance_patience=1.0)

    def test_maintenance_holds_share(self) -> None:
        """Several maintenance requests hold one GPU together."""
        a = self.successResultOf(self.leases.acquire("a", (0,), mode=MAINTENANCE))
        b = self.successResultOf(self.leases.acquire("b", (0,), mode=MAINTENANCE))
        self.assertEqual((a.mode, b.mode), (MAINTENANCE, MAINTENANCE))
        self.assertEqual(self.leases.maintainers_of(0), {"a", "b"})
        self.assertIsNone(self.leases.holder_of(0))
        self.assertEqual(self.leases.depth(0), 1)

    def test_never_with_an_exclusive_holder(self) -> None:
        """Maintenance waits for an exclusive holder, and an exclusive request for the batch."""
        self.successResultOf(self.leases.acquire("x", (0,)))
        m = self.leases.acquire("m", (0,), mode=MAINTENANCE)
        self.assertNoResult(m)
        self.leases.release("x")
        self.successResultOf(m)
        y = self.leases.acquire("y", (0,))
        self.assertNoResult(y)
        self.leases.release("m")
        self.successResultOf(y)

    def test_requests_first_when_both_wait(self) -> None:
        """An exclusive request that arrives after a maintenance one, within patience, goes first."""
        self.successResultOf(self.leases.acquire("x", (0,)))
        m = self.leases.acquire("m", (0,), mode=MAINTENANCE)
        self.clock.advance(0.5)
        r = self.leases.acquire("r", (0,))
        self.leases.release("x")
        self.successResultOf(r)
        self.assertNoResult(m)
        self.leases.release("r")
        self.successResultOf(m)

    def test_patience_bounds_the_wait(self) -> None:
        """Requests younger than a maintenance waiter's patience do not overtake it."""
        self.successResultOf(self.leases.acquire("x", (0,)))
        m = self.leases.acquire("m", (0,), mode=MAINTENANCE)
        self.clock.advance(1.5)
        r = self.leases.acquire("r", (0,))
        self.leases.release("x")
        self.successResultOf(m)
        self.assertNoResult(r)
        self.leases.release("m")
        self.successResultOf(r)

    def test_batch_admits_everything_due(self) -> None:
        """Every maintenance waiter due when the GPU frees is granted at once."""
        self.successResultOf(self.leases.acquire("x", (0,)))
        waits = [self.leases.acquire(name, (0,), mode=MAINTENANCE) for name in "abc"]
        for d in waits:
            self.assertNoResult(d)
        self.leases.release("x")
        for d in waits:
            self.successResultOf(d)
        self.assertEqual(self.leases.maintainers_of(0), {"a", "b", "c"})

    def test_late_maintenance_waits_behind_a_waiting_request(self) -> None:
        """
        While an exclusive request waits for a batch, a new maintenance
        request does not join the batch (requests are not starved).
        """
        self.successResultOf(self.leases.acquire("a", (0,), mode=MAINTENANCE))
        r = self.leases.acquire("r", (0,))
        late = self.leases.acquire("late", (0,), mode=MAINTENANCE)
        self.assertNoResult(r)
        self.assertNoResult(late)
        self.leases.release("a")
        self.successResultOf(r)
        self.assertNoResult(late)
        self.leases.release("r")
        self.successResultOf(late)

    def test_late_maintenance_joins_when_nobody_waits(self) -> None:
        """With no exclusive request in line, a new maintenance request joins the batch."""
        self.successResultOf(self.leases.acquire("a", (0,), mode=MAINTENANCE))
        self.successResultOf(self.leases.acquire("b", (0,), mode=MAINTENANCE))

    def test_other_gpu_unaffected(self) -> None:
        """Maintenance of one GPU does not hold up requests on another."""
        self.successResultOf(self.leases.acquire("a", (0,), mode=MAINTENANCE))
        self.successResultOf(self.leases.acquire("r", (1,)))

    def test_exclusive_hold_serves_maintenance(self) -> None:
        """A holder of the exclusive lease needs no maintenance lease on top."""
        grant = self.successResultOf(self.leases.acquire("a", (0,)))
        self.assertIs(self.successResultOf(self.leases.acquire("a", (0,), mode=MAINTENANCE)), grant)

    def test_abandon_and_quarantine(self) -> None:
        """A dead maintainer's hold is dropped; quarantine fails maintenance waiters."""
        self.successResultOf(self.leases.acquire("a", (0,), mode=MAINTENANCE))
        r = self.leases.acquire("r", (0,))
        self.leases.abandon("a")
        self.successResultOf(r)
        m = self.leases.acquire("m", (0,), mode=MAINTENANCE)
        self.leases.quarantine((0,))
        self.failureResultOf(m, LeaseUnavailable)
        self.assertEqual(self.leases.maintainers_of(0), frozenset())

    def test_history_records_the_mode(self) -> None:
        """Closed maintenance holds are kept with their mode."""
        self.successResultOf(
            self.leases.acquire("a", (0,), label="context_create:gpu0/s0", mode=MAINTENANCE)
        )
        self.clock.advance(0.2)
        self.leases.release("a")
        (interval,) = self.leases.history[0]
        self.assertEqual((interval.mode, interval.end - interval.start), (MAINTENANCE, 0.2))

    def test_unknown_mode(self) -> None:
        """Only the two modes exist."""
        self.assertRaises(ValueError, self.leases.acquire, "a", (0,), None, "shared")

    def test_grant_and_release_logged_with_one_pid(self) -> None:
        """
        A holder whose pid becomes known after its grant (a forked worker)
        is logged with the grant's pid at release too, so the pair matches.
        """
        from twisted.logger import capturedLogs

        class Holder:
            seat = "gpu0/w0"
            pid: int | None = None

        holder = Holder()
        with capturedLogs() as events:
            self.successResultOf(self.leases.acquire(holder, (0,), mode=MAINTENANCE))
            holder.pid = 1234
            self.leases.release(holder)
        logged = [(e["kcoral_event"], e["pid"]) for e in events if "kcoral_event" in e]
        self.assertEqual(logged, [("lease_granted", None), ("lease_released", None)])
