"""
Tests for L{kcoral.server.workers.pool.WorkerPool} with fake workers on a
L{MemoryReactorClock}: no processes, no sleeps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from twisted.internet.defer import CancelledError, Deferred, maybeDeferred
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase

from kcoral.config import ServerConfig
from kcoral.server.leases.lease import LeaseArbiter
from kcoral.server.workers.job import Job, JobResult
from kcoral.server.workers.maker import GRANT_WATCH_ENV, WorkerMaker, cores_to_spare, watch_allowed
from kcoral.server.workers.pool import BudgetSpent, PoolBusy, Seat, SeatUse, WorkerPool
from kcoral.server.workers.seat import hold_seat_only
from kcoral.testing.fakes import FakeSandbox, FakeSpawner, FakeWorker, pool_config
from kcoral.wire.channel import Outcome


class PoolTestCase(SynchronousTestCase):
    def make_pool(
        self,
        config: ServerConfig | None = None,
        auto_ready: bool = True,
        leases: Any = None,
        grant_watch: bool | None = None,
        **fields: Any,
    ) -> WorkerPool:
        self.reactor = MemoryReactorClock()
        self.sandbox = FakeSandbox()
        self.spawner = FakeSpawner(auto_ready)
        self.spawned = self.spawner.spawned

        pool = WorkerPool(
            config or pool_config(),
            self.reactor,
            leases(self.reactor) if leases is not None else None,
            self.sandbox,
            lambda f, *a, **k: maybeDeferred(f, *a, **k),
            Path("/nonexistent-kcoral-root"),
            **fields,
        )
        pool.maker.spawn_worker = self.spawner
        if grant_watch is not None:
            pool.maker.grant_watch = grant_watch
        self.successResultOf(Deferred.fromCoroutine(pool.start()))
        return pool


class AcquireTests(PoolTestCase):
    def test_start(self) -> None:
        pool = self.make_pool()
        self.assertEqual([s.worker_id for s in pool.seats], ["cpu/w0", "cpu/w1"])
        self.assertEqual([s.generation for s in pool.seats], [1, 1])
        self.assertEqual(pool.capacity, 2)
        self.assertEqual({s.status for s in pool.seats}, {"idle"})

    def test_idle_seat_at_once(self) -> None:
        pool = self.make_pool()
        seat = self.successResultOf(pool.acquire(10))
        self.assertIsInstance(seat, Seat)
        self.assertEqual(seat.status, "busy")
        self.assertEqual(pool.active, 1)

    def test_fifo_waiters(self) -> None:
        pool = self.make_pool(pool_config(max_requests_per_worker=0))
        a = self.successResultOf(pool.acquire(10))
        self.successResultOf(pool.acquire(10))
        waiters = [pool.acquire(10) for _ in range(3)]
        self.assertEqual(pool.queue_length, 3)
        for d in waiters:
            self.assertNoResult(d)
        pool.release(a)
        self.assertIs(self.successResultOf(waiters[0]), a)
        self.assertNoResult(waiters[1])
        self.assertNoResult(waiters[2])
        self.assertEqual(pool.queue_length, 2)
        pool.release(a)
        self.assertIs(self.successResultOf(waiters[1]), a)
        self.assertNoResult(waiters[2])

    def test_wait_timeout(self) -> None:
        pool = self.make_pool()
        pool.acquire(10)
        pool.acquire(10)
        d = pool.acquire(1.0)
        self.reactor.advance(0.9)
        self.assertNoResult(d)
        self.reactor.advance(0.2)
        self.failureResultOf(d, PoolBusy)
        self.assertEqual(pool.queue_length, 0)

    def test_zero_timeout_fails_at_once(self) -> None:
        pool = self.make_pool()
        pool.acquire(10)
        pool.acquire(10)
        self.failureResultOf(pool.acquire(0), PoolBusy)

    def test_timer_cancelled_on_handoff(self) -> None:
        pool = self.make_pool(pool_config(num_workers=1, max_requests_per_worker=0))
        seat = self.successResultOf(pool.acquire(10))
        d = pool.acquire(5)
        pool.release(seat)
        self.successResultOf(d)
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_cancel_leaves_line(self) -> None:
        pool = self.make_pool(pool_config(num_workers=1, max_requests_per_worker=0))
        seat = self.successResultOf(pool.acquire(10))
        first = pool.acquire(10)
        second = pool.acquire(10)
        first.cancel()
        self.failureResultOf(first)
        self.assertEqual(pool.queue_length, 1)
        pool.release(seat)
        self.assertIs(self.successResultOf(second), seat)

    def test_least_loaded_gpu(self) -> None:
        pool = self.make_pool(
            pool_config(device="gpu", gpus=(0, 1), workers_per_gpu=2, max_requests_per_worker=0)
        )
        first = self.successResultOf(pool.acquire(10))
        second = self.successResultOf(pool.acquire(10))
        third = self.successResultOf(pool.acquire(10))
        # Ties go to the earliest GPU in configured order.
        self.assertEqual(first.gpu_id, 0)
        self.assertEqual(second.gpu_id, 1)
        self.assertEqual(third.gpu_id, 0)
        pool.release(first)
        pool.release(third)
        # GPU 0 now has none assigned, GPU 1 one.
        self.assertEqual(self.successResultOf(pool.acquire(10)).gpu_id, 0)

    def test_most_recently_returned_within_gpu(self) -> None:
        pool = self.make_pool(pool_config(num_workers=3, max_requests_per_worker=0))
        seats = [self.successResultOf(pool.acquire(10)) for _ in range(3)]
        pool.release(seats[1])
        pool.release(seats[2])
        self.assertIs(self.successResultOf(pool.acquire(10)), seats[2])


class ReplacementTests(PoolTestCase):
    def test_seat_not_offered_until_replacement_ready(self) -> None:
        pool = self.make_pool(pool_config(num_workers=1))
        seat = self.successResultOf(pool.acquire(10))
        old = seat.worker
        waiter = pool.acquire(100)
        self.spawner.auto_ready = False
        pool.release(seat, retire="crashed")
        self.assertEqual(seat.status, "starting")
        self.assertEqual(seat.generation, 2)
        self.assertIsNot(seat.worker, old)
        self.assertTrue(old.killed)  # type: ignore[union-attr]
        self.assertNoResult(waiter)
        self.assertEqual(pool.capacity, 0)
        self.spawned[-1].come_up()
        self.assertIs(self.successResultOf(waiter), seat)
        self.assertEqual(pool.capacity, 1)

    def test_health_status_only_idle_or_busy(self) -> None:
        """
        /health's C{status} is only C{idle} or C{busy} (issue 17, item 6):
        a seat being replaced reads C{busy}, and C{state} tells why.
        """
        pool = self.make_pool(pool_config(num_workers=2))
        seat = self.successResultOf(pool.acquire(10))
        self.spawner.auto_ready = False
        rows = pool.worker_status(0.0)
        self.assertEqual([r["status"] for r in rows], ["busy", "idle"])
        self.assertEqual([r["state"] for r in rows], ["busy", "idle"])
        pool.release(seat, retire="crashed")
        self.assertEqual(seat.status, "starting")
        rows = pool.worker_status(0.0)
        self.assertEqual([r["status"] for r in rows], ["busy", "idle"])
        self.assertEqual([r["state"] for r in rows], ["starting", "idle"])
        self.spawned[-1].come_up()
        self.assertEqual([r["status"] for r in pool.worker_status(0.0)], ["idle", "idle"])

    def test_capacity_excludes_replacing(self) -> None:
        pool = self.make_pool(pool_config(num_workers=3))
        seat = self.successResultOf(pool.acquire(10))
        self.spawner.auto_ready = False
        self.assertEqual(pool.capacity, 3)
        pool.release(seat, retire="request_limit")
        # The retiring worker exits on its own; until then and until the
        # replacement is ready, the seat is not counted.
        self.assertEqual(pool.capacity, 2)
        old = seat.worker
        assert isinstance(old, FakeWorker)
        old.exit(0)
        self.assertEqual(pool.capacity, 2)
        self.spawned[-1].come_up()
        self.assertEqual(pool.capacity, 3)
        self.assertEqual(seat.status, "idle")

    def test_request_limit_retires_the_worker(self) -> None:
        """
        At its request limit the worker is asked to retire (it owns the one
        grace and the context teardown on the lease: test_workerproc), not
        killed.
        """
        pool = self.make_pool(pool_config(num_workers=1))
        seat = self.successResultOf(pool.acquire(10))
        old = seat.worker
        pool.release(seat, retire="request_limit")
        self.assertTrue(old.retired)  # type: ignore[union-attr]
        self.assertFalse(old.killed)  # type: ignore[union-attr]
        old.exit(0)  # type: ignore[union-attr]
        self.assertEqual(seat.generation, 2)
        self.assertEqual(seat.status, "idle")

    def test_idle_worker_death_replaced(self) -> None:
        pool = self.make_pool(pool_config(num_workers=1))
        seat = pool.seats[0]
        self.spawner.auto_ready = False
        seat.worker.exit(1)  # type: ignore[union-attr]
        self.assertEqual(pool.capacity, 0)
        self.failureResultOf(pool.acquire(0), PoolBusy)
        self.spawned[-1].come_up()
        self.assertEqual(seat.generation, 2)
        self.assertIs(self.successResultOf(pool.acquire(0)), seat)

    def test_reuse_clears_workspace(self) -> None:
        pool = self.make_pool(pool_config(num_workers=1, max_requests_per_worker=0))
        seat = self.successResultOf(pool.acquire(10))
        pool.release(seat)
        self.assertEqual(self.sandbox.cleared, [seat.work_dir])
        self.assertEqual(seat.generation, 1)
        self.assertEqual(seat.status, "idle")

    def test_replacement_failure_marks_dead_then_revived(self) -> None:
        pool = self.make_pool(pool_config(num_workers=1))
        seat = self.successResultOf(pool.acquire(10))
        self.spawner.auto_ready = False
        pool.release(seat, retire="crashed")
        failing = self.spawned[-1]
        failing.alive = False
        failing.ready.errback(RuntimeError("no"))
        # The dead seat is revived before anyone gets it, after a backoff.
        self.assertEqual(seat.generation, 2)
        self.assertEqual(seat.status, "dead")
        self.reactor.advance(pool.respawn_backoff_initial)
        self.assertEqual(seat.generation, 3)
        self.spawned[-1].come_up()
        self.assertIs(self.successResultOf(pool.acquire(0)), seat)
        self.assertEqual(seat.respawn_failures, 0)

    def test_respawn_failures_back_off_exponentially(self) -> None:
        """
        Replacements that keep failing are retried after 0.5, 1, 2, 4 ...
        seconds (at most a minute), not in a tight loop; /health shows the
        count, the error and when the next try is (issue 18, item 3).
        """
        pool = self.make_pool(pool_config(num_workers=1))
        seat = self.successResultOf(pool.acquire(10))
        self.spawner.auto_ready = False
        pool.release(seat, retire="crashed")
        waits = []
        for _ in range(9):
            failing = self.spawned[-1]
            failing.alive = False
            failing.ready.errback(RuntimeError("sandbox broken"))
            (row,) = pool.worker_status(self.reactor.seconds())
            self.assertEqual(row["respawn_error"], "sandbox broken")
            waits.append(row["respawn_in_seconds"])
            spawned = len(self.spawned)
            self.reactor.advance(row["respawn_in_seconds"] - 0.001)
            self.assertEqual(len(self.spawned), spawned)
            self.reactor.advance(0.001)
            self.assertEqual(len(self.spawned), spawned + 1)
        self.assertEqual(waits, [0.5, 1, 2, 4, 8, 16, 32, 60, 60])
        self.assertEqual(seat.respawn_failures, 9)
        self.spawned[-1].come_up()
        (row,) = pool.worker_status(self.reactor.seconds())
        self.assertEqual((row["respawn_failures"], row["respawn_in_seconds"]), (0, None))
        self.assertIs(self.successResultOf(pool.acquire(0)), seat)

    def test_stop_cancels_backoff(self) -> None:
        """Stopping the pool cancels a pending respawn."""
        pool = self.make_pool(pool_config(num_workers=1))
        seat = self.successResultOf(pool.acquire(10))
        self.spawner.auto_ready = False
        pool.release(seat, retire="crashed")
        failing = self.spawned[-1]
        failing.alive = False
        failing.ready.errback(RuntimeError("no"))
        pool.stop_waiters()
        self.assertEqual(self.reactor.getDelayedCalls(), [])


class ReuseScopeTests(PoolTestCase):
    """
    A reused worker runs the next program in the same interpreter, so it only
    serves requests of the client it first served, unless the operator
    chose C{--reuse-scope any} (issue 13, item 2).
    """

    def reuse_pool(self, num_workers: int = 1, scope: str = "address") -> WorkerPool:
        return self.make_pool(
            pool_config(num_workers=num_workers, max_requests_per_worker=0, reuse_scope=scope)
        )

    def test_same_client_reuses(self) -> None:
        pool = self.reuse_pool()
        seat = self.successResultOf(pool.acquire(10, "10.0.0.1"))
        pool.release(seat)
        again = self.successResultOf(pool.acquire(10, "10.0.0.1"))
        self.assertIs(again, seat)
        self.assertEqual(seat.generation, 1)
        self.assertEqual(len(self.spawned), 1)

    def test_other_client_gets_a_fresh_worker(self) -> None:
        pool = self.reuse_pool()
        seat = self.successResultOf(pool.acquire(10, "10.0.0.1"))
        first = seat.worker
        pool.release(seat)
        self.spawner.auto_ready = False
        d = pool.acquire(10, "10.0.0.2")
        # The request waits for the start its client caused.
        self.assertNoResult(d)
        self.assertTrue(first.killed)  # type: ignore[union-attr]
        self.spawned[-1].come_up()
        self.assertIs(self.successResultOf(d), seat)
        self.assertEqual(seat.generation, 2)
        self.assertEqual(seat.owner, "10.0.0.2")
        self.assertEqual(seat.status, "busy")
        self.assertEqual(pool.active, 1)

    def test_other_client_takes_a_ready_spare(self) -> None:
        """With a spare ready, the other client's request does not wait for a start."""
        pool = self.make_pool(
            pool_config(num_workers=1, max_requests_per_worker=0, spare_workers_per_gpu=1)
        )
        seat = self.successResultOf(pool.acquire(10, "10.0.0.1"))
        first = seat.worker
        spare_worker = pool.spares[0].worker
        pool.release(seat)
        self.spawner.auto_ready = False
        taken = self.successResultOf(pool.acquire(10, "10.0.0.2"))
        self.assertIs(taken, seat)
        self.assertIs(seat.worker, spare_worker)
        self.assertTrue(first.killed)  # type: ignore[union-attr]
        self.assertEqual((seat.owner, seat.status, seat.generation), ("10.0.0.2", "busy", 2))
        self.assertEqual(pool.active, 1)
        self.assertEqual([s.status for s in pool.spares], ["starting"])

    def test_waiter_of_other_client_gets_a_fresh_worker(self) -> None:
        pool = self.reuse_pool()
        seat = self.successResultOf(pool.acquire(10, "10.0.0.1"))
        waiting = pool.acquire(10, "10.0.0.2")
        self.assertNoResult(waiting)
        pool.release(seat)
        self.assertIs(self.successResultOf(waiting), seat)
        self.assertEqual(seat.generation, 2)
        self.assertEqual(seat.owner, "10.0.0.2")

    def test_prefers_the_clients_own_worker(self) -> None:
        pool = self.reuse_pool(num_workers=2)
        a = self.successResultOf(pool.acquire(10, "10.0.0.1"))
        b = self.successResultOf(pool.acquire(10, "10.0.0.2"))
        pool.release(a)
        pool.release(b)
        self.assertIs(self.successResultOf(pool.acquire(10, "10.0.0.1")), a)
        self.assertIs(self.successResultOf(pool.acquire(10, "10.0.0.2")), b)
        self.assertEqual(len(self.spawned), 2)

    def test_unknown_client_never_shares(self) -> None:
        pool = self.reuse_pool()
        seat = self.successResultOf(pool.acquire(10, None))
        pool.release(seat)
        self.successResultOf(pool.acquire(10, None))
        self.assertEqual(seat.generation, 2)

    def test_scope_any_shares(self) -> None:
        pool = self.reuse_pool(scope="any")
        seat = self.successResultOf(pool.acquire(10, "10.0.0.1"))
        pool.release(seat)
        self.assertIs(self.successResultOf(pool.acquire(10, "10.0.0.2")), seat)
        self.assertEqual(seat.generation, 1)

    def test_failed_start_fails_the_request(self) -> None:
        pool = self.reuse_pool()
        seat = self.successResultOf(pool.acquire(10, "10.0.0.1"))
        pool.release(seat)
        self.spawner.auto_ready = False
        d = pool.acquire(10, "10.0.0.2")
        failing = self.spawned[-1]
        failing.alive = False
        failing.ready.errback(RuntimeError("no"))
        self.failureResultOf(d, PoolBusy)
        self.assertEqual(pool.active, 0)


