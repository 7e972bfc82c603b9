"""
Tests for L{kcoral.server.leases.broker}: front ends in other processes share
one arbiter through the broker, and every rule of the lease holds across
them.  In memory: AMP over L{twisted.test.iosim} connections, a L{Clock}.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import attrs
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import Clock
from twisted.logger import capturedLogs
from twisted.test import iosim
from twisted.trial.unittest import SynchronousTestCase

from kcoral.server.leases.broker import LeaseBroker, RemoteArbiter, broker_factory
from kcoral.server.leases.lease import (
    MAINTENANCE,
    Grant,
    LeaseArbiter,
    LeaseBook,
    LeaseUnavailable,
)

#: Process ids no process can have (above any pid_max): a lost front end's
#: holder is killed by the broker, and a test must never name a real one.
NO_PID = 10**9


@attrs.define(eq=False)
class Worker:
    seat: str
    pid: int | None = None


class BrokerHarness:
    """Front ends connected in memory to one broker, on one clock."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1000)
        self.arbiter = LeaseArbiter((0, 1), self.clock)
        self.broker = LeaseBroker(self.arbiter)
        self.pumps: list[iosim.IOPump] = []

    def front_end(self) -> tuple[RemoteArbiter, iosim.IOPump]:
        remote = RemoteArbiter((0, 1), self.clock)
        factory = broker_factory(self.broker)
        _client, _server, pump = iosim.connectedServerAndClient(
            lambda: factory.buildProtocol(None), remote.protocol, greet=True
        )
        self.pumps.append(pump)
        return remote, pump

    def flush(self) -> None:
        for _ in range(3):
            for pump in self.pumps:
                pump.flush()
            self.clock.advance(0)  # the broker's state push of this turn

    def granted(self: Any, d: Deferred[Grant]) -> Grant:
        self.flush()
        result: Grant = self.successResultOf(d)
        return result


