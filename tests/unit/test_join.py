"""
The node side of a pool (L{kcoral.server.join}) on fakes and a
L{task.Clock}: the seat loop's claims, skips, backoff and free seats, the
presence key, the blob check, the streamed result body, and the
loopback-only rule.  The real thing, with
nats-server and node processes, is tests/integration/test_node_join.py.
"""

from __future__ import annotations

import hashlib
from typing import Any, cast

import attrs
from treq.testing import RequestTraversalAgent
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.error import ConnectionLost
from twisted.internet.interfaces import IConsumer
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python import usage
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import ResponseDone
from twisted.web.resource import Resource
from zope.interface import implementer
from zope.interface.verify import verifyObject

from kcoral.gateway.jobs import (
    NATS_RESULT_BYTES,
    PREFER_RETRY_SECONDS,
    BlobRef,
    Claim,
    JobMessage,
    Presence,
    result_reply,
)
from kcoral.ipc.shared import SharedBuffer, share
from kcoral.server.cli.tap import Options
from kcoral.server.http.app import Answer
from kcoral.server.join.natsresult import NatsResults
from kcoral.server.join.options import JoinListenError, check_join_endpoints
from kcoral.server.join.presence import PresenceAnnouncer
from kcoral.server.join.puller import JobPuller
from kcoral.server.join.queue import TURN_SECONDS, Delivery, IJobQueue, poll_waits
from kcoral.server.join.runner import POOL_CLIENT, JobRunner, pool_client
from kcoral.server.join.service import free_seats
from kcoral.server.join.transfer import BlobRefused, ChunksProducer, GatewayLink, _BlobReceiver
from kcoral.server.workers.line import PoolBusy

NOW = 1_000_000.0


@attrs.define
class Claims:
    """A create-only claims bucket shared by fake queues (the race)."""

    entries: dict[str, Claim] = attrs.field(factory=dict)

    def create(self, job: str, claim: Claim) -> bool:
        if job in self.entries:
            return False
        self.entries[job] = claim
        return True


@implementer(IJobQueue)
@attrs.define
class FakeQueue:
    node: str
    claims: Claims = attrs.field(factory=Claims)
    fetches: list[tuple[int, Deferred[list[Delivery]]]] = attrs.field(factory=list)
    settled: list[tuple[str, bytes, float | None]] = attrs.field(factory=list)
    presences: list[Presence] = attrs.field(factory=list)
    deleted: int = 0
    fail_claims: bool = False

    #: Each fetch's screen, in order.
    screens: list[Any] = attrs.field(factory=list)
    #: Each fetch's take (claimed jobs handed on as they arrive).
    takes: list[Any] = attrs.field(factory=list)
    #: Claims asked for through L{claim} (not on arrival).
    claimed: list[str] = attrs.field(factory=list)

    def fetch(
        self, count: int, timeout: float, screen: Any = None, take: Any = None
    ) -> Deferred[list[Delivery]]:
        d: Deferred[list[Delivery]] = Deferred()
        self.fetches.append((count, d))
        self.screens.append(screen)
        self.takes.append(take)
        return d

    def claim(self, job: str) -> Deferred[bool]:
        self.claimed.append(job)
        return self._claim(job)

    def _claim(self, job: str) -> Deferred[bool]:
        if self.fail_claims:
            return fail(TimeoutError("no answer"))
        return succeed(self.claims.create(job, Claim(node=self.node)))

    def arrive(self, data: bytes, claim: Deferred[bool] | None = None) -> Delivery:
        """
        A message arriving on the last fetch, as the real queue hands it:
        screened, and claimed at once when the screen names its job
        (with C{claim} when given, else in the claims bucket).
        """
        screen = self.screens[-1]
        screened = None if screen is None else screen(data)
        delivery = self.delivery(data)
        if screened is None:
            return delivery
        return attrs.evolve(
            delivery,
            claim=claim if claim is not None else self._claim(screened.job),
            job=screened,
        )

    def put_presence(self, presence: Presence) -> Deferred[None]:
        self.presences.append(presence)
        return succeed(None)

    def delete_presence(self) -> Deferred[None]:
        self.deleted += 1
        return succeed(None)

    def delivery(self, data: bytes) -> Delivery:
        def note(what: str, delay: float | None = None) -> Deferred[None]:
            self.settled.append((what, data, delay))
            return succeed(None)

        return Delivery(
            data=data,
            ack=lambda: note("ack"),
            nak=lambda delay: note("nak", delay),
            term=lambda: note("term"),
        )

    def what(self) -> list[str]:
        return [what for what, _, _ in self.settled]


def job(name: str = "j1", **changes: Any) -> bytes:
    fields: dict[str, Any] = {
        "job": name,
        "request_id": f"req-{name}",
        "program": "{}",
        "deadline": NOW + 30,
        "token": "t",
        "gateway": "http://127.0.0.1:1",
    }
    fields.update(changes)
    return JobMessage(**fields).encode()


@attrs.define
class Seats:
    """A stand-in for the worker pool's free seats."""

    free: int
    #: The puller the pool tells when a seat frees (its seat listener).
    listener: Any = None

    def take(self) -> None:
        self.free -= 1

    def give_back(self) -> None:
        self.free += 1
        if self.listener is not None:
            self.listener()


@attrs.define
class Runs:
    """
    A stand-in for the runner: each run takes a pool seat at once (unless
    C{hold_seat} is off: it stays before the seat line) and waits until
    fired.
    """

    seats: Seats
    hold_seat: bool = True
    started: list[str] = attrs.field(factory=list)
    #: Every job handed over, claim won or not (the pipeline starts at once).
    begun: list[str] = attrs.field(factory=list)
    pending: dict[str, Deferred[None]] = attrs.field(factory=dict)
    seated: dict[str, Any] = attrs.field(factory=dict)

    def __call__(self, message: JobMessage, seated: Any, claim_won: Any) -> Deferred[None]:
        """
        Begun at once, as the runner is; started (to its seat) only once
        the claim is won, ended at once when it is lost.
        """
        self.begun.append(message.job)
        d: Deferred[None] = Deferred()

        def decided(won: bool) -> None:
            if not won:
                d.callback(None)
                return
            self.started.append(message.job)
            self.seated[message.job] = seated
            if self.hold_seat:
                self.seat(message.job)
            self.pending[message.job] = d

        claim_won().addCallback(decided)
        return d

    def seat(self, name: str) -> None:
        self.seats.take()
        self.seated.pop(name)()

    def finish(self, name: str) -> None:
        """The job's program ends (its seat frees), then its result is posted."""
        self.seats.give_back()
        self.pending.pop(name).callback(None)