class SeatOnlyTests(PoolTestCase):
    """
    A program the server runs itself (a compile-only program) holds a seat
    of the same budget but not its worker: the worker is left as it was,
    whoever it served, and is offered again when the seat comes back.
    """

    def test_taken_and_given_back(self) -> None:
        """The seat counts as busy while held; given back, its worker is offered as it was."""
        pool = self.make_pool(pool_config(num_workers=1))
        seat = self.successResultOf(pool.acquire(10, "10.0.0.1", seat_only=True))
        worker = seat.worker
        self.assertEqual((pool.active, seat.status, seat.owner), (1, "busy", None))
        self.failureResultOf(pool.acquire(0), PoolBusy)
        pool.give_back(seat)
        self.assertEqual((pool.active, seat.status, seat.served), (0, "idle", 0))
        self.assertIs(seat.worker, worker)
        self.assertEqual((seat.generation, len(self.spawned)), (1, 1))

    def test_worker_of_another_client_is_not_replaced(self) -> None:
        """The reuse scope is the worker's: a seat-only hold replaces no worker."""
        pool = self.make_pool(
            pool_config(num_workers=1, max_requests_per_worker=0, reuse_scope="address")
        )
        seat = self.successResultOf(pool.acquire(10, "10.0.0.1"))
        pool.release(seat)
        held = self.successResultOf(pool.acquire(10, "10.0.0.2", seat_only=True))
        self.assertIs(held, seat)
        self.assertEqual((seat.generation, seat.owner, len(self.spawned)), (1, "10.0.0.1", 1))
        pool.give_back(seat)
        self.assertIs(self.successResultOf(pool.acquire(10, "10.0.0.1")), seat)
        self.assertEqual(seat.generation, 1)

    def test_waits_in_line(self) -> None:
        """With every seat taken it waits in the same line, and is served in turn."""
        pool = self.make_pool(
            pool_config(num_workers=1, max_requests_per_worker=0, reuse_scope="address")
        )
        seat = self.successResultOf(pool.acquire(10, "10.0.0.1"))
        waiting = pool.acquire(10, "10.0.0.2", seat_only=True)
        behind = pool.acquire(10, "10.0.0.1")
        self.assertEqual(pool.queue_length, 2)
        pool.release(seat)
        self.assertIs(self.successResultOf(waiting), seat)
        self.assertEqual(seat.generation, 1)
        self.assertNoResult(behind)
        pool.give_back(seat)
        self.assertIs(self.successResultOf(behind), seat)

    def test_hold(self) -> None:
        """L{hold_seat_only}: the seat for the block, given back after it, even on failure."""
        pool = self.make_pool(pool_config(num_workers=1))

        async def hold(fail: bool) -> float:
            async with hold_seat_only(pool, self.reactor, "10.0.0.1") as held:
                self.assertEqual(pool.active, 1)
                if fail:
                    raise ValueError("boom")
                return held.queue_ms

        self.assertEqual(self.successResultOf(Deferred.fromCoroutine(hold(False))), 0.0)
        self.assertEqual(pool.active, 0)
        self.failureResultOf(Deferred.fromCoroutine(hold(True)), ValueError)
        self.assertEqual((pool.active, pool.seats[0].status), (0, "idle"))

    def test_dead_worker_replaced_when_given_back(self) -> None:
        """A worker that died while its seat was held is replaced before the seat is offered."""
        pool = self.make_pool(pool_config(num_workers=1))
        seat = self.successResultOf(pool.acquire(10, seat_only=True))
        seat.worker.alive = False  # type: ignore[union-attr]
        pool.give_back(seat)
        self.assertEqual((seat.generation, len(self.spawned)), (2, 2))