class BrokerTests(BrokerHarness, SynchronousTestCase):
    def test_exclusive_across_front_ends(self) -> None:
        one, _ = self.front_end()
        two, _ = self.front_end()
        a, b = Worker("fe1/w0"), Worker("fe2/w0")
        grant = self.granted(one.acquire(a, (0,), label="req-a"))
        self.assertEqual((grant.holder, grant.gpus), (a, (0,)))
        waiting = two.acquire(b, (0,), label="req-b")
        self.flush()
        self.assertNoResult(waiting)
        # Both front ends see who holds the GPU, and the one waiting.
        self.assertEqual(two.holder_of(0), "fe1/w0")
        self.assertEqual((one.depth(0), two.depth(0)), (2, 2))
        self.clock.advance(2)
        self.assertIs(one.release(a), grant)
        self.assertEqual(self.granted(waiting).holder, b)
        self.assertEqual(one.holder_of(0), "fe2/w0")
        self.assertTrue(two.holds(b))
        self.assertFalse(one.holds(a))

    def test_fifo_across_front_ends(self) -> None:
        one, _ = self.front_end()
        two, _ = self.front_end()
        first = Worker("fe1/w0")
        self.granted(one.acquire(first, (0,)))
        order: list[str] = []
        waiters = [(two, Worker("fe2/w0")), (one, Worker("fe1/w1")), (two, Worker("fe2/w1"))]
        for remote, worker in waiters:
            remote.acquire(worker, (0,)).addCallback(lambda g: order.append(g.holder.seat))
            self.flush()
        holders = [(one, first)] + waiters
        for remote, worker in holders[:-1]:
            remote.release(worker)
            self.flush()
        self.assertEqual(order, ["fe2/w0", "fe1/w1", "fe2/w1"])

    def test_the_broker_says_who_is_next(self) -> None:
        """
        A wait that asked is told, through its front end, when it is first
        in line; the one behind it only once the line moves; never twice.
        """
        one, _ = self.front_end()
        two, _ = self.front_end()
        holder, first, second = Worker("fe1/w0"), Worker("fe2/w0"), Worker("fe1/w1")
        told: list[str] = []
        self.granted(one.acquire(holder, (0,)))
        waiting = two.acquire(first, (0,), next_in_line=lambda: told.append("first"))
        self.flush()
        behind = one.acquire(second, (0,), next_in_line=lambda: told.append("second"))
        self.flush()
        self.assertEqual(told, ["first"])
        one.release(holder)
        self.granted(waiting)
        self.assertEqual(told, ["first", "second"])
        two.release(first)
        self.granted(behind)
        self.assertEqual(told, ["first", "second"])

    def test_a_wait_that_did_not_ask_is_not_told(self) -> None:
        one, _ = self.front_end()
        two, _ = self.front_end()
        self.granted(one.acquire(Worker("fe1/w0"), (0,)))
        two.acquire(Worker("fe2/w0"), (0,))
        self.flush()
        [waiter] = self.arbiter._waiters
        self.assertIsNone(waiter.next_in_line)

    def test_maintenance_shares_but_never_with_exclusive(self) -> None:
        one, _ = self.front_end()
        two, _ = self.front_end()
        m1, m2, x = Worker("fe1/s0"), Worker("fe2/s0"), Worker("fe1/w0")
        self.granted(one.acquire(m1, (0,), mode=MAINTENANCE))
        self.granted(two.acquire(m2, (0,), mode=MAINTENANCE))
        self.assertEqual(one.maintainers_of(0), {"fe1/s0", "fe2/s0"})
        exclusive = one.acquire(x, (0,))
        self.flush()
        self.assertNoResult(exclusive)
        one.release(m1)
        self.flush()
        self.assertNoResult(exclusive)
        two.release(m2)
        self.assertEqual(self.granted(exclusive).holder, x)

    def test_cancelled_wait_leaves_the_line(self) -> None:
        one, _ = self.front_end()
        two, _ = self.front_end()
        a, b, c = Worker("fe1/w0"), Worker("fe2/w0"), Worker("fe1/w1")
        self.granted(one.acquire(a, (0,)))
        waiting = two.acquire(b, (0,))
        self.flush()
        waiting.cancel()
        self.failureResultOf(waiting, CancelledError)
        self.flush()
        self.assertEqual(one.depth(0), 1)
        one.release(a)
        self.assertEqual(self.granted(one.acquire(c, (0,))).holder, c)

    def test_a_grant_that_crosses_a_withdraw_is_given_back(self) -> None:
        one, _ = self.front_end()
        a, b = Worker("fe1/w0"), Worker("fe1/w1")
        waiting = one.acquire(a, (0,))
        # Withdrawn before the answer (a grant: the GPU was free) arrives.
        waiting.cancel()
        self.failureResultOf(waiting, CancelledError)
        self.flush()
        self.assertIsNone(self.arbiter.holder_of(0))
        self.assertEqual(self.granted(one.acquire(b, (0,))).holder, b)

    def test_a_front_end_that_goes_away_gives_everything_back(self) -> None:
        one, pump_one = self.front_end()
        two, _ = self.front_end()
        a, b, c = Worker("fe1/w0"), Worker("fe2/w0"), Worker("fe1/w1")
        self.granted(one.acquire(a, (0,)))
        theirs = two.acquire(b, (0,))
        self.flush()
        self.assertNoResult(theirs)
        waiting = one.acquire(c, (0,))
        self.flush()
        pump_one.client.transport.loseConnection()
        self.flush()
        self.failureResultOf(waiting, LeaseUnavailable)
        self.assertTrue(one.closed)
        self.failureResultOf(one.acquire(Worker("fe1/w2"), (1,)), LeaseUnavailable)
        self.assertEqual(self.successResultOf(theirs).holder, b)

    def test_abandon_withdraws_and_releases(self) -> None:
        one, _ = self.front_end()
        two, _ = self.front_end()
        a, b = Worker("fe1/w0"), Worker("fe2/w0")
        self.granted(one.acquire(a, (0,)))
        waiting = two.acquire(b, (0,))
        self.flush()
        two.abandon(b)
        self.failureResultOf(waiting, CancelledError)
        one.abandon(a)
        self.flush()
        self.assertEqual((one.depth(0), self.arbiter.depth(0)), (0, 0))

    def test_interference_reports_see_other_front_ends(self) -> None:
        """labels_during, least_busy and depth answer from the broker's pushes."""
        one, _ = self.front_end()
        two, _ = self.front_end()
        a = Worker("fe1/w0")
        self.granted(one.acquire(a, (0,), label="req-a"))
        start = self.clock.seconds()
        self.assertEqual(two.labels_during(0, start, start + 1), {"req-a"})
        self.clock.advance(3)
        one.release(a)
        self.flush()
        self.assertEqual(two.labels_during(0, start + 1, start + 2), {"req-a"})
        self.assertEqual(two.labels_during(0, start + 4, start + 5), set())
        self.granted(one.acquire(Worker("fe1/w1"), (0,)))
        self.assertEqual(two.least_busy(1), (1,))

    def test_the_broker_logs_the_lease_events_in_order(self) -> None:
        one, _ = self.front_end()
        two, _ = self.front_end()
        a, b = Worker("fe1/w0", pid=NO_PID + 11), Worker("fe2/w0", pid=NO_PID + 22)
        with capturedLogs() as events:
            self.granted(one.acquire(a, (0,), label="req-a"))
            waiting = two.acquire(b, (0,), label="req-b")
            self.flush()
            one.release(a)
            self.granted(waiting)
        mine: list[dict[str, Any]] = [e for e in events if "kcoral_event" in e]
        self.assertEqual(
            [(e["kcoral_event"], e["holder"], e["pid"], e["request_id"]) for e in mine],
            [
                ("lease_granted", "fe1/w0", NO_PID + 11, "req-a"),
                ("lease_released", "fe1/w0", NO_PID + 11, "req-a"),
                ("lease_granted", "fe2/w0", NO_PID + 22, "req-b"),
            ],
        )

    def test_health_reports_reach_every_front_end(self) -> None:
        one, pump_one = self.front_end()
        two, _ = self.front_end()
        self.broker.report(0, {"front_end": {"index": 0}})
        one.report(1, {"front_end": {"index": 1}})
        two.report(2, {"front_end": {"index": 2}})
        self.flush()
        self.assertEqual(set(two.peer_reports), {0, 1, 2})
        self.assertEqual(set(self.broker.reports), {0, 1, 2})
        # A front end that goes away takes its report with it.
        pump_one.client.transport.loseConnection()
        self.flush()
        self.assertEqual(set(two.peer_reports), {0, 2})

    def test_reports_pass_on_one_a_message(self) -> None:
        """
        Twenty reports of 8 KB each (more than an AMP value holds in all)
        reach a front end, one that connects later too.
        """
        one, _ = self.front_end()
        padding = "x" * 8000
        for index in range(20):
            self.broker.report(index, {"front_end": {"index": index}, "pad": padding})
        self.flush()
        self.assertEqual(set(one.peer_reports), set(range(20)))
        later, _ = self.front_end()
        self.flush()
        self.assertEqual(set(later.peer_reports), set(range(20)))
        self.assertEqual(later.peer_reports[19]["pad"], padding)

    def test_one_push_per_turn(self) -> None:
        """A turn's changes (a release and the grant it wakes) reach a front end as one push."""
        one, pump = self.front_end()
        a, b = Worker("fe1/w0"), Worker("fe1/w1")
        self.granted(one.acquire(a, (0,)))
        waiting = one.acquire(b, (0,))
        self.flush()
        pushes: list[dict[str, Any]] = []
        update = RemoteArbiter._update

        def counted(arbiter: RemoteArbiter, state: dict[str, Any]) -> None:
            pushes.append(state)
            update(arbiter, state)

        self.patch(RemoteArbiter, "_update", counted)
        one.release(a)
        pump.flush()  # the release reaches the broker: a release and a grant in one turn
        self.assertEqual(pushes, [])
        self.clock.advance(0)
        pump.flush()
        self.assertEqual(len(pushes), 1)
        self.assertEqual(pushes[0]["gpus"]["0"]["holder"], "fe1/w1")
        self.successResultOf(waiting)

    def test_a_lost_front_ends_holder_is_killed_and_waited_for(self) -> None:
        """
        The front end goes away while its worker holds the GPU: the broker
        kills that worker, and nobody else gets the GPU before it has exited.
        """
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        self.addCleanup(sleeper.wait)
        self.addCleanup(sleeper.kill)
        one, pump = self.front_end()
        two, _ = self.front_end()
        self.granted(one.acquire(Worker("fe1/w0", pid=sleeper.pid), (0,)))
        theirs = two.acquire(Worker("fe2/w0"), (0,))
        self.flush()
        with capturedLogs() as events:
            pump.client.transport.loseConnection()
            self.flush()
        self.assertEqual(
            [e["kcoral_event"] for e in events if "kcoral_event" in e], ["orphan_holder_killed"]
        )
        self.assertNoResult(theirs)
        deadline = time.monotonic() + 10
        while sleeper.poll() is None:
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.01)
        self.assertEqual(sleeper.returncode, -signal.SIGKILL)
        self.clock.advance(0.05)
        self.flush()
        self.assertEqual(self.successResultOf(theirs).holder.seat, "fe2/w0")

    def test_a_new_front_end_does_not_take_closed_holds_from_the_others(self) -> None:
        """
        A hold closed just before another front end connects still reaches
        the front ends already there (the newcomer's full state is its own).
        """
        one, pump = self.front_end()
        a = Worker("fe1/w0")
        self.granted(one.acquire(a, (0,), label="req-a"))
        start = self.clock.seconds()
        self.clock.advance(1)
        one.release(a)
        pump.flush()  # the release reached the broker; its push waits for the turn's end
        two, _ = self.front_end()
        self.flush()
        self.assertEqual(one.labels_during(0, start, start + 0.5), {"req-a"})
        self.assertEqual(two.labels_during(0, start, start + 0.5), {"req-a"})