def puller(
    seats: int = 2, node: str = "node-a", queue: FakeQueue | None = None, **kw: Any
) -> tuple[JobPuller, FakeQueue, Runs, Clock]:
    clock = Clock()
    clock.advance(NOW)
    queue = queue or FakeQueue(node)
    pool = Seats(seats)
    runs = Runs(pool)
    p = JobPuller(queue, clock, node, seats, lambda: pool.free, runs, **kw)
    pool.listener = p.seat_freed
    return p, queue, runs, clock


class PullerTests(SynchronousTestCase):
    def test_fake_queue_is_a_queue(self) -> None:
        """The fake provides the interface the puller uses."""
        verifyObject(IJobQueue, FakeQueue("n"))

    def test_one_job_per_free_seat(self) -> None:
        """Each fetch asks for the free seats; a running job holds one until it ends."""
        p, queue, runs, _ = puller(seats=2)
        p.start()
        self.assertEqual([count for count, _ in queue.fetches], [2])
        queue.fetches[0][1].callback([queue.delivery(job("j1"))])
        self.assertEqual(runs.started, ["j1"])
        self.assertEqual(queue.what(), ["ack"])
        self.assertEqual((p.busy, p.free), (1, 1))
        self.assertEqual([count for count, _ in queue.fetches], [2, 1])
        queue.fetches[1][1].callback([queue.delivery(job("j2"))])
        # Both seats taken: no fetch until one frees.
        self.assertEqual(len(queue.fetches), 2)
        runs.finish("j1")
        self.assertEqual([count for count, _ in queue.fetches], [2, 1, 1])
        self.assertEqual(queue.claims.entries["j1"], Claim(node="node-a"))

    def test_free_seats_are_the_pools(self) -> None:
        """
        The node pulls for the pool's free seats, not for the jobs it holds:
        a seat a direct request takes is not free, a job held but not yet in
        the seat line counts against the free ones, and a seat that frees
        while its job's result is still being posted is pulled for at once.
        """
        p, queue, runs, _ = puller(seats=3)
        pool = runs.seats
        pool.take()  # a direct /execute request holds a seat
        p.start()
        self.assertEqual([count for count, _ in queue.fetches], [2])
        runs.hold_seat = False  # j1 is fetching its blobs: no seat yet
        queue.fetches[0][1].callback([queue.delivery(job("j1"))])
        self.assertEqual((p.busy, p.free, pool.free), (1, 1, 2))
        self.assertEqual([count for count, _ in queue.fetches], [2, 1])
        runs.seat("j1")  # in the seat line, and seated: the pool counts it now
        self.assertEqual((p.busy, p.free, pool.free), (1, 1, 1))
        queue.fetches[1][1].callback([])
        self.assertEqual([count for count, _ in queue.fetches], [2, 1, 1])
        runs.hold_seat = True
        queue.fetches[2][1].callback([queue.delivery(job("j2"))])
        self.assertEqual((p.busy, p.free), (2, 0))
        self.assertEqual(len(queue.fetches), 3)
        # j1's program ends: its seat is free before its result is posted.
        pool.give_back()
        self.assertEqual((p.busy, p.free), (2, 1))
        self.assertEqual([count for count, _ in queue.fetches], [2, 1, 1, 1])
        # Its result posted, j1 lets go of the node: no seat changes.
        runs.pending.pop("j1").callback(None)
        self.assertEqual((p.busy, p.free), (1, 1))
        self.assertEqual(len(queue.fetches), 4)

    def test_seat_freed_while_not_started_pulls_nothing(self) -> None:
        """A seat that frees before the node joined, or after it stopped, starts no pull."""
        p, queue, _, _ = puller(seats=1)
        p.seat_freed()
        self.assertEqual(queue.fetches, [])
        p.start()
        p.stop()
        queue.fetches[0][1].callback([])
        p.seat_freed()
        self.assertEqual(len(queue.fetches), 1)

    def test_claim_wins_once_under_a_race(self) -> None:
        """Two nodes get the same job: the create-only claim lets one run it."""
        claims = Claims()
        a, qa, runs_a, _ = puller(node="node-a", queue=FakeQueue("node-a", claims))
        b, qb, runs_b, _ = puller(node="node-b", queue=FakeQueue("node-b", claims))
        a.start()
        b.start()
        qa.fetches[0][1].callback([qa.delivery(job("j1"))])
        qb.fetches[0][1].callback([qb.delivery(job("j1"))])
        self.assertEqual((runs_a.started, runs_b.started), (["j1"], []))
        # The loser acknowledged its copy: it leaves the queue.
        self.assertEqual(qb.what(), ["ack"])
        self.assertEqual(b.counts["lost"], 1)
        self.assertEqual(b.busy, 0)

    def test_cancelled_job_never_runs(self) -> None:
        """A job whose cancel claim came first is acknowledged and not run."""
        p, queue, runs, _ = puller()
        queue.claims.entries["j1"] = Claim(cancelled=True)
        p.start()
        queue.fetches[0][1].callback([queue.delivery(job("j1"))])
        self.assertEqual(runs.started, [])
        self.assertEqual(queue.what(), ["ack"])
        self.assertEqual(queue.claims.entries["j1"], Claim(cancelled=True))

    def test_late_job_skipped(self) -> None:
        """A job past its deadline is acknowledged, not claimed, not run."""
        p, queue, runs, _ = puller()
        p.start()
        queue.fetches[0][1].callback([queue.delivery(job("j1", deadline=NOW - 1))])
        self.assertEqual((runs.started, queue.claims.entries), ([], {}))
        self.assertEqual(queue.what(), ["ack"])

    def test_preferred_elsewhere_given_back_with_delay(self) -> None:
        """
        Inside another node's preference window the job goes back for a
        moment at a time (a NAK's delay would keep it from the preferred
        node too).
        """
        p, queue, runs, _ = puller()
        p.start()
        data = job("j1", prefer="node-b", prefer_until=NOW + 2.5)
        queue.fetches[0][1].callback([queue.delivery(data)])
        self.assertEqual(runs.started, [])
        self.assertEqual(queue.settled, [("nak", data, PREFER_RETRY_SECONDS)])
        # After the window, or for the preferred node itself, it runs.
        queue.fetches[1][1].callback(
            [queue.delivery(job("j2", prefer="node-a", prefer_until=NOW + 9))]
        )
        self.assertEqual(runs.started, ["j2"])

    def test_malformed_message_dropped(self) -> None:
        """A message that is not a job is terminated, and the seat stays free."""
        p, queue, runs, _ = puller()
        p.start()
        queue.fetches[0][1].callback([queue.delivery(b"{not json")])
        self.assertEqual(queue.what(), ["term"])
        self.assertEqual((runs.started, p.busy), ([], 0))

    def test_unknown_claim_outcome_left_to_queue(self) -> None:
        """A claim that got no answer: the job is given back, not run."""
        p, queue, runs, _ = puller()
        queue.fail_claims = True
        p.start()
        queue.fetches[0][1].callback([queue.delivery(job("j1"))])
        self.flushLoggedErrors()
        self.assertEqual(runs.started, [])
        self.assertEqual(queue.what(), ["nak"])

    def test_claimed_as_it_arrives(self) -> None:
        """
        The queue claims a runnable job as its message arrives (the fetch's
        screen names it): the puller runs it on that claim and asks for no
        other; what the screen passes over (late, preferred elsewhere,
        malformed) goes through the puller's own steps unclaimed.
        """
        p, queue, runs, _ = puller(seats=4)
        p.start()
        late = job("late", deadline=NOW - 1)
        elsewhere = job("el", prefer="node-b", prefer_until=NOW + 2)
        arrived = [
            queue.arrive(job("j1")),
            queue.arrive(late),
            queue.arrive(elsewhere),
            queue.arrive(b"{not json"),
        ]
        self.assertEqual([d.claim is not None for d in arrived], [True, False, False, False])
        queue.fetches[0][1].callback(arrived)
        self.assertEqual(runs.started, ["j1"])
        self.assertEqual(queue.claimed, [])
        self.assertEqual(queue.claims.entries, {"j1": Claim(node="node-a")})
        self.assertEqual(
            queue.settled,
            [("ack", job("j1"), None), ("ack", late, None), ("nak", elsewhere, 0.1)]
            + [("term", b"{not json", None)],
        )

    def test_claimed_on_arrival_runs_without_a_free_seat(self) -> None:
        """
        A job claimed as it arrived is this node's alone: when a direct
        request took its seat meanwhile it waits for one here, never goes
        back to the queue; an unclaimed one does go back.
        """
        p, queue, runs, _ = puller(seats=1)
        p.start()
        claimed = queue.arrive(job("j1"))
        runs.seats.take()  # a direct request
        queue.fetches[0][1].callback([claimed])
        self.assertEqual(runs.started, ["j1"])
        self.assertEqual(queue.what(), ["ack"])

    def test_claim_on_arrival_lost_or_unknown(self) -> None:
        """
        A claim made on arrival that another claim beat is acknowledged and
        not run; one whose outcome is unknown is given back (the claim
        decides on the next delivery).
        """
        p, queue, runs, _ = puller(seats=2)
        queue.claims.entries["j1"] = Claim(cancelled=True)
        p.start()
        queue.fetches[0][1].callback(
            [
                queue.arrive(job("j1")),
                queue.arrive(job("j2"), claim=fail(TimeoutError("no answer"))),
            ]
        )
        self.assertEqual(runs.started, [])
        self.assertEqual(queue.what(), ["ack", "nak"])
        self.assertEqual((p.counts["lost"], p.busy), (1, 0))

    def test_pipeline_begins_while_the_claim_is_in_flight(self) -> None:
        """
        A job arrives with its claim still on its way: the runner has it at
        once (its checks overlap the claim's round trip) but it takes no
        seat, and its message is neither acknowledged nor given back, until
        the claim is decided: won, it runs; lost, it ends unrun.
        """
        p, queue, runs, _ = puller(seats=2)
        p.start()
        won: Deferred[bool] = Deferred()
        lost: Deferred[bool] = Deferred()
        queue.fetches[0][1].callback(
            [queue.arrive(job("j1"), claim=won), queue.arrive(job("j2"), claim=lost)]
        )
        self.assertEqual(runs.begun, ["j1", "j2"])
        self.assertEqual((runs.started, queue.what(), p.busy), ([], [], 2))
        won.callback(True)
        self.assertEqual(runs.started, ["j1"])
        self.assertEqual(queue.what(), ["ack"])
        lost.callback(False)
        self.assertEqual(runs.started, ["j1"])
        self.assertEqual(queue.what(), ["ack", "ack"])
        self.assertEqual((p.counts["run"], p.counts["lost"], p.busy), (1, 1, 1))
        runs.finish("j1")
        self.assertEqual(p.busy, 0)

    def test_next_pull_waits_for_the_claims_answer(self) -> None:
        """
        On a node running nothing else, a job that arrives with its claim
        in flight leaves seats free, but the next pull is sent only once
        the claim is answered and the job has gone on: sent at once, it and
        its reply would take the loop's turns in front of that answer.
        With another job running, the node pulls again at once, to keep
        its seats fed.
        """
        p, queue, runs, _ = puller(seats=3)
        p.start()
        won: Deferred[bool] = Deferred()
        queue.fetches[0][1].callback([queue.arrive(job("j1"), claim=won)])
        self.assertEqual(([count for count, _ in queue.fetches], p.free), ([3], 2))
        won.callback(True)
        self.assertEqual(runs.started, ["j1"])
        self.assertEqual([count for count, _ in queue.fetches], [3, 2])
        # j1 runs: the next job's claim in flight holds no pull back.
        queue.fetches[1][1].callback([queue.arrive(job("j2"), claim=Deferred())])
        self.assertEqual([count for count, _ in queue.fetches], [3, 2, 1])

    def test_claimed_job_taken_before_its_fetch_is_back(self) -> None:
        """
        A claimed job the queue hands over as it arrives (the fetch's
        C{take}) starts at once, before its fetch has come back, and holds
        its seat; once the fetch is back, empty, the next pull still waits
        for the claim's answer, as for a job in the fetch's list.  With
        another job running, a job taken so lets the node pull at once.
        """
        p, queue, runs, _ = puller(seats=3)
        p.start()
        won: Deferred[bool] = Deferred()
        queue.takes[-1](queue.arrive(job("j1"), claim=won))
        self.assertEqual((runs.begun, p.busy, p.free), (["j1"], 1, 2))
        queue.fetches[0][1].callback([])
        self.assertEqual([count for count, _ in queue.fetches], [3])
        won.callback(True)
        self.assertEqual(runs.started, ["j1"])
        self.assertEqual(queue.what(), ["ack"])
        self.assertEqual([count for count, _ in queue.fetches], [3, 2])
        # j1 runs: j2, taken with its claim in flight, holds no pull back.
        queue.takes[-1](queue.arrive(job("j2"), claim=Deferred()))
        queue.fetches[1][1].callback([])
        self.assertEqual([count for count, _ in queue.fetches], [3, 2, 1])

    def test_claim_decided_before_its_fetch_is_back_lets_the_next_pull_go(self) -> None:
        """
        A job handed over as it arrived whose claim is decided (lost, won
        or unknown) while its fetch is still out could not pull again then:
        the fetch's return does, so the node keeps pulling.
        """
        for outcome in ("lost", "won", "unknown"):
            p, queue, runs, _ = puller(seats=2)
            p.start()
            claim: Deferred[bool] = Deferred()
            queue.takes[-1](queue.arrive(job("j1"), claim=claim))
            if outcome == "unknown":
                claim.errback(TimeoutError("no answer"))
            else:
                claim.callback(outcome == "won")
            self.assertEqual(len(queue.fetches), 1, outcome)
            queue.fetches[0][1].callback([])
            self.assertEqual(len(queue.fetches), 2, outcome)
            self.assertEqual(runs.started, ["j1"] if outcome == "won" else [], outcome)

    def test_stop_waits_for_jobs_taken_as_they_arrived(self) -> None:
        """A stop waits for a job the fetch in flight handed over as it arrived."""
        p, queue, runs, _ = puller(seats=2)
        p.start()
        queue.takes[-1](queue.arrive(job("j1")))
        stopped = p.stop()
        queue.fetches[0][1].callback([])
        self.assertEqual(runs.started, ["j1"])
        self.assertNoResult(stopped)
        runs.finish("j1")
        self.successResultOf(stopped)

    def test_unanswered_claim_lets_the_next_pull_go(self) -> None:
        """A claim that fails (its outcome unknown) lets the held-back pull go."""
        p, queue, _, _ = puller(seats=2)
        p.start()
        unknown: Deferred[bool] = Deferred()
        queue.fetches[0][1].callback([queue.arrive(job("j1"), claim=unknown)])
        self.assertEqual(len(queue.fetches), 1)
        unknown.errback(TimeoutError("no answer"))
        self.assertEqual(queue.what(), ["nak"])
        self.assertEqual(len(queue.fetches), 2)

    def test_stop_waits_for_claims_on_arrival(self) -> None:
        """
        A stop while the fetch in flight may be claiming waits for that
        fetch: a job it claimed runs and ends before the node leaves.  A
        screen after the stop claims nothing.
        """
        p, queue, runs, _ = puller(seats=2)
        p.start()
        claimed = queue.arrive(job("j1"))
        stopped = p.stop()
        self.assertIsNone(queue.screens[-1](job("j2")))
        self.assertNoResult(stopped)
        queue.fetches[0][1].callback([claimed, queue.delivery(job("j2"))])
        self.assertEqual(runs.started, ["j1"])
        self.assertEqual(queue.what(), ["ack", "nak"])
        self.assertNoResult(stopped)
        runs.finish("j1")
        self.successResultOf(stopped)
        self.assertEqual(len(queue.fetches), 1)

    def test_stop_before_any_screen_does_not_wait(self) -> None:
        """A stop before the fetch in flight screened anything waits only for held jobs."""
        p, queue, _, _ = puller()
        p.start()
        self.successResultOf(p.stop())
        self.assertIsNone(queue.screens[-1](job("j1")))

    def test_fetch_failure_backs_off(self) -> None:
        """A failed fetch waits, doubling, and prepares the queue again before the next."""
        prepared: list[int] = []

        def reprepare() -> Deferred[None]:
            prepared.append(1)
            return succeed(None)

        p, queue, _, clock = puller(reprepare=reprepare)
        p.start()
        queue.fetches[0][1].errback(ConnectionError("nats gone"))
        self.assertEqual(len(queue.fetches), 1)
        clock.advance(0.4)
        self.assertEqual(len(queue.fetches), 1)
        clock.advance(0.1)
        self.assertEqual((len(queue.fetches), len(prepared)), (2, 1))
        queue.fetches[1][1].errback(ConnectionError("nats gone"))
        clock.advance(0.9)
        self.assertEqual(len(queue.fetches), 2)
        clock.advance(0.1)
        self.assertEqual(len(queue.fetches), 3)
        # Success resets the backoff.
        queue.fetches[2][1].callback([])
        self.assertEqual(len(queue.fetches), 4)
        queue.fetches[3][1].errback(ConnectionError("nats gone"))
        clock.advance(0.5)
        self.assertEqual(len(queue.fetches), 5)

    def test_stop_gives_back_and_waits(self) -> None:
        """Stopping gives back jobs fetched after it and fires once held jobs end."""
        p, queue, runs, _ = puller(seats=2)
        p.start()
        queue.fetches[0][1].callback([queue.delivery(job("j1"))])
        stopped = p.stop()
        self.assertNoResult(stopped)
        queue.fetches[1][1].callback([queue.delivery(job("j2"))])
        self.assertEqual(runs.started, ["j1"])
        self.assertEqual(queue.what(), ["ack", "nak"])
        runs.finish("j1")
        self.successResultOf(stopped)
        self.assertEqual(len(queue.fetches), 2)