class StopTests(PoolTestCase):
    def test_kill_now(self) -> None:
        """A second stop signal SIGKILLs every worker and fails the line at once."""
        pool = self.make_pool(pool_config(num_workers=2))
        held = self.successResultOf(pool.acquire(10))
        self.successResultOf(pool.acquire(10))
        waiter = pool.acquire(10)
        self.assertEqual(pool.kill_now(), 2)
        self.failureResultOf(waiter, PoolBusy)
        self.assertTrue(all(worker.killed_now for worker in self.spawned))
        self.assertFalse(held.worker.alive)  # type: ignore[union-attr]
        self.assertEqual(pool.kill_now(), 0)

    def test_stop_fails_waiters(self) -> None:
        pool = self.make_pool()
        pool.acquire(10)
        pool.acquire(10)
        waiters = [pool.acquire(10), pool.acquire(10)]
        stopped = Deferred.fromCoroutine(pool.stop())
        for d in waiters:
            self.failureResultOf(d, PoolBusy)
        self.successResultOf(stopped)
        self.assertTrue(all(w.stopped for w in self.spawned))
        self.assertEqual(pool.capacity, 0)
        self.failureResultOf(pool.acquire(10), PoolBusy)
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_stop_waiters_keeps_workers(self) -> None:
        pool = self.make_pool()
        pool.acquire(10)
        pool.acquire(10)
        waiter = pool.acquire(10)
        pool.stop_waiters()
        self.failureResultOf(waiter, PoolBusy)
        self.assertFalse(any(w.stopped for w in self.spawned))

    def test_no_replacement_while_closing(self) -> None:
        pool = self.make_pool(pool_config(num_workers=1))
        seat = self.successResultOf(pool.acquire(10))
        pool.closing = True
        pool.release(seat, retire="crashed")
        self.assertEqual(len(self.spawned), 1)
        self.successResultOf(Deferred.fromCoroutine(pool.stop()))

    def test_mixed_targets_fail_start(self) -> None:
        self.reactor = MemoryReactorClock()
        arches = iter(["sm_90a", "sm_80"])

        def spawn(
            reactor: Any, *, seat: str, generation: int, gpus: tuple[int, ...], **kw: Any
        ) -> FakeWorker:
            worker = FakeWorker(seat, generation, gpus)
            worker.come_up(next(arches))
            return worker

        pool = WorkerPool(
            pool_config(device="gpu", gpus=(0, 1)),
            self.reactor,
            None,
            FakeSandbox(),
            lambda f, *a, **k: maybeDeferred(f, *a, **k),
            Path("/nonexistent-kcoral-root"),
        )
        pool.maker.spawn_worker = spawn  # type: ignore[assignment]
        failure = self.failureResultOf(Deferred.fromCoroutine(pool.start()), RuntimeError)
        self.assertTrue(str(failure.value).startswith("a pool serves one target"))


