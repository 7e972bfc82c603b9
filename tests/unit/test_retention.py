# -*- test-case-name: tests.unit.test_retention -*-
"""
Tests for L{kcoral.server.observe.retention}: pruning by age and total size on real
temporary directories, with file times set explicitly; the timer on a Clock.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.internet.testing import EventLoggingObserver
from twisted.logger import globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from kcoral.config import ServerConfig
from kcoral.server.observe.retention import (
    INTERVAL_SECONDS,
    PruneResult,
    RetentionPolicy,
    RetentionService,
    prune,
)

DAY = 86400.0
NOW = 1_800_000_000.0


class PruneTests(SynchronousTestCase):
    def setUp(self) -> None:
        tmp = tempfile.TemporaryDirectory(prefix="kcoral-retention-")
        self.addCleanup(tmp.cleanup)
        self.runs = Path(tmp.name) / "runs"
        self.runs.mkdir()

    def run_dir(self, name: str, size: int, age_days: float, programs: int = 0) -> Path:
        """A run directory holding C{size} bytes of events, last written C{age_days} ago."""
        path = self.runs / name
        (path / "programs").mkdir(parents=True)
        stamp = NOW - age_days * DAY
        (path / "events.jsonl").write_bytes(b"x" * size)
        os.utime(path / "events.jsonl", (stamp, stamp))
        for i in range(programs):
            program = path / "programs" / f"r{i}.json"
            program.write_bytes(b"p" * 100)
            # Older programs first.
            os.utime(program, (stamp - (programs - i), stamp - (programs - i)))
        for directory in (path / "programs", path):
            os.utime(directory, (stamp - programs - 1, stamp - programs - 1))
        return path

    def names(self) -> list[str]:
        return sorted(p.name for p in self.runs.iterdir())

    def test_age(self) -> None:
        """Runs last written before the age bound go; the current run stays."""
        self.run_dir("20260101T000000.000000Z", 10, age_days=40)
        self.run_dir("20260201T000000.000000Z", 10, age_days=20)
        current = self.run_dir("20260301T000000.000000Z", 10, age_days=50)
        result = prune(self.runs, current, RetentionPolicy(30 * DAY, 0), NOW)
        self.assertEqual(result.runs, ("20260101T000000.000000Z",))
        self.assertEqual(result.freed_bytes, 10)
        self.assertEqual(self.names(), ["20260201T000000.000000Z", "20260301T000000.000000Z"])

    def test_size(self) -> None:
        """The oldest runs go while the total is above the size bound."""
        for day, name in enumerate(["a", "b", "c"]):
            self.run_dir(f"2026010{day + 1}T000000.000000Z-{name}", 400, age_days=3 - day)
        current = self.run_dir("20260104T000000.000000Z", 400, age_days=0)
        result = prune(self.runs, current, RetentionPolicy(0, 1000), NOW)
        self.assertEqual(len(result.runs), 2)
        self.assertEqual(result.kept_bytes, 800)
        self.assertEqual(self.names(), ["20260103T000000.000000Z-c", "20260104T000000.000000Z"])

    def test_current_run_programs(self) -> None:
        """
        When the current run alone is too big, its oldest saved programs go,
        never its events file.
        """
        current = self.run_dir("20260104T000000.000000Z", 100, age_days=0, programs=5)
        result = prune(self.runs, current, RetentionPolicy(0, 350), NOW)
        self.assertEqual(result, PruneResult((), 3, 300, 300))
        self.assertEqual(
            sorted(p.name for p in (current / "programs").iterdir()), ["r3.json", "r4.json"]
        )
        self.assertTrue((current / "events.jsonl").exists())

    def test_disabled(self) -> None:
        """Both bounds at 0: nothing is deleted, nothing is even listed."""
        self.run_dir("20260101T000000.000000Z", 10, age_days=400)
        self.assertEqual(prune(self.runs, None, RetentionPolicy(0, 0), NOW), PruneResult())
        self.assertEqual(len(self.names()), 1)

    def test_missing_directory(self) -> None:
        """A runs directory that does not exist is not an error."""
        self.assertEqual(prune(self.runs / "absent", None, RetentionPolicy(), NOW), PruneResult())

    def test_from_config(self) -> None:
        """The policy reads the two ServerConfig fields."""
        policy = RetentionPolicy.from_config(
            ServerConfig(log_retention_days=2, log_retention_mbytes=3)
        )
        self.assertEqual(policy, RetentionPolicy(2 * DAY, 3 * 1024 * 1024))


class RetentionServiceTests(SynchronousTestCase):
    def test_runs_now_and_hourly(self) -> None:
        """
        The service prunes when it starts and every hour, and logs
        C{logs_pruned} only when something was deleted.
        """
        events = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)
        calls: list[tuple[Any, ...]] = []
        results = [PruneResult(("old",), 2, 123, 456), PruneResult()]

        def run_blocking(f: Any, *args: Any) -> Deferred[Any]:
            calls.append(args)
            return succeed(results[min(len(calls) - 1, 1)])

        clock = Clock()
        clock.advance(NOW)
        service = RetentionService(
            Path("runs"), Path("runs/current"), RetentionPolicy(), run_blocking, clock
        )
        service.startService()
        self.addCleanup(service.stopService)
        self.assertEqual(len(calls), 1)
        self.assertEqual(calls[0][3], NOW)
        clock.advance(INTERVAL_SECONDS)
        self.assertEqual(len(calls), 2)
        pruned = [e for e in events if e.get("kcoral_event") == "logs_pruned"]
        self.assertEqual(len(pruned), 1)
        self.assertEqual(pruned[0]["runs"], ["old"])
        self.assertEqual(pruned[0]["programs"], 2)
        self.assertEqual(service.last, PruneResult())