@attrs.define
class _Seat:
    status: str


@attrs.define
class _Pool:
    seats: list[_Seat]
    queue_length: int = 0
    closing: bool = False


class FreeSeatsTests(SynchronousTestCase):
    def test_idle_seats_no_waiter_is_owed(self) -> None:
        """Idle seats count, less the requests waiting for one; busy, replacing, dead ones do not."""
        pool = _Pool([_Seat(s) for s in ("idle", "busy", "idle", "replacing", "dead", "idle")])
        self.assertEqual(free_seats(cast(Any, pool)), 3)
        pool.queue_length = 2
        self.assertEqual(free_seats(cast(Any, pool)), 1)
        pool.queue_length = 5
        self.assertEqual(free_seats(cast(Any, pool)), 0)
        pool.queue_length, pool.closing = 0, True
        self.assertEqual(free_seats(cast(Any, pool)), 0)


class PresenceTests(SynchronousTestCase):
    def test_put_every_interval_and_on_change(self) -> None:
        """
        The key is put at start, every second, and when the free seats
        change (at most every min_gap seconds); deleted at stop.
        """
        clock = Clock()
        queue = FakeQueue("node-a")
        free = [2]
        base = Presence(node="node-a", compat="0" * 16, seats=2, free=2)
        announcer = PresenceAnnouncer(queue, clock, base, lambda: free[0])
        announcer.start()
        self.assertEqual(len(queue.presences), 1)
        clock.advance(1.0)
        self.assertEqual(len(queue.presences), 2)
        # No change: no put.
        announcer.changed()
        self.assertEqual(len(queue.presences), 2)
        # A change right after a put waits out the gap, then puts once.
        free[0] = 1
        announcer.changed()
        free[0] = 0
        announcer.changed()
        self.assertEqual(len(queue.presences), 2)
        clock.advance(0.1)
        self.assertEqual([p.free for p in queue.presences], [2, 2, 0])
        self.assertEqual(queue.presences[-1].at, clock.seconds())
        # A change after the gap is put at once.
        clock.advance(0.5)
        free[0] = 1
        announcer.changed()
        self.assertEqual([p.free for p in queue.presences], [2, 2, 0, 1])
        # A change whose put is still waiting when the node stops is dropped.
        free[0] = 2
        announcer.changed()
        self.successResultOf(announcer.stop())
        self.assertEqual(queue.deleted, 1)
        clock.advance(5.0)
        self.assertEqual(len(queue.presences), 4)
        self.assertEqual(clock.getDelayedCalls(), [])