def _job(timeout: float = 10.0) -> Job:
    return Job(
        request_id="req-1",
        program_text="{}",
        program=None,  # type: ignore[arg-type]
        blobs={},
        timeout_seconds=timeout,
        output_limit=1024,
        max_response_bytes=1 << 20,
    )


class SeatTests(PoolTestCase):
    """L{WorkerPool.seat}: one request's seat, from the queue to its release."""

    def use_seat(
        self,
        pool: WorkerPool,
        job: Job | None = None,
        gpu_count: int | None = None,
        error: Exception | None = None,
    ) -> Deferred[Any]:
        self.uses: list[SeatUse] = []

        async def go() -> JobResult:
            async with pool.seat("req-1", gpu_count) as use:
                self.uses.append(use)
                if error is not None:
                    raise error
                return await use.run(job or _job())

        return Deferred.fromCoroutine(go())

    def test_cancelled_run_replaces_worker(self) -> None:
        """
        A request cancelled while its program runs (its client left) retires
        the worker as C{abandoned}: it is killed and replaced, not reused
        while still running the program (issue 18, item 4).
        """
        pool = self.make_pool(pool_config(num_workers=1, max_requests_per_worker=0))
        worker = self.spawned[0]
        running: Deferred[JobResult] = Deferred()
        worker.run = lambda job: running  # type: ignore[method-assign]
        d = self.use_seat(pool)
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertEqual(self.uses[0].retire_reason(), "abandoned")
        self.assertTrue(worker.killed)
        self.assertEqual(len(self.spawned), 2)
        self.assertEqual(pool.seats[0].status, "idle")

    def test_queue_is_capped(self) -> None:
        """Past --max-queued-requests a request is refused at once (a 503)."""
        pool = self.make_pool(pool_config(num_workers=1, max_queued_requests=2))
        held = self.successResultOf(pool.acquire(10))
        first, second = pool.acquire(10), pool.acquire(10)
        self.failureResultOf(pool.acquire(10), PoolBusy)
        self.assertEqual(pool.queue_length, 2)
        pool.release(held)
        self.assertIs(self.successResultOf(first), held)
        self.assertNoResult(second)
        second.cancel()
        self.failureResultOf(second)

    def test_cancelled_wait_leaves_the_line(self) -> None:
        """A queued request that is cancelled leaves the line at once."""
        pool = self.make_pool(pool_config(num_workers=1))
        held = self.successResultOf(pool.acquire(10))
        d = self.use_seat(pool)
        self.assertEqual(pool.queue_length, 1)
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertEqual(pool.queue_length, 0)
        self.assertEqual(self.uses, [])
        pool.release(held)

    def test_runs_in_the_workspace_and_reuses(self) -> None:
        """
        The job runs in the seat's workspace as the worker sees it; without
        a request limit the seat is cleared and offered again.
        """
        pool = self.make_pool(pool_config(num_workers=1, max_requests_per_worker=0))
        result = self.successResultOf(self.use_seat(pool))
        self.assertEqual(result.ending, "outcome")
        worker = self.spawned[0]
        seat = pool.seats[0]
        self.assertEqual(worker.jobs[0].workspace, str(seat.work_dir))
        self.assertEqual(self.uses[0].worker_id, "cpu/w0")
        self.assertIsNone(self.uses[0].retire_reason())
        # Without a sandbox: emptied before the answer, which also serves
        # the seat's reuse (nothing writes there after the answer).
        self.assertEqual(self.sandbox.cleared, [seat.work_dir])
        self.assertEqual(seat.status, "idle")
        self.assertEqual(len(self.spawned), 1)

    def test_sandboxed_workspace_emptied_on_reuse_only(self) -> None:
        """Under a sandbox the workspace is emptied once, when the seat is reused."""
        pool = self.make_pool(pool_config(num_workers=1, max_requests_per_worker=0))
        self.sandbox.name = "bubblewrap"  # type: ignore[misc]
        self.successResultOf(self.use_seat(pool))
        self.assertEqual(self.sandbox.cleared, [pool.seats[0].work_dir])

    def test_workers_trace_instructions_at_debug(self) -> None:
        """Only a server that logs DEBUG has its workers log each instruction."""
        for level, traced in (("info", False), ("debug", True)):
            pool = self.make_pool(pool_config(num_workers=1, log_level=level))
            self.assertEqual(pool.seats[0].worker.settings.trace_instructions, traced)

    def test_clean_workspace_is_not_cleared(self) -> None:
        """
        A workspace the program left as it found it is neither emptied
        before the answer nor cleared for reuse (no thread), with or without
        a sandbox; the seat is offered again at once.
        """
        for name in ("none", "bubblewrap"):
            pool = self.make_pool(pool_config(num_workers=1, max_requests_per_worker=0))
            self.sandbox.name = name  # type: ignore[misc]
            self.sandbox.clean = True
            self.successResultOf(self.use_seat(pool))
            self.assertEqual(self.sandbox.cleared, [])
            self.assertEqual(pool.seats[0].status, "idle")
            self.assertEqual(len(self.spawned), 1)
            self.spawned.clear()

    def test_unemptied_workspace_retires(self) -> None:
        """Without a sandbox, a workspace that cannot be emptied retires its worker."""
        pool = self.make_pool(pool_config(num_workers=1, max_requests_per_worker=0))

        def refuse(work_dir: Path) -> None:
            raise OSError("busy")

        self.sandbox.clear_workspace = refuse  # type: ignore[method-assign]
        self.successResultOf(self.use_seat(pool))
        self.assertTrue(self.spawned[0].killed)
        self.assertEqual(len(self.spawned), 2)

    def test_request_limit_retires(self) -> None:
        """At the request limit the seat's worker is replaced."""
        pool = self.make_pool(pool_config(num_workers=1, max_requests_per_worker=1))
        self.successResultOf(self.use_seat(pool))
        self.assertEqual(self.uses[0].retire_reason(), "request_limit")
        self.spawned[0].exit(0)
        self.assertEqual(len(self.spawned), 2)
        self.assertEqual(pool.seats[0].generation, 2)

    def test_pool_tells_the_last_request(self) -> None:
        """
        The pool alone counts a worker's requests: each job says whether it
        is the worker's last, and after the last the worker is retired.
        """
        pool = self.make_pool(
            pool_config(num_workers=1, max_requests_per_worker=3, reuse_scope="any")
        )
        for _ in range(3):
            self.successResultOf(self.use_seat(pool))
        first = self.spawned[0]
        self.assertEqual([job.last for job in first.jobs], [False, False, True])
        self.assertEqual(self.uses[0].retire_reason(), "request_limit")
        self.assertTrue(first.retired)
        first.exit(0)
        self.successResultOf(self.use_seat(pool))
        self.assertEqual([job.last for job in self.spawned[1].jobs], [False])

    def test_unlimited_never_last(self) -> None:
        pool = self.make_pool(
            pool_config(num_workers=1, max_requests_per_worker=0, reuse_scope="any")
        )
        for _ in range(3):
            self.successResultOf(self.use_seat(pool))
        self.assertEqual([job.last for job in self.spawned[0].jobs], [False] * 3)
        self.assertFalse(self.spawned[0].retired)

    def test_worker_asks_to_retire(self) -> None:
        """An outcome that names a retire reason retires the worker."""
        pool = self.make_pool(pool_config(num_workers=1, max_requests_per_worker=0))
        self.spawned[0].result = JobResult(
            "outcome", outcome=Outcome(status="FAILED", retire="poisoned_context")
        )
        self.successResultOf(self.use_seat(pool))
        self.assertEqual(self.uses[0].retire_reason(), "poisoned_context")
        self.assertTrue(self.spawned[0].killed)

    def test_timeout_and_crash_retire(self) -> None:
        """A timed-out, crashed or channel-breaking job retires its worker."""
        expected = {"timeout": "timeout", "crashed": "crashed", "invalid": "channel_violation"}
        for ending, reason in expected.items():
            pool = self.make_pool(pool_config(num_workers=1, max_requests_per_worker=0))
            self.spawned[0].result = JobResult(ending)
            self.successResultOf(self.use_seat(pool))
            self.assertEqual(self.uses[0].retire_reason(), reason)
            # Without a sandbox the worker is stopped before its workspace is emptied.
            self.assertTrue(self.spawned[0].killed)

    def test_failure_before_run_keeps_a_healthy_worker(self) -> None:
        """A request that fails before it runs gives its seat back for reuse."""
        pool = self.make_pool(pool_config(num_workers=1, max_requests_per_worker=0))
        self.failureResultOf(self.use_seat(pool, error=ValueError("boom")), ValueError)
        self.assertEqual(pool.seats[0].status, "idle")
        self.assertEqual(pool.active, 0)

    def test_busy_reports_queue_time(self) -> None:
        """A request that waited in vain learns how long it waited."""
        pool = self.make_pool(pool_config(num_workers=1, worker_wait_timeout_seconds=2.0))
        self.successResultOf(pool.acquire(10))
        d = self.use_seat(pool)
        self.reactor.advance(2.0)
        failure = self.failureResultOf(d, PoolBusy)
        self.assertEqual(failure.value.queue_ms, 2000.0)

    def test_multi_gpu_worker(self) -> None:
        """
        With a GPU count, the request runs on a one-request worker that sees
        the least busy GPUs; afterwards it is removed.
        """
        pool = self.make_pool(
            pool_config(device="gpu", gpus=(0, 1), max_requests_per_worker=0),
            leases=lambda reactor: LeaseArbiter((0, 1), reactor),
        )
        result = self.successResultOf(self.use_seat(pool, gpu_count=2))
        self.assertEqual(result.ending, "outcome")
        use = self.uses[0]
        transient = self.spawned[-1]
        self.assertEqual(transient.gpus, (0, 1))
        self.assertEqual(use.gpus, (0, 1))
        self.assertTrue(use.multi_gpu)
        self.assertEqual(use.generation, 0)
        self.assertEqual(use.placement.gpus, (0, 1))
        self.assertEqual(len(transient.jobs), 1)
        self.assertTrue(transient.killed)
        # The worker takes the GPUs' lease itself; the request holds none.
        self.assertIsNone(pool.leases.holder_of(0))
        self.assertIsNone(pool.leases.holder_of(1))
        self.assertEqual(pool.active, 0)

    def test_multi_gpu_startup_spends_the_budget(self) -> None:
        """A multi-GPU worker that starts slower than the budget never runs."""
        pool = self.make_pool(
            pool_config(device="gpu", gpus=(0, 1), max_requests_per_worker=0),
            leases=lambda reactor: LeaseArbiter((0, 1), reactor),
        )
        self.spawner.auto_ready = False
        d = self.use_seat(pool, job=_job(timeout=1.0), gpu_count=2)
        self.reactor.advance(2.0)
        self.spawned[-1].come_up()
        self.failureResultOf(d, BudgetSpent)
        self.assertEqual(self.spawned[-1].jobs, [])
        self.assertTrue(self.spawned[-1].killed)
        self.assertEqual(pool.active, 0)


