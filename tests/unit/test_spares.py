"""
Tests for L{kcoral.server.workers.spares.WarmSpares} and
L{kcoral.server.workers.backoff.Backoff}, on a L{task.Clock} with fake
workers and directories.
"""

from __future__ import annotations

from pathlib import Path

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from kcoral.server.workers.backoff import Backoff
from kcoral.server.workers.spares import WarmSpares
from kcoral.testing.fakes import FakeWorker


class BackoffTests(SynchronousTestCase):
    def test_doubles_up_to_the_maximum(self) -> None:
        backoff = Backoff(0.5, 3.0)
        self.assertEqual([backoff.delay(n) for n in range(1, 6)], [0.5, 1.0, 2.0, 3.0, 3.0])


class WarmSparesTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.started: list[tuple[str, tuple[int, ...], Path, FakeWorker]] = []
        self.removed: list[Path] = []
        self.auto_ready = True
        self.spawn_error: Exception | None = None

    def spawn(self, name: str, gpus: tuple[int, ...], work_dir: Path) -> FakeWorker:
        if self.spawn_error is not None:
            raise self.spawn_error
        worker = FakeWorker(name, 0, gpus)
        self.started.append((name, gpus, work_dir, worker))
        if self.auto_ready:
            worker.come_up()
        return worker

    def remove(self, paths: list[Path]) -> Deferred[None]:
        self.removed.extend(paths)
        return succeed(None)

    def make(self, wanted: int = 2, **kw: int) -> WarmSpares:
        return WarmSpares(
            self.clock,
            wanted,
            lambda name: Path("/root") / name.replace("/", "-"),
            lambda directory: succeed(directory / "work"),
            self.spawn,
            self.remove,
            backoff=Backoff(1.0, 4.0),
            **kw,
        )

    def test_fill(self) -> None:
        """A group gets as many ready spares as wanted, named in order."""
        warm = self.make()
        warm.fill(None)
        warm.fill(0)
        self.assertEqual(
            [(s.spare_id, s.gpus, s.status) for s in warm.spares],
            [
                ("cpu/s1", (), "ready"),
                ("cpu/s2", (), "ready"),
                ("gpu0/s3", (0,), "ready"),
                ("gpu0/s4", (0,), "ready"),
            ],
        )
        self.assertEqual(self.started[0][2], Path("/root/cpu-s1/work"))
        warm.fill(None)
        self.assertEqual(len(self.started), 4)
        self.assertEqual(warm.pending, set())

    def test_front_ends_number_apart(self) -> None:
        """With several front ends each numbers its spares apart."""
        warm = self.make(front_ends=2, front_end_index=1)
        warm.fill(None)
        self.assertEqual([s.spare_id for s in warm.spares], ["cpu/s2", "cpu/s4"])

    def test_take_ready_longest(self) -> None:
        """A taker gets the spare ready longest; starting ones are not handed over."""
        self.auto_ready = False
        warm = self.make(wanted=3)
        warm.fill(None)
        workers = [worker for *_, worker in self.started]
        self.assertIsNone(warm.take(None))
        workers[1].come_up()
        self.clock.advance(1)
        workers[0].come_up()
        spare = warm.take(None)
        assert spare is not None
        self.assertIs(spare.worker, workers[1])
        self.assertNotIn(spare, warm.spares)
        self.assertEqual(len(warm.spares), 2)
        self.assertIsNone(warm.take(0))
        warm.fill(None)
        self.assertEqual(len(warm.spares), 3)

    def test_failed_start_backs_off(self) -> None:
        """A group whose spare fails to start waits, doubling, before the next try."""
        self.spawn_error = RuntimeError("no sandbox")
        warm = self.make(wanted=1)
        warm.fill(None)
        self.assertEqual(warm.spares, [])
        self.assertEqual(self.removed, [Path("/root/cpu-s1")])
        warm.fill(None)  # held back while the retry is pending
        self.assertEqual(len(self.clock.getDelayedCalls()), 1)
        self.clock.advance(1.0)
        self.assertEqual(len(self.removed), 2)
        self.clock.advance(1.9)
        self.assertEqual(len(self.removed), 2)  # the wait doubled
        self.clock.advance(0.1)
        self.assertEqual(len(self.removed), 3)
        self.spawn_error = None
        self.clock.advance(4.0)
        self.assertEqual([s.status for s in warm.spares], ["ready"])
        # One that starts resets the count: the next failure waits 1 s again.
        self.spawn_error = RuntimeError("again")
        warm.spares[0].worker.exit(1)  # type: ignore[union-attr]
        self.assertEqual(warm.spares, [])
        [retry] = self.clock.getDelayedCalls()
        self.assertEqual(retry.getTime() - self.clock.seconds(), 1.0)

    def test_ready_spare_death_replaced(self) -> None:
        """A ready spare that dies is dropped, its directory removed, another started."""
        warm = self.make(wanted=1)
        warm.fill(None)
        first = self.started[0][3]
        first.exit(1)
        self.assertEqual(self.removed, [Path("/root/cpu-s1")])
        self.assertEqual([s.spare_id for s in warm.spares], ["cpu/s2"])

    def test_death_after_take_ignored(self) -> None:
        """A spare's worker that dies once taken is no longer the spares' business."""
        warm = self.make(wanted=1)
        warm.fill(None)
        spare = warm.take(None)
        assert spare is not None and isinstance(spare.worker, FakeWorker)
        spare.worker.exit(1)
        self.assertEqual((warm.spares, self.removed), ([], []))

    def test_close_cancels_retry(self) -> None:
        """Closing stops pending retries and any further start."""
        self.spawn_error = RuntimeError("no sandbox")
        warm = self.make(wanted=1)
        warm.fill(None)
        warm.close()
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.spawn_error = None
        warm.fill(None)
        self.assertEqual(warm.spares, [])
        self.assertIsNone(warm.take(None))

    def test_closing_while_preparing(self) -> None:
        """A spare whose directory is ready only after closing never starts."""
        prepared: Deferred[Path] = Deferred()
        warm = WarmSpares(
            self.clock,
            1,
            lambda name: Path("/root/s"),
            lambda directory: prepared,
            self.spawn,
            self.remove,
        )
        warm.fill(None)
        warm.close()
        prepared.callback(Path("/root/s/work"))
        self.assertEqual((self.started, warm.spares), ([], []))
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_stop(self) -> None:
        """A ready spare is asked to exit, a starting one is killed at once."""
        warm = self.make(wanted=1)
        warm.fill(None)
        self.auto_ready = False
        warm.fill(0)
        ready, starting = (worker for *_, worker in self.started)
        warm.close()
        ends, dirs = warm.stop()
        self.assertTrue(ready.stopped)
        self.assertTrue(starting.killed_now)
        self.assertEqual(len(ends), 2)
        self.assertEqual(dirs, [Path("/root/cpu-s1"), Path("/root/gpu0-s2")])
        # The starting one is gone already; the ready one is the pool's to forget.
        self.assertEqual(warm.workers(), [ready])
        warm.forget()
        self.assertEqual((warm.spares, warm.workers()), ([], []))

    def test_status(self) -> None:
        warm = self.make(wanted=1)
        warm.fill(None)
        self.clock.advance(2.5)
        self.assertEqual(
            warm.status(self.clock.seconds()),
            [
                {
                    "spare_id": "cpu/s1",
                    "gpu_id": None,
                    "state": "ready",
                    "pid": 1000,
                    "uptime_seconds": 2.5,
                }
            ],
        )