class _Blob(Resource):
    isLeaf = True

    def __init__(self, body: bytes, code: int = 200) -> None:
        super().__init__()
        self.body, self.code = body, code
        self.seen: list[Any] = []

    def render_GET(self, request: Any) -> bytes:
        self.seen.append(request.getHeader(b"authorization"))
        request.setResponseCode(self.code)
        return self.body

    def render_POST(self, request: Any) -> bytes:
        self.seen.append(
            {
                k.decode(): v[0].decode()
                for k, v in request.requestHeaders.getAllRawHeaders()
                if k.lower().startswith(b"x-kcoral") or k.lower() == b"authorization"
            }
        )
        request.setResponseCode(204)
        return b""


def link(resource: Resource) -> tuple[GatewayLink, RequestTraversalAgent]:
    agent = RequestTraversalAgent(resource)
    return GatewayLink(agent, Clock(), "node-a"), agent


class TransferTests(SynchronousTestCase):
    blob = b"hello blob"
    ref = BlobRef(sha256=hashlib.sha256(b"hello blob").hexdigest(), size=len(b"hello blob"))
    message = JobMessage.decode(job("j1"))

    def fetch(self, served: bytes, code: int = 200) -> tuple[Deferred[bytes], _Blob]:
        resource = _Blob(served, code)
        gateway, agent = link(resource)
        d = Deferred.fromCoroutine(gateway.fetch_blob(self.message, self.ref))
        agent.flush()
        return d, resource

    def test_blob_checked_and_token_sent(self) -> None:
        """A matching blob is returned; the request carried the job's token."""
        d, resource = self.fetch(self.blob)
        self.assertEqual(self.successResultOf(d), self.blob)
        self.assertEqual(resource.seen, [b"Bearer t"])

    def test_hash_mismatch_refused(self) -> None:
        """Bytes of the right size but the wrong content are refused."""
        d, _ = self.fetch(b"hello blub")
        error = self.failureResultOf(d, BlobRefused).value
        self.assertIn("SHA-256", error.reason)

    def test_size_mismatch_refused(self) -> None:
        """More or fewer bytes than announced are refused."""
        self.failureResultOf(self.fetch(self.blob + b"!")[0], BlobRefused)
        self.failureResultOf(self.fetch(self.blob[:-1])[0], BlobRefused)

    def test_refused_by_gateway(self) -> None:
        """A non-200 from the gateway is a refused blob."""
        d, _ = self.fetch(b"", 401)
        self.assertIn("401", self.failureResultOf(d, BlobRefused).value.reason)

    def test_large_blob_streams_into_a_shared_buffer(self) -> None:
        """
        A blob over the sharing threshold arrives as a sealed shared buffer
        (what an upload's large blob becomes), checked like a small one.
        """
        data = bytes(range(256)) * 1024
        ref = BlobRef(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
        gateway, agent = link(_Blob(data))
        d = Deferred.fromCoroutine(gateway.fetch_blob(self.message, ref))
        agent.flush()
        blob = self.successResultOf(d)
        self.assertIsInstance(blob, SharedBuffer)
        assert isinstance(blob, SharedBuffer)
        self.assertEqual(blob.tobytes(), data)
        bad = BlobRef(sha256="0" * 64, size=len(data))
        gateway, agent = link(_Blob(data))
        d = Deferred.fromCoroutine(gateway.fetch_blob(self.message, bad))
        agent.flush()
        self.assertIn("SHA-256", self.failureResultOf(d, BlobRefused).value.reason)

    def test_a_stalled_body_is_cut_off(self) -> None:
        """
        A blob body that sends nothing for the stall time fails as refused
        and stops the transfer; bytes that keep coming keep it alive, and a
        finished transfer leaves no timer behind.
        """
        clock = Clock()
        receiver = _BlobReceiver(self.ref, clock, None, stall_seconds=5)
        transport = StringTransport()
        receiver.makeConnection(transport)
        receiver.dataReceived(self.blob[:3])
        clock.advance(4)
        receiver.dataReceived(self.blob[3:6])
        clock.advance(4)
        self.assertNoResult(receiver.done)
        clock.advance(1.5)
        self.assertIn("stalled", self.failureResultOf(receiver.done, BlobRefused).value.reason)
        self.assertEqual(transport.producerState, "stopped")
        receiver.connectionLost(Failure(ConnectionLost()))
        self.assertEqual(clock.getDelayedCalls(), [])

        whole = _BlobReceiver(self.ref, clock, None, stall_seconds=5)
        whole.makeConnection(StringTransport())
        whole.dataReceived(self.blob)
        whole.connectionLost(Failure(ResponseDone()))
        self.assertEqual(self.successResultOf(whole.done).read(), self.blob)
        self.assertEqual(clock.getDelayedCalls(), [])

    def test_result_posted_with_head(self) -> None:
        """The node server's status and content type travel as headers, with the token."""
        resource = _Blob(b"")
        gateway, agent = link(resource)
        d = Deferred.fromCoroutine(
            gateway.post_result(
                self.message, Answer(503, "application/json", b"{}", {"Retry-After": "1"})
            )
        )
        agent.flush()
        self.assertEqual(self.successResultOf(d), 204)
        (headers,) = resource.seen
        self.assertEqual(headers["Authorization"], "Bearer t")
        self.assertEqual(headers["X-Kcoral-Result-Status"], "503")
        self.assertEqual(headers["X-Kcoral-Result-Content-Type"], "application/json")
        self.assertEqual(headers["X-Kcoral-Result-Retry-After"], "1")
        self.assertEqual(headers["X-Kcoral-Result-Node"], "node-a")


@implementer(IConsumer)
class _Consumer:
    """Takes writes; pauses its producer after each (a full socket)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.producer: Any = None

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        self.producer = producer

    def unregisterProducer(self) -> None:
        self.producer = None

    def write(self, data: bytes) -> None:
        self.writes.append(data)
        if self.producer is not None:
            self.producer.pauseProducing()


class ChunksProducerTests(SynchronousTestCase):
    def chunks(self) -> list[Any]:
        return [b"head-", share(b"0123456789"), b"", b"-tail"]

    def test_streams_buffers_a_slice_at_a_time(self) -> None:
        """
        Bytes go as they are, a sealed buffer a slice at a time, one write
        per resume while the consumer is paused; the length is known first.
        """
        producer = ChunksProducer(self.chunks(), slice_bytes=4)
        self.assertEqual(producer.length, 20)
        consumer = _Consumer()
        consumer.registerProducer(producer, True)
        done = producer.startProducing(consumer)
        self.assertEqual(consumer.writes, [b"head-"])
        for _ in range(10):
            if done.called:
                break
            producer.resumeProducing()
        self.successResultOf(done)
        self.assertEqual(consumer.writes, [b"head-", b"0123", b"4567", b"89", b"-tail"])

    def test_stop_never_fires(self) -> None:
        """Stopped (the connection went away), it writes no more and never fires."""
        producer = ChunksProducer(self.chunks(), slice_bytes=4)
        consumer = _Consumer()
        consumer.registerProducer(producer, True)
        done = producer.startProducing(consumer)
        producer.stopProducing()
        producer.resumeProducing()
        self.assertNoResult(done)
        self.assertEqual(consumer.writes, [b"head-"])


@attrs.define
class _Budget:
    """A stand-in for the site's bytes in flight, with a cap."""

    cap: int
    bytes_in_flight: int = 0

    def reserve_bytes(self, size: int, held: int) -> bool:
        if self.bytes_in_flight + size > self.cap:
            return False
        self.bytes_in_flight += size
        return True

    def release_bytes(self, size: int) -> None:
        self.bytes_in_flight -= size


@attrs.define
class _Pipeline:
    """Asks for every blob of the job, then answers with a shared buffer."""

    result: Any
    errors: list[BaseException] = attrs.field(factory=list)
    clients: list[str | None] = attrs.field(factory=list)

    async def execute_program(
        self, request_id: str, program: bytes, client: str | None, **kw: Any
    ) -> Answer:
        self.clients.append(client)
        try:
            await kw["fetch"]([hashlib.sha256(b"hello blob").hexdigest()])
        except Exception as e:
            self.errors.append(e)
            return Answer(503, "application/json", b"{}", {"Retry-After": "1"})
        return Answer(200, "multipart/mixed", [b"head", self.result])


@attrs.define
class _Link:
    posts: list[Deferred[int]] = attrs.field(factory=list)

    async def fetch_blob(self, job: JobMessage, ref: BlobRef) -> bytes:
        return b"hello blob"

    async def post_result(self, job: JobMessage, answer: Answer) -> int:
        d: Deferred[int] = Deferred()
        self.posts.append(d)
        return await d


@attrs.define
class _FinishLater:
    """Answers at once, its C{request_finished} left to the caller; records how it was asked."""

    link: _Link
    finished: list[int] = attrs.field(factory=list)
    asked: list[dict[str, Any]] = attrs.field(factory=list)

    async def execute_program(
        self, request_id: str, program: bytes, client: str | None, **kw: Any
    ) -> Answer:
        self.asked.append(kw)
        return Answer(
            200,
            "application/json",
            b"{}",
            finish=lambda: self.finished.append(len(self.link.posts)),
        )


class RunnerFinishTests(SynchronousTestCase):
    def test_request_finished_is_logged_after_the_result_leaves(self) -> None:
        """
        A job's C{request_finished} event is the runner's to log, on the
        loop's next turn: after its result has been sent on its way, not in
        front of it.
        """
        link = _Link()
        pipeline = _FinishLater(link)
        clock = Clock()
        runner = JobRunner(cast(Any, pipeline), cast(Any, link), clock, 1 << 20)
        d = Deferred.fromCoroutine(runner.run(JobMessage.decode(job("j1"))))
        self.assertEqual(pipeline.asked[0]["finish_later"], True)
        self.assertEqual(len(link.posts), 1)
        self.assertEqual(pipeline.finished, [])
        clock.advance(0)
        self.assertEqual(pipeline.finished, [1])
        link.posts[0].callback(200)
        self.assertIsNone(self.successResultOf(d))


class RunnerBytesTests(SynchronousTestCase):
    message = JobMessage.decode(
        job("j1", blobs=[BlobRef(sha256=hashlib.sha256(b"hello blob").hexdigest(), size=10)])
    )

    def runner(self, cap: int) -> tuple[JobRunner, _Budget, _Pipeline, _Link]:
        budget, pipeline, gateway = _Budget(cap), _Pipeline(share(b"0123456789abcdef")), _Link()
        runner = JobRunner(cast(Any, pipeline), cast(Any, gateway), Clock(), 1 << 20, budget)
        return runner, budget, pipeline, gateway

    def test_blobs_and_result_count_until_posted(self) -> None:
        """Fetched blobs and the result's buffers hold bytes in flight until the post ends."""
        runner, budget, pipeline, gateway = self.runner(cap=100)
        d = Deferred.fromCoroutine(runner.run(self.message))
        self.assertEqual(pipeline.errors, [])
        self.assertEqual(budget.bytes_in_flight, 10 + 16)
        gateway.posts[0].callback(204)
        self.successResultOf(d)
        self.assertEqual(budget.bytes_in_flight, 0)

    def test_blobs_over_the_cap_are_busy(self) -> None:
        """Blobs that do not fit are not fetched: the job is answered busy, nothing held."""
        runner, budget, pipeline, gateway = self.runner(cap=5)
        d = Deferred.fromCoroutine(runner.run(self.message))
        (error,) = pipeline.errors
        self.assertIsInstance(error, PoolBusy)
        gateway.posts[0].callback(204)
        self.successResultOf(d)
        self.assertEqual(budget.bytes_in_flight, 0)


class RunnerClientTests(SynchronousTestCase):
    """A pool job runs as the gateway's client, kept apart from direct ones."""

    def run_as(self, client: str | None) -> str | None:
        pipeline, gateway = _Pipeline(share(b"x")), _Link()
        runner = JobRunner(cast(Any, pipeline), cast(Any, gateway), Clock(), 1 << 20, _Budget(100))
        d = Deferred.fromCoroutine(runner.run(JobMessage.decode(job("j1", client=client))))
        gateway.posts[0].callback(204)
        self.successResultOf(d)
        (seen,) = pipeline.clients
        return seen

    def test_the_gateways_client(self) -> None:
        """Two of the gateway's clients are two clients for the node's reuse scope."""
        self.assertEqual(self.run_as("client:alice"), "pool:client:alice")
        self.assertEqual(self.run_as("127.0.0.1"), "pool:127.0.0.1")
        self.assertEqual(pool_client("client:alice"), "pool:client:alice")

    def test_no_client_named(self) -> None:
        """A job that names no client (an older gateway's) runs as C{pool}."""
        self.assertEqual(self.run_as(None), POOL_CLIENT)


class LoopbackOnlyTests(SynchronousTestCase):
    def test_loopback_accepted(self) -> None:
        """TCP on 127.0.0.1 or ::1 (and UNIX sockets beside them) pass."""
        check_join_endpoints(["tcp:port=8000:interface=127.0.0.1"])
        check_join_endpoints(["tcp6:8000:interface=\\:\\:1", "unix:/run/k.sock"])

    def test_reachable_refused(self) -> None:
        """Any interface, a wildcard, TLS, or no TCP port at all: refused."""
        for endpoints in (
            ["tcp:8000"],
            ["tcp:port=8000:interface=0.0.0.0"],
            ["tcp:port=8000:interface=10.0.0.5"],
            ["ssl:8443:interface=127.0.0.1:privateKey=k.pem"],
            ["unix:/run/k.sock"],
        ):
            self.assertRaises(JoinListenError, check_join_endpoints, endpoints)

    def parse(self, *args: str) -> Options:
        options = Options(environ={})
        options.parseOptions(["--device", "cpu", *args])
        return options

    def test_flags(self) -> None:
        """--join, --node-id and --credentials go together, on loopback only."""
        import tempfile

        with tempfile.NamedTemporaryFile("w", suffix=".json") as creds:
            creds.write('{"user": "node-a", "password": "p"}')
            creds.flush()
            join = ["--join", "nats://127.0.0.1:4222", "--node-id", "node-a"]
            options = self.parse(*join, "--credentials", creds.name)
            self.assertEqual(options.config.join_node_id, "node-a")
            error = self.assertRaises(usage.UsageError, self.parse, *join)
            self.assertIn("go together", str(error))
            error = self.assertRaises(
                usage.UsageError,
                self.parse,
                *join,
                "--credentials",
                creds.name,
                "--host",
                "0.0.0.0",
            )
            self.assertIn("loopback only", str(error))
            error = self.assertRaises(
                usage.UsageError,
                self.parse,
                "--join",
                "nats://127.0.0.1:4222",
                "--node-id",
                "a.b",
                "--credentials",
                creds.name,
            )
            self.assertIn("--node-id", str(error))
        error = self.assertRaises(
            usage.UsageError, self.parse, *join, "--credentials", "/nonexistent/creds"
        )
        self.assertIn("--credentials", str(error))


class PollWaitsTests(SynchronousTestCase):
    """L{poll_waits}: how a fetch shares its wait among a node's consumers."""

    def test_one_consumer_long_polls(self) -> None:
        """A CPU node's one consumer waits the whole timeout."""
        self.assertEqual(poll_waits(1, 1.0), [1.0])

    def test_several_take_turns(self) -> None:
        """
        A GPU node's consumers: a glance at each but the last, and the last
        long-polls only a turn, so a job of a class glanced at waits at
        most about one cycle, not the whole timeout.
        """
        waits = poll_waits(3, 1.0)
        self.assertEqual(len(waits), 3)
        self.assertEqual(waits[-1], TURN_SECONDS)
        self.assertLess(sum(waits), 0.25)

    def test_short_timeout(self) -> None:
        """No wait exceeds the fetch's own timeout."""
        self.assertEqual(poll_waits(2, 0.01), [0.01, 0.01])
        self.assertEqual(poll_waits(0, 1.0), [])


@attrs.define
class _NatsClient:
    """nats-py's request, answered by C{reply} (bytes) or raising it (an exception)."""

    reply: Any
    sent: list[tuple[str, bytes, dict[str, str]]] = attrs.field(factory=list)
    max_payload: int = 1 << 20

    async def request(
        self, subject: str, payload: bytes, timeout: float, headers: dict[str, str]
    ) -> Any:
        self.sent.append((subject, payload, headers))
        if isinstance(self.reply, BaseException):
            raise self.reply
        return attrs.make_class("Msg", ["data"])(self.reply)


@attrs.define
class _Bridge:
    """The bridge's C{call} and C{connected}, on a fake client."""

    client: _NatsClient
    connected: bool = True

    def call(self, work: Any, timeout: float | None = None) -> Deferred[Any]:
        return Deferred.fromCoroutine(work(self.client, None))


class NatsResultTests(SynchronousTestCase):
    """Small results go as a NATS request; anything short of a reply means a post."""

    message = JobMessage.decode(job("j1", results="gw1"))

    def send(
        self, reply: Any, answer: Answer, message: JobMessage | None = None, connected: bool = True
    ) -> tuple[int | None, _NatsClient]:
        client = _NatsClient(reply)
        results = NatsResults(cast(Any, _Bridge(client, connected)), "node-a", Clock())
        d = Deferred.fromCoroutine(results.send(message or self.message, answer))
        return self.successResultOf(d), client

    def test_sent_and_answered(self) -> None:
        """
        The result goes on the gateway process's subject for this node, its
        head and the job's token in headers, a shared buffer joined; the
        reply's status is what the post would have got.
        """
        answer = Answer(200, "multipart/mixed", [b"head", share(b"tail")], {"Retry-After": "2"})
        status, client = self.send(result_reply(200, delivered=True), answer)
        self.assertEqual(status, 200)
        ((subject, payload, headers),) = client.sent
        self.assertEqual(subject, "kcoral.results.gw1.node-a")
        self.assertEqual(payload, b"headtail")
        self.assertEqual(headers["X-KCoral-Result-Job"], "j1")
        self.assertEqual(headers["X-KCoral-Result-Token"], "t")
        self.assertEqual(headers["X-KCoral-Result-Status"], "200")
        self.assertEqual(headers["X-KCoral-Result-Retry-After"], "2")
        self.assertEqual(headers["X-KCoral-Result-Node"], "node-a")
        refused, _ = self.send(result_reply(401, error="no"), answer)
        self.assertEqual(refused, 401)

    def test_not_sent(self) -> None:
        """No results key, no connection, or a body over the limit: not sent (posted)."""
        small = Answer(200, "application/json", b"{}")
        for message, answer, connected in [
            (JobMessage.decode(job("j1")), small, True),
            (self.message, small, False),
            (self.message, Answer(200, "x/y", b"x" * (NATS_RESULT_BYTES + 1)), True),
        ]:
            status, client = self.send(b"", answer, message, connected)
            self.assertIsNone(status)
            self.assertEqual(client.sent, [])

    def test_over_the_servers_max_payload(self) -> None:
        """A server whose max_payload is smaller than the body and its headers: posted, unsent."""
        client = _NatsClient(b"", max_payload=1024)
        results = NatsResults(cast(Any, _Bridge(client)), "node-a", Clock())
        answer = Answer(200, "application/json", b"x" * 100)
        self.assertIsNone(
            self.successResultOf(Deferred.fromCoroutine(results.send(self.message, answer)))
        )
        self.assertEqual(client.sent, [])

    def test_no_reply_pauses_nats_results(self) -> None:
        """
        A reply that never came (a node whose NATS user may not publish its
        results waits the whole timeout each time): results are posted
        without trying NATS for C{pause} seconds, then tried again.  No
        responders (an answer at once) pauses nothing.
        """
        from nats.errors import NoRespondersError
        from nats.errors import TimeoutError as NatsTimeout

        clock = Clock()
        client = _NatsClient(NatsTimeout())
        results = NatsResults(cast(Any, _Bridge(client)), "node-a", clock, pause=60.0)
        small = Answer(200, "application/json", b"{}")

        def send() -> int | None:
            return self.successResultOf(Deferred.fromCoroutine(results.send(self.message, small)))

        self.assertIsNone(send())
        self.assertIsNone(send())
        self.assertEqual(len(client.sent), 1)
        clock.advance(61)
        client.reply = result_reply(200, delivered=True)
        self.assertEqual(send(), 200)
        client.reply = NoRespondersError()
        self.assertIsNone(send())
        client.reply = result_reply(200, delivered=True)
        self.assertEqual(send(), 200)
        self.assertEqual(len(client.sent), 4)

    def test_no_answer_means_post(self) -> None:
        """No responders, a timeout or a garbled reply: C{None}, so the caller posts it."""
        from nats.errors import NoRespondersError
        from nats.errors import TimeoutError as NatsTimeout

        small = Answer(200, "application/json", b"{}")
        for reply in (NoRespondersError(), NatsTimeout(), b"not json"):
            status, client = self.send(reply, small)
            self.assertIsNone(status)
            self.assertEqual(len(client.sent), 1)


@attrs.define
class _Results:
    """NatsResults' C{send}: what it answers, in turn."""

    answers: list[int | None]
    sent: list[str] = attrs.field(factory=list)

    async def send(self, job: JobMessage, answer: Answer) -> int | None:
        self.sent.append(job.job)
        return self.answers.pop(0)


class RunnerResultRouteTests(SynchronousTestCase):
    """The runner sends over NATS first and posts only what that did not deliver."""

    def run_job(self, answers: list[int | None]) -> tuple[_Results, _Link, Deferred[None]]:
        pipeline, gateway, results = _Pipeline(b"x"), _Link(), _Results(answers)
        runner = JobRunner(
            cast(Any, pipeline), cast(Any, gateway), Clock(), 1 << 20, nats=cast(Any, results)
        )
        d = Deferred.fromCoroutine(runner.run(JobMessage.decode(job("j1", results="gw1"))))
        return results, gateway, d

    def test_over_nats(self) -> None:
        """A result the gateway answered over NATS is not posted."""
        results, gateway, d = self.run_job([200])
        self.successResultOf(d)
        self.assertEqual(results.sent, ["j1"])
        self.assertEqual(gateway.posts, [])

    def test_posted_when_nats_did_not_answer(self) -> None:
        """No answer over NATS: the result is posted."""
        results, gateway, d = self.run_job([None])
        self.assertEqual(len(gateway.posts), 1)
        gateway.posts[0].callback(200)
        self.successResultOf(d)
