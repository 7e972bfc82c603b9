"""
Tests for L{kcoral.server.pool.WorkerPool} with fake workers on a
L{MemoryReactorClock}: no processes, no sleeps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase

from kcoral.server.pool import PoolBusy, Seat, WorkerPool


@attrs.define
class Config:
    device: str = "cpu"
    num_workers: int = 2
    gpus: tuple[int, ...] = ()
    workers_per_gpu: int = 1
    max_requests_per_worker: int = 1
    reuse_scope: str = "address"
    worker_termination_grace_seconds: float = 5.0
    tensor_api: str = "auto"


class FakeSandbox:
    name = "none"
    reserved = None

    def __init__(self) -> None:
        self.cleared: list[Any] = []

    def prepare_seat(self, seat_dir: Path) -> Path:
        return seat_dir / "work"

    def command(
        self, *, python: str, worker_args: list[str], work_dir: Path, gpu_devices: list[str]
    ) -> Any:
        return python, [python, "-m", "kcoral.worker", *worker_args], {}

    def clear_workspace(self, work_dir: Path) -> None:
        self.cleared.append(work_dir)

    def worker_path(self, work_dir: Path) -> str:
        return str(work_dir)


class FakeWorker:
    """What the pool uses of a L{WorkerProcess}."""

    def __init__(self, seat: str, generation: int, gpus: tuple[int, ...]) -> None:
        self.seat = seat
        self.generation = generation
        self.gpus = gpus
        self.ready: Deferred[dict[str, Any]] = Deferred()
        self.ended: Deferred[int | None] = Deferred()
        self.alive = True
        self.pid = 1000 + generation
        self.info: dict[str, Any] = {}
        self.started_at = 0.0
        self.killed = False
        self.killed_now = False
        self.stopped = False
        self._job = None

    def come_up(self, arch: str = "") -> None:
        self.info = {"target": {"arch": arch} if arch else {}, "versions": {}}
        self.ready.callback(self.info)

    def exit(self, code: int = 0) -> None:
        self.alive = False
        self.ended.callback(code)

    def kill(self) -> Deferred[int | None]:
        self.killed = True
        if self.alive:
            self.exit(-15)
        return succeed(-15)

    def kill_now(self) -> None:
        self.killed_now = True
        if self.alive:
            self.exit(-9)

    def stop(self) -> Deferred[int | None]:
        self.stopped = True
        if self.alive:
            self.exit(0)
        return succeed(0)


class PoolTestCase(SynchronousTestCase):
    def make_pool(self, config: Config | None = None, auto_ready: bool = True) -> WorkerPool:
        self.reactor = MemoryReactorClock()
        self.sandbox = FakeSandbox()
        self.spawned: list[FakeWorker] = []
        self.auto_ready = auto_ready

        def spawn(
            reactor: Any, *, seat: str, generation: int, gpus: tuple[int, ...], **kw: Any
        ) -> FakeWorker:
            worker = FakeWorker(seat, generation, gpus)
            self.spawned.append(worker)
            if self.auto_ready:
                worker.come_up()
            return worker

        pool = WorkerPool(
            config or Config(),
            self.reactor,
            None,
            self.sandbox,
            lambda f, *a, **k: maybeDeferred(f, *a, **k),
            Path("/nonexistent-kcoral-root"),
        )
        pool.spawn_worker = spawn  # type: ignore[assignment]
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
        pool = self.make_pool(Config(max_requests_per_worker=0))
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
        pool = self.make_pool(Config(num_workers=1, max_requests_per_worker=0))
        seat = self.successResultOf(pool.acquire(10))
        d = pool.acquire(5)
        pool.release(seat)
        self.successResultOf(d)
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_cancel_leaves_line(self) -> None:
        pool = self.make_pool(Config(num_workers=1, max_requests_per_worker=0))
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
            Config(device="gpu", gpus=(0, 1), workers_per_gpu=2, max_requests_per_worker=0)
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
        pool = self.make_pool(Config(num_workers=3, max_requests_per_worker=0))
        seats = [self.successResultOf(pool.acquire(10)) for _ in range(3)]
        pool.release(seats[1])
        pool.release(seats[2])
        self.assertIs(self.successResultOf(pool.acquire(10)), seats[2])


class ReplacementTests(PoolTestCase):
    def test_seat_not_offered_until_replacement_ready(self) -> None:
        pool = self.make_pool(Config(num_workers=1))
        seat = self.successResultOf(pool.acquire(10))
        old = seat.worker
        waiter = pool.acquire(100)
        self.auto_ready = False
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
        pool = self.make_pool(Config(num_workers=2))
        seat = self.successResultOf(pool.acquire(10))
        self.auto_ready = False
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
        pool = self.make_pool(Config(num_workers=3))
        seat = self.successResultOf(pool.acquire(10))
        self.auto_ready = False
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

    def test_request_limit_grace_kill(self) -> None:
        pool = self.make_pool(Config(num_workers=1))
        seat = self.successResultOf(pool.acquire(10))
        old = seat.worker
        pool.release(seat, retire="request_limit")
        self.assertFalse(old.killed_now)  # type: ignore[union-attr]
        self.reactor.advance(5.0)
        # One grace in all (issue 17, item 10): SIGKILL, not a SIGTERM and
        # a second grace.
        self.assertTrue(old.killed_now)  # type: ignore[union-attr]
        self.assertFalse(old.killed)  # type: ignore[union-attr]
        self.assertEqual(seat.generation, 2)
        self.assertEqual(seat.status, "idle")

    def test_idle_worker_death_replaced(self) -> None:
        pool = self.make_pool(Config(num_workers=1))
        seat = pool.seats[0]
        self.auto_ready = False
        seat.worker.exit(1)  # type: ignore[union-attr]
        self.assertEqual(pool.capacity, 0)
        self.failureResultOf(pool.acquire(0), PoolBusy)
        self.spawned[-1].come_up()
        self.assertEqual(seat.generation, 2)
        self.assertIs(self.successResultOf(pool.acquire(0)), seat)

    def test_reuse_clears_workspace(self) -> None:
        pool = self.make_pool(Config(num_workers=1, max_requests_per_worker=0))
        seat = self.successResultOf(pool.acquire(10))
        pool.release(seat)
        self.assertEqual(self.sandbox.cleared, [seat.work_dir])
        self.assertEqual(seat.generation, 1)
        self.assertEqual(seat.status, "idle")

    def test_replacement_failure_marks_dead_then_revived(self) -> None:
        pool = self.make_pool(Config(num_workers=1))
        seat = self.successResultOf(pool.acquire(10))
        self.auto_ready = False
        pool.release(seat, retire="crashed")
        failing = self.spawned[-1]
        failing.alive = False
        failing.ready.errback(RuntimeError("no"))
        # The dead seat is revived before anyone gets it.
        self.assertEqual(seat.generation, 3)
        self.spawned[-1].come_up()
        self.assertIs(self.successResultOf(pool.acquire(0)), seat)


class ReuseScopeTests(PoolTestCase):
    """
    A reused worker runs the next program in the same interpreter, so it only
    serves requests of the client it first served, unless the operator
    chose C{--reuse-scope any} (issue 13, item 2).
    """

    def reuse_pool(self, num_workers: int = 1, scope: str = "address") -> WorkerPool:
        return self.make_pool(
            Config(num_workers=num_workers, max_requests_per_worker=0, reuse_scope=scope)
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
        self.auto_ready = False
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
        self.auto_ready = False
        d = pool.acquire(10, "10.0.0.2")
        failing = self.spawned[-1]
        failing.alive = False
        failing.ready.errback(RuntimeError("no"))
        self.failureResultOf(d, PoolBusy)
        self.assertEqual(pool.active, 0)


class StopTests(PoolTestCase):
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
        pool = self.make_pool(Config(num_workers=1))
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
            Config(device="gpu", gpus=(0, 1)),
            self.reactor,
            None,
            FakeSandbox(),
            lambda f, *a, **k: maybeDeferred(f, *a, **k),
            Path("/nonexistent-kcoral-root"),
        )
        pool.spawn_worker = spawn  # type: ignore[assignment]
        failure = self.failureResultOf(Deferred.fromCoroutine(pool.start()), RuntimeError)
        self.assertTrue(str(failure.value).startswith("a pool serves one target"))
