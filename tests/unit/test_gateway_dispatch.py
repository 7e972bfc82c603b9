"""
The gateway's decisions (L{kcoral.gateway.pool}, L{kcoral.gateway.dispatch}):
which class a job goes to, when a queued job is answered 503 (and only
after its cancel claim won), when a claimed one is answered 502, and that a
client who leaves cancels.  On L{task.Clock} with the in-memory queue.
"""

from __future__ import annotations

import io

from twisted.internet.defer import CancelledError
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from kcoral.gateway.dispatch import (
    NO_NODE,
    NO_SEAT,
    OUTCOME_UNKNOWN,
    QUEUE_FULL,
    TICK,
    Dispatcher,
    Outcome,
    PendingJob,
)
from kcoral.gateway.jobs import Claim, JobMessage, Presence, ResultHead, consumer_name
from kcoral.gateway.pool import PoolView
from kcoral.testing.gateway import FakeJobQueue

A = "a" * 16
B = "b" * 16


def presence(
    node: str, compat: str = A, *, gpus: int = 0, seats: int = 2, free: int = 2
) -> Presence:
    return Presence(node=node, compat=compat, gpus=gpus, seats=seats, free=free)


class PoolViewTests(SynchronousTestCase):
    def test_choose(self) -> None:
        """The preferred node's class, else the class with the most free seats."""
        pool = PoolView(presence_timeout=3.0)
        pool.update(presence("n1", A, free=1), 0.0)
        pool.update(presence("n2", B, free=2), 0.0)
        pool.update(presence("g1", B, gpus=2, seats=1, free=0), 0.0)
        self.assertEqual(pool.choose(0, 1.0), B)
        self.assertEqual(pool.choose(0, 1.0, prefer="n1"), A)
        self.assertEqual(pool.choose(0, 1.0, prefer="nobody"), B)
        self.assertEqual(pool.choose(2, 1.0), B)
        self.assertIsNone(pool.choose(3, 1.0))
        self.assertTrue(pool.can_run(B, 2, 1.0))
        self.assertFalse(pool.can_run(A, 1, 1.0))
        self.assertEqual(pool.classes(1.0), {(A, 0), (B, 0), (B, 1), (B, 2)})

    def test_when_loaded(self) -> None:
        """
        Waits for the presence bucket's first reading: at once once it came,
        and a cancelled wait is forgotten without firing the others.
        """
        pool = PoolView(presence_timeout=3.0)
        first, second = pool.when_loaded(), pool.when_loaded()
        self.assertNoResult(first)
        second.cancel()
        self.failureResultOf(second, CancelledError)
        pool.mark_loaded()
        self.assertIsNone(self.successResultOf(first))
        self.assertTrue(pool.loaded)
        self.assertIsNone(self.successResultOf(pool.when_loaded()))

    def test_presence_expires(self) -> None:
        """A node silent past the timeout is gone; while suspended nobody expires."""
        pool = PoolView(presence_timeout=3.0)
        pool.update(presence("n1"), 0.0)
        self.assertTrue(pool.present("n1", 3.0))
        self.assertFalse(pool.present("n1", 3.5))
        pool.suspend()
        self.assertTrue(pool.present("n1", 10.0))
        self.assertEqual(pool.expire(10.0), [])
        pool.resume(10.0)
        self.assertTrue(pool.present("n1", 12.0))
        self.assertEqual(pool.expire(13.5), ["n1"])
        self.assertIsNone(pool.choose(0, 13.5))
        self.assertEqual(pool.summary(13.5)["nodes"], 0)
        self.assertEqual((pool.joined, pool.left), (1, 1))

    def test_touch(self) -> None:
        """A node's blob fetch or result post counts as seen; an unknown node stays unknown."""
        pool = PoolView(presence_timeout=3.0)
        pool.update(presence("n1"), 0.0)
        pool.touch("n1", 2.5)
        self.assertTrue(pool.present("n1", 5.0))
        pool.touch("n1", 1.0)
        self.assertTrue(pool.present("n1", 5.0))
        pool.touch("n2", 2.0)
        pool.touch(None, 2.0)
        self.assertFalse(pool.present("n2", 2.0))

    def test_summary(self) -> None:
        """Seats, free seats and GPUs of the present nodes."""
        pool = PoolView(presence_timeout=3.0)
        pool.update(presence("n1", seats=2, free=1), 0.0)
        pool.update(presence("g1", gpus=4, seats=4, free=4), 0.0)
        self.assertEqual(
            pool.summary(1.0),
            {"nodes": 2, "seats": 6, "free_seats": 5, "gpus": 4, "presence": "live"},
        )
        self.assertEqual([n["node"] for n in pool.node_list(1.0)], ["g1", "n1"])


class DispatcherTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.queue = FakeJobQueue()
        self.pool = PoolView(presence_timeout=3.0)
        self.pool.update(presence("n1"), 0.0)
        self.released: list[str] = []
        self.dispatcher = Dispatcher(self.queue, self.pool, self.clock, queue_timeout=10.0)
        self.dispatcher.start()

    def tearDown(self) -> None:
        self.dispatcher.stop()

    def job(self, job: str = "j1", *, deadline: float = 10.0, gpus: int = 0) -> PendingJob:
        message = JobMessage(
            job=job,
            request_id="r-" + job,
            program="{}",
            deadline=deadline,
            token="t",
            gateway="http://127.0.0.1:9000",
        )
        return PendingJob(
            message=message,
            compat=A,
            gpus=gpus,
            timeout_seconds=5.0,
            release=lambda: self.released.append(job),
        )

    def advance(self, seconds: float) -> None:
        """Advance in ticks, the nodes refreshing their presence meanwhile unless told."""
        steps = round(seconds / TICK)
        for _ in range(steps):
            self.clock.advance(TICK)

    def keep_alive(self, *nodes: str) -> None:
        for node in nodes:
            self.pool.update(presence(node), self.clock.seconds())

    def test_published_on_its_subject(self) -> None:
        """A job is published on its class's subject after its consumer is prepared."""
        self.dispatcher.submit(self.job())
        [(subject, data, job)] = self.queue.published
        self.assertEqual((subject, job), (f"kcoral.jobs.{A}.0", "j1"))
        self.assertEqual(JobMessage.decode(data).job, "j1")
        self.assertEqual(self.queue.prepared, [(A, 0)])
        self.assertEqual(consumer_name(A, 0), f"jobs-{A}-0")
        self.assertEqual(self.dispatcher.waiting(), 1)

    def test_relayed(self) -> None:
        """A claim then a posted result: the outcome is the relay, the blobs released."""
        outcome = self.dispatcher.submit(self.job())
        self.assertTrue(self.queue.claim("j1", "n1"))
        self.dispatcher.claimed("j1", Claim(node="n1"))
        self.assertEqual(self.dispatcher.running(), 1)
        head = ResultHead(status=200, content_type="application/json", node="n1")
        delivered = self.dispatcher.result("j1", head, io.BytesIO(b"{}"), 2)
        self.assertIsNotNone(delivered)
        result = self.successResultOf(outcome)
        self.assertEqual((result.head, result.node, result.body_length), (head, "n1", 2))
        self.assertEqual(self.released, ["j1"])
        self.assertIsNone(self.dispatcher.result("j1", head, io.BytesIO(b""), 0))

    def test_result_before_claim_event(self) -> None:
        """A result that overtakes its claim's watch event is relayed all the same."""
        outcome = self.dispatcher.submit(self.job())
        head = ResultHead(status=200, content_type="application/json", node="n1")
        self.dispatcher.result("j1", head, io.BytesIO(b"{}"), 2)
        self.assertEqual(self.successResultOf(outcome).node, "n1")

    def test_deadline_503_after_cancel_wins(self) -> None:
        """No claim by the deadline: the cancel claim is written, then 503."""
        outcome = self.dispatcher.submit(self.job(deadline=2.0))
        self.queue.hold_cancels = True
        self.keep_alive("n1")
        self.advance(2.0)
        self.assertNoResult(outcome)
        self.queue.release_cancels()
        result = self.successResultOf(outcome)
        self.assertEqual(
            (result.error, result.message, result.finish_reason), ("busy", NO_SEAT, "queue_timeout")
        )
        self.assertEqual(self.queue.claims["j1"], Claim(cancelled=True))

    def test_deadline_loses_to_node(self) -> None:
        """A node's claim that beat the cancel: the gateway waits for that node's result."""
        outcome = self.dispatcher.submit(self.job(deadline=2.0))
        self.queue.claim("j1", "n1")  # the watch event has not arrived
        self.keep_alive("n1")
        self.advance(2.0)
        self.assertNoResult(outcome)
        self.assertEqual(self.dispatcher.jobs["j1"].state, "claimed")
        head = ResultHead(status=200, content_type="application/json", node="n1")
        self.dispatcher.result("j1", head, io.BytesIO(b""), 0)
        self.assertIsNone(self.successResultOf(outcome).error)

    def test_node_lost_502(self) -> None:
        """The claiming node's presence gone: 502 within the presence timeout plus a tick."""
        outcome = self.dispatcher.submit(self.job(deadline=100.0))
        self.dispatcher.claimed("j1", Claim(node="n1"))
        self.advance(3.0)
        self.assertNoResult(outcome)
        self.advance(TICK * 2)
        result = self.successResultOf(outcome)
        self.assertEqual(
            (result.error, result.message, result.node), ("node_lost", OUTCOME_UNKNOWN, "n1")
        )
        self.assertLessEqual(self.clock.seconds(), 3.0 + 1.0)

    def test_other_nodes_do_not_save_a_lost_claim(self) -> None:
        """Another node staying present does not keep a job whose node left."""
        self.pool.update(presence("n2"), 0.0)
        outcome = self.dispatcher.submit(self.job(deadline=100.0))
        self.dispatcher.claimed("j1", Claim(node="n1"))
        for _ in range(20):
            self.keep_alive("n2")
            self.advance(TICK)
        self.assertEqual(self.successResultOf(outcome).error, "node_lost")

    def test_no_502_while_nats_is_down(self) -> None:
        """With presence unknown (NATS down) a claimed job keeps waiting for its result."""
        outcome = self.dispatcher.submit(self.job(deadline=100.0))
        self.dispatcher.claimed("j1", Claim(node="n1"))
        self.pool.suspend()
        self.advance(8.0)
        self.assertNoResult(outcome)
        self.pool.resume(self.clock.seconds())
        head = ResultHead(status=200, content_type="application/json", node="n1")
        self.dispatcher.result("j1", head, io.BytesIO(b""), 0)
        self.assertIsNone(self.successResultOf(outcome).error)

    def test_overdue_result(self) -> None:
        """A live node that never posts: 502 after the run timeout and the grace."""
        self.dispatcher.result_grace = 1.0
        outcome = self.dispatcher.submit(self.job(deadline=100.0))
        self.dispatcher.claimed("j1", Claim(node="n1"))
        for _ in range(round(5.5 / TICK)):
            self.keep_alive("n1")
            self.advance(TICK)
        self.assertNoResult(outcome)
        for _ in range(4):
            self.keep_alive("n1")
            self.advance(TICK)
        self.assertEqual(self.successResultOf(outcome).finish_reason, "result_overdue")

    def test_every_node_gone_while_queued(self) -> None:
        """No node left that could run a queued job: 503 before the deadline, never run."""
        outcome = self.dispatcher.submit(self.job(deadline=100.0))
        self.advance(3.5)
        result = self.successResultOf(outcome)
        self.assertEqual((result.error, result.message), ("busy", NO_NODE))
        self.assertEqual(self.queue.claims["j1"], Claim(cancelled=True))
        self.assertFalse(self.queue.claim("j1", "n1"))

    def test_queue_full(self) -> None:
        """A refused publish: 503 at once, with the cancel claim written."""
        self.queue.refuse = "full"
        result = self.successResultOf(self.dispatcher.submit(self.job()))
        self.assertEqual(
            (result.error, result.message, result.finish_reason), ("busy", QUEUE_FULL, "queue_full")
        )
        self.assertEqual(self.queue.claims["j1"], Claim(cancelled=True))
        self.assertEqual(self.released, ["j1"])

    def test_queue_down(self) -> None:
        """NATS down: 503 for the new job."""
        self.queue.refuse = "down"
        result = self.successResultOf(self.dispatcher.submit(self.job()))
        self.assertEqual((result.error, result.finish_reason), ("busy", "queue_unavailable"))

    def test_client_leaves(self) -> None:
        """Cancelling the outcome (the client left) writes the cancel claim; a later claim loses."""
        outcome = self.dispatcher.submit(self.job())
        outcome.cancel()
        self.failureResultOf(outcome)
        self.assertEqual(self.queue.claims["j1"], Claim(cancelled=True))
        self.assertFalse(self.queue.claim("j1", "n1"))
        self.assertEqual(self.dispatcher.jobs, {})
        self.assertEqual(self.dispatcher.counts, {"client_disconnected": 1})
        self.assertEqual(self.released, ["j1"])

    def test_stop_answers_waiting_jobs(self) -> None:
        """A stopping gateway answers what waits: 503 queued (cancelled), 502 claimed."""
        queued = self.dispatcher.submit(self.job("j1"))
        claimed = self.dispatcher.submit(self.job("j2"))
        self.dispatcher.claimed("j2", Claim(node="n1"))
        self.dispatcher.stop()
        self.assertEqual(self.successResultOf(queued).error, "busy")
        self.assertEqual(self.successResultOf(claimed).error, "node_lost")
        self.assertEqual(self.queue.claims["j1"], Claim(cancelled=True))

    def test_outcome_type(self) -> None:
        """An error outcome carries no body."""
        self.assertIsNone(Outcome(error="busy").body)