class SpareTests(PoolTestCase):
    """
    Warm spares: started beside the seats, a retiring worker's seat is
    refilled from them at once, and they are replenished in the background.
    """

    def spare_pool(self, **changes: Any) -> WorkerPool:
        config = pool_config(num_workers=1, spare_workers_per_gpu=2, **changes)
        return self.make_pool(config)

    def test_spares_start_after_the_seats(self) -> None:
        """Spares start once the seats are ready; they add no request capacity."""
        pool = self.spare_pool()
        self.assertEqual(len(self.spawned), 3)
        self.assertEqual([s["state"] for s in pool.spare_status(0.0)], ["ready", "ready"])
        self.assertEqual([s.spare_id for s in pool.spares], ["cpu/s1", "cpu/s2"])
        self.assertEqual(pool.capacity, 1)

    def test_no_spares(self) -> None:
        """With no spares configured the pool starts only its seats."""
        pool = self.make_pool(pool_config(num_workers=1))
        self.assertEqual((len(self.spawned), pool.spares), (1, []))

    def test_retired_seat_refilled_at_once(self) -> None:
        """
        A request that finds a spare ready never waits for a replacement:
        the seat is idle again at once with the spare's worker, the old
        worker is asked to retire, and a new spare starts.
        """
        pool = self.spare_pool()
        seat = self.successResultOf(pool.acquire(10))
        old = seat.worker
        spare_worker = pool.spares[0].worker
        waiting = pool.acquire(10)
        self.spawner.auto_ready = False
        pool.release(seat, retire="request_limit")
        self.assertIs(self.successResultOf(waiting), seat)
        self.assertIs(seat.worker, spare_worker)
        self.assertEqual(seat.worker.seat, "cpu/w0")  # type: ignore[union-attr]
        self.assertEqual(seat.generation, 2)
        self.assertTrue(old.retired)  # type: ignore[union-attr]
        self.assertEqual(pool.capacity, 1)
        # The replenishing spare is starting.
        self.assertEqual([s.status for s in pool.spares], ["ready", "starting"])
        self.spawned[-1].come_up()
        self.assertEqual([s.status for s in pool.spares], ["ready", "ready"])

    def test_crashed_worker_refilled_from_a_spare(self) -> None:
        """A crash retires through the spares too; the old worker is killed."""
        pool = self.spare_pool()
        seat = self.successResultOf(pool.acquire(10))
        old = seat.worker
        pool.release(seat, retire="timeout")
        self.assertTrue(old.killed)  # type: ignore[union-attr]
        self.assertEqual(seat.status, "idle")
        self.assertEqual(len(pool.spares), 2)

    def test_without_a_ready_spare_replaced_in_place(self) -> None:
        """Spares still starting: the seat is replaced as before."""
        pool = self.spare_pool()
        for spare in list(pool.spares):
            spare.status = "starting"
        seat = self.successResultOf(pool.acquire(10))
        old = seat.worker
        assert isinstance(old, FakeWorker)
        self.spawner.auto_ready = False
        pool.release(seat, retire="request_limit")
        self.assertEqual(seat.status, "replacing")
        self.assertEqual(pool.capacity, 0)
        old.exit(0)
        self.spawned[-1].come_up()
        self.assertEqual(seat.status, "idle")

    def test_idle_spare_death_replenished(self) -> None:
        """A ready spare that dies is dropped and another started."""
        pool = self.spare_pool()
        first = pool.spares[0].worker
        assert isinstance(first, FakeWorker)
        first.exit(1)
        self.assertEqual(len(pool.spares), 2)
        self.assertNotIn(first, [s.worker for s in pool.spares])
        self.assertEqual(len(self.spawned), 4)

    def test_failed_spare_backs_off(self) -> None:
        """A spare that cannot start is retried after a backoff, not in a loop."""
        pool = self.make_pool(pool_config(num_workers=1, spare_workers_per_gpu=1))
        seat = self.successResultOf(pool.acquire(10))
        self.spawner.auto_ready = False
        pool.release(seat, retire="request_limit")
        # The spare went to the seat; the new one fails to start.
        failing = self.spawned[-1]
        failing.ready.errback(RuntimeError("no memory"))
        self.assertEqual(pool.spares, [])
        spawned = len(self.spawned)
        self.reactor.advance(0.4)
        self.assertEqual(len(self.spawned), spawned)
        self.reactor.advance(0.2)
        self.assertEqual(len(self.spawned), spawned + 1)
        self.assertEqual(len(pool.spares), 1)

    def test_stop_and_kill_reach_spares(self) -> None:
        """Stopping the pool stops its spares; a forced stop kills them."""
        pool = self.spare_pool()
        workers = [s.worker for s in pool.spares]
        self.successResultOf(Deferred.fromCoroutine(pool.stop()))
        self.assertTrue(all(w.stopped for w in workers))  # type: ignore[union-attr]
        pool = self.spare_pool()
        workers = [s.worker for s in pool.spares]
        self.assertEqual(pool.kill_now(), 3)
        self.assertTrue(all(w.killed_now for w in workers))  # type: ignore[union-attr]
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_stop_kills_starting_spares_at_once(self) -> None:
        """A spare still starting cannot read Exit: stopping the pool kills it at once."""
        pool = self.make_pool(pool_config(num_workers=1, spare_workers_per_gpu=1))
        seat = self.successResultOf(pool.acquire(10))
        self.spawner.auto_ready = False
        pool.release(seat, retire="timeout")  # the spare is adopted, another starts
        starting = pool.spares[0].worker
        assert isinstance(starting, FakeWorker) and pool.spares[0].status == "starting"
        d = Deferred.fromCoroutine(pool.stop())
        self.assertTrue(starting.killed_now)
        self.successResultOf(d)

    def test_stop_is_bounded(self) -> None:
        """A worker that ignores Exit is SIGKILLed once the stop guard runs out."""
        pool = self.spare_pool()
        stubborn = pool.seats[0].worker
        assert isinstance(stubborn, FakeWorker)
        stubborn.stop = lambda: stubborn.ended  # type: ignore[method-assign]
        d = Deferred.fromCoroutine(pool.stop())
        self.assertNoResult(d)
        self.reactor.advance(pool.stop_guard_seconds)
        self.assertTrue(stubborn.killed_now)
        self.successResultOf(d)
        self.assertEqual(pool.spares, [])
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_gpu_spares_per_gpu(self) -> None:
        """In GPU mode each GPU keeps its own spares, refilling its own seats."""
        config = pool_config(device="gpu", gpus=(0, 1), workers_per_gpu=1, spare_workers_per_gpu=1)
        pool = self.make_pool(config)
        self.assertEqual(sorted(s.gpu_id for s in pool.spares), [0, 1])
        seat = next(s for s in pool.seats if s.gpu_id == 1)
        gpu1_spare = next(s for s in pool.spares if s.gpu_id == 1)
        pool._idle.remove(seat)
        pool.active += 1
        pool._assigned[1] += 1
        pool.release(seat, retire="request_limit")
        self.assertIs(seat.worker, gpu1_spare.worker)