class LeaseBookContract:
    """
    What every L{kcoral.server.leases.lease.LeaseBook} answers alike, whoever
    decides its grants: run against the arbiter and a front end's
    L{RemoteArbiter}.
    """

    def make_book(self) -> tuple[LeaseBook, Callable[[], None]]:
        """A book over GPUs (0, 1), and a way to settle what is in flight."""
        raise NotImplementedError

    def test_a_holder_asking_again_gets_its_grant(self: Any) -> None:
        """Re-entrant: the same grant, and an exclusive hold serves a maintenance request."""
        book, settle = self.make_book()
        a = Worker("w0")
        woken: list[Grant] = []
        first = book.acquire(a, (0, 1), label="req-a")
        settle()
        grant = self.successResultOf(first)
        self.assertIs(self.successResultOf(book.acquire(a, (0,), wake=woken.append)), grant)
        self.assertIs(self.successResultOf(book.acquire(a, (1,), mode=MAINTENANCE)), grant)
        self.assertEqual(woken, [grant])
        self.assertEqual(
            (book.holds(a), book.grant_of(a), book.label_of(a)), (True, grant, "req-a")
        )

    def test_a_holder_asking_for_more_is_a_mistake(self: Any) -> None:
        """A holder that asks for GPUs its grant does not cover made a mistake (it raises)."""
        book, settle = self.make_book()
        a = Worker("w0")
        book.acquire(a, (0,))
        settle()
        self.assertRaises(RuntimeError, book.acquire, a, (0, 1))

    def test_release_ends_the_grant_once(self: Any) -> None:
        """Release returns the grant that ended, then nothing; the hold joins the history."""
        book, settle = self.make_book()
        a = Worker("w0")
        first = book.acquire(a, (0,), label="req-a")
        settle()
        grant = self.successResultOf(first)
        start = grant.granted_at
        self.clock.advance(1)
        self.assertIs(book.release(a), grant)
        self.assertIsNone(book.release(a))
        settle()
        self.assertEqual((book.holds(a), book.label_of(a)), (False, None))
        self.assertEqual(book.labels_during(0, start, start + 0.5), {"req-a"})
        self.assertEqual([i.label for i in book.history[0]], ["req-a"])

    def test_bad_requests_are_refused(self: Any) -> None:
        """Unknown GPUs and modes are refused at once; so is placing more GPUs than there are."""
        book, _ = self.make_book()
        self.assertRaises(ValueError, book.acquire, Worker("w0"), (2,))
        self.assertRaises(ValueError, book.acquire, Worker("w0"), (0,), None, "shared")
        self.assertRaises(ValueError, book.least_busy, 0)
        self.assertRaises(LeaseUnavailable, book.least_busy, 3)

    def test_a_closed_book_refuses(self: Any) -> None:
        """Once closed, new requests fail with L{LeaseUnavailable}, and so does placement."""
        book, _ = self.make_book()
        book.close()
        self.failureResultOf(book.acquire(Worker("w0"), (0,)), LeaseUnavailable)
        self.assertRaises(LeaseUnavailable, book.least_busy, 1)


class ArbiterBookTests(LeaseBookContract, SynchronousTestCase):
    def make_book(self) -> tuple[LeaseBook, Callable[[], None]]:
        self.clock = Clock()
        return LeaseArbiter((0, 1), self.clock), lambda: None


class RemoteBookTests(LeaseBookContract, BrokerHarness, SynchronousTestCase):
    def make_book(self) -> tuple[LeaseBook, Callable[[], None]]:
        remote, _ = self.front_end()
        self.flush()
        return remote, self.flush

    def test_unconnected_refuses(self) -> None:
        """Before the broker is reached, nothing is granted and nothing placed."""
        remote = RemoteArbiter((0, 1), self.clock)
        self.failureResultOf(remote.acquire(Worker("w0"), (0,)), LeaseUnavailable)
        self.assertRaises(LeaseUnavailable, remote.least_busy, 1)

    def test_a_second_wait_is_a_mistake(self) -> None:
        """A front end's holder waits once (the broker knows it by one token)."""
        remote, _ = self.front_end()
        self.granted(remote.acquire(Worker("w0"), (0,)))
        waiter = Worker("w1")
        remote.acquire(waiter, (0,))
        self.assertRaises(RuntimeError, remote.acquire, waiter, (1,))