class TemplateTests(PoolTestCase):
    """Workers forked by templates (C{--worker-start fork}), and the fallback."""

    def test_fallback_when_no_template_starts(self) -> None:
        """A template that cannot start leaves its seats spawning, loudly."""
        from kcoral.server.sandbox.interface import SandboxError

        def broken(**kw: Any) -> Any:
            raise SandboxError("no template here")

        self.reactor = MemoryReactorClock()
        sandbox = FakeSandbox()
        sandbox.template_command = broken  # type: ignore[method-assign]
        spawner = FakeSpawner()
        pool = WorkerPool(
            pool_config(worker_start="fork"),
            self.reactor,
            None,
            sandbox,
            lambda f, *a, **k: maybeDeferred(f, *a, **k),
            Path("/nonexistent-kcoral-root"),
        )
        pool.maker.spawn_worker = spawner
        self.successResultOf(Deferred.fromCoroutine(pool.start()))
        self.assertEqual(len(spawner.spawned), 2)
        self.assertEqual(pool.worker_start, "spawn")
        [template] = pool.templates.values()
        self.assertEqual(template.state, "failed")
        self.assertIn("no template here", template.error or "")

    def test_forks_from_ready_template(self) -> None:
        """A seat whose template is ready forks its replacement through it."""
        from kcoral.server.workers.template import WorkerTemplate

        pool = self.make_pool()
        template = WorkerTemplate("cpu", self.reactor)
        template.connect(lambda data, fds: None)
        template.message({"op": "ready", "pid": 1})
        pool.templates.templates = {None: template}
        self.assertEqual(pool.worker_start, "fork")
        forked: list[dict[str, Any]] = []

        def fork(reactor: Any, **kw: Any) -> FakeWorker:
            forked.append(kw)
            worker = FakeWorker(kw["seat"], kw["generation"], kw["gpus"], env=kw["env"])
            worker.come_up()
            return worker

        pool.maker.fork_worker = fork
        seat = self.successResultOf(pool.acquire(10))
        pool.release(seat, retire="request_limit")
        old = seat.worker
        assert isinstance(old, FakeWorker)
        old.exit(0)
        [call] = forked
        self.assertIs(call["template"], template)
        self.assertEqual(call["seat"], seat.worker_id)
        self.assertEqual(call["args"][:2], ["--device", "cpu"])
        self.assertEqual(seat.status, "idle")

    def test_multi_gpu_workers(self) -> None:
        """
        A multi-GPU worker is spawned where each template sees its own GPU
        only (bubblewrap); without device isolation its first GPU's
        template forks it (CUDA_VISIBLE_DEVICES names the set).
        """
        from kcoral.server.workers.template import WorkerTemplate

        pool = self.make_pool(pool_config(device="gpu", gpus=(0, 1)))
        templates = {}
        for gpu in (0, 1):
            templates[gpu] = WorkerTemplate(f"gpu{gpu}", self.reactor)
            templates[gpu].connect(lambda data, fds: None)
            templates[gpu].message({"op": "ready", "pid": 1})
        pool.templates.templates = dict(templates)
        self.assertIs(pool.maker.template_for((1,)), templates[1])
        self.assertIs(pool.maker.template_for((0, 1)), templates[0])
        self.sandbox.isolates_devices = True
        self.assertIsNone(pool.maker.template_for((0, 1)))
        self.assertIs(pool.maker.template_for((1,)), templates[1])

    def test_forked_worker_failing_at_startup_falls_back(self) -> None:
        """
        A template whose first worker cannot start is given up at startup:
        the seat is spawned, and so is every later worker of that template.
        """
        from kcoral.server.workers.template import WorkerTemplate

        self.reactor = MemoryReactorClock()
        spawner = FakeSpawner()
        pool = WorkerPool(
            pool_config(num_workers=1),
            self.reactor,
            None,
            FakeSandbox(),
            lambda f, *a, **k: maybeDeferred(f, *a, **k),
            Path("/nonexistent-kcoral-root"),
        )
        template = WorkerTemplate("cpu", self.reactor)
        template.connect(lambda data, fds: None)
        template.message({"op": "ready", "pid": 1})
        pool.templates.templates = {None: template}
        forked: list[FakeWorker] = []

        def fork(reactor: Any, **kw: Any) -> FakeWorker:
            worker = FakeWorker(kw["seat"], kw["generation"], kw["gpus"])
            worker.made = "fork"  # type: ignore[attr-defined]
            worker.ready.errback(RuntimeError("cannot mount /proc"))
            forked.append(worker)
            return worker

        pool.maker.fork_worker = fork
        pool.maker.spawn_worker = spawner
        self.successResultOf(Deferred.fromCoroutine(pool.start()))
        self.assertEqual(len(forked), 1)
        self.assertEqual(len(spawner.spawned), 1)
        self.assertEqual(template.state, "failed")
        self.assertEqual(pool.worker_start, "spawn")

    def test_failed_template_restarted(self) -> None:
        """
        A template that fails while serving is started again after a
        back-off that doubles while restarts fail; meanwhile its seats spawn.
        """
        from kcoral.server.workers.template import TemplateError, WorkerTemplate

        pool = self.make_pool()
        template = WorkerTemplate("cpu", self.reactor)
        template.connect(lambda data, fds: None)
        template.message({"op": "ready", "pid": 1})
        template.on_failure = pool.templates.lost
        pool.templates.templates = {None: template}
        attempts: list[WorkerTemplate] = []
        outcomes = [False, True]

        async def start(_: WorkerMaker, new: WorkerTemplate, key: int | None) -> None:
            attempts.append(new)
            if not outcomes.pop(0):
                new.broken("cannot start")
                self.failureResultOf(new.ready, TemplateError)
                raise TemplateError("cannot start")
            new.connect(lambda data, fds: None)
            new.message({"op": "ready", "pid": 2})

        self.patch(WorkerMaker, "_start_template", start)
        template.broken("socket closed")
        self.assertEqual(pool.worker_start, "spawn")
        self.reactor.advance(pool.respawn_backoff_initial)
        self.assertEqual(len(attempts), 1)
        self.assertEqual(pool.worker_start, "spawn")
        self.reactor.advance(pool.respawn_backoff_initial)  # the back-off doubled
        self.assertEqual(len(attempts), 1)
        self.reactor.advance(pool.respawn_backoff_initial)
        self.assertEqual(len(attempts), 2)
        self.assertIs(pool.templates[None], attempts[1])
        self.assertEqual(pool.worker_start, "fork")
        self.successResultOf(Deferred.fromCoroutine(pool.stop()))


class WatchNextTests(PoolTestCase):
    """
    Where workers may watch, one watches for its next program only while
    it runs the pool's one program: a sequential client's case.
    """

    def test_only_while_one_seat_is_taken(self) -> None:
        pool = self.make_pool(grant_watch=True)
        workers = [seat.worker for seat in pool.seats]
        self.assertTrue(all(w.settings.grant_watch for w in workers))
        first = self.successResultOf(pool.acquire(10))
        self.assertTrue(first.worker.settings.may_watch_next())
        second = self.successResultOf(pool.acquire(10))
        self.assertFalse(first.worker.settings.may_watch_next())
        self.assertFalse(second.worker.settings.may_watch_next())
        pool.release(first)
        self.assertTrue(second.worker.settings.may_watch_next())

    def test_not_told_where_workers_may_not_watch(self) -> None:
        pool = self.make_pool(grant_watch=False)
        self.assertFalse(any(seat.worker.settings.grant_watch for seat in pool.seats))


class CoresToSpareTests(SynchronousTestCase):
    """Workers watch for their grant awake only where a core is spare for it."""

    def test_gpu_server_with_cores_left(self) -> None:
        config = ServerConfig(device="gpu", gpus=(0,), workers_per_gpu=8, max_requests_per_worker=0)
        # 8 workers, the front end, and the one waiter that watches.
        self.assertTrue(cores_to_spare(config, cpus=10))
        self.assertFalse(cores_to_spare(config, cpus=9))

    def test_spares_front_ends_and_the_broker_count(self) -> None:
        config = ServerConfig(
            device="gpu",
            gpus=(0, 1),
            workers_per_gpu=4,
            max_requests_per_worker=1,
            spare_workers_per_gpu=2,
            front_ends=2,
        )
        # (4 + 2) x 2 workers and spares, 2 front ends, the broker, 2 watchers.
        self.assertTrue(cores_to_spare(config, cpus=17))
        self.assertFalse(cores_to_spare(config, cpus=16))

    def test_a_cpu_server_needs_a_core_per_worker(self) -> None:
        config = ServerConfig(device="cpu", num_workers=4, max_requests_per_worker=0)
        # 4 workers and the front end; no GPU to wait for.
        self.assertTrue(cores_to_spare(config, cpus=5))
        self.assertFalse(cores_to_spare(config, cpus=4))

    def test_the_environment_overrides(self) -> None:
        config = ServerConfig(device="cpu", num_workers=64, max_requests_per_worker=0)
        self.assertTrue(watch_allowed(config, {GRANT_WATCH_ENV: "1"}))
        config = ServerConfig(device="cpu", num_workers=1, max_requests_per_worker=0)
        self.assertFalse(watch_allowed(config, {GRANT_WATCH_ENV: "0"}))
