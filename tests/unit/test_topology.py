"""
Tests for L{kcoral.server.topology}: which front end a process is, what it
gets, and the children each role adds to the root service; and for
L{kcoral.server.frontend_main}'s SPEC, which carries that place.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from twisted.internet.defer import ensureDeferred
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase

from kcoral.config import ServerConfig
from kcoral.server.frontend_main import read_spec
from kcoral.server.frontends import FrontEndsService
from kcoral.server.leases.broker import RemoteArbiter
from kcoral.server.leases.lease import LeaseArbiter
from kcoral.server.service import makeService
from kcoral.server.topology import FrontEnd, HealthReports, Topology, share_of
from kcoral.testing.fakes import ProcessReactor

BROKER = Path("/run/kcoral/broker.sock")


def _config(**fields: Any) -> ServerConfig:
    values: dict[str, Any] = {
        "device": "cpu",
        "num_workers": 4,
        "log_dir": None,
        "disk_cache_dir": None,
    }
    values.update(fields)
    return ServerConfig(**values)


class FrontEndTests(SynchronousTestCase):
    def test_default_is_the_first(self) -> None:
        """By default a process is the first front end, with no broker."""
        self.assertEqual(FrontEnd(), FrontEnd(index=0, broker=None))
        self.assertTrue(FrontEnd().first)
        self.assertFalse(FrontEnd(index=1, broker=BROKER).first)

    def test_broker_goes_with_the_others(self) -> None:
        """Only a front end other than the first has (and needs) a broker."""
        with self.assertRaisesRegex(ValueError, "needs the broker"):
            FrontEnd(index=1)
        with self.assertRaisesRegex(ValueError, "needs the broker"):
            FrontEnd(index=0, broker=BROKER)
        with self.assertRaisesRegex(ValueError, "non-negative"):
            FrontEnd(index=-1, broker=BROKER)
        self.assertEqual(FrontEnd(index=2, broker=str(BROKER)).broker, BROKER)

    def test_index_within_the_server(self) -> None:
        """A front end beyond the configured number does not exist."""
        with self.assertRaisesRegex(ValueError, "front end 2 does not exist"):
            Topology(_config(front_ends=2), FrontEnd(index=2, broker=BROKER))


class ShareTests(SynchronousTestCase):
    def test_caps_and_logs(self) -> None:
        """Caps are split (rounded up; 0 stays 0); the others log apart."""
        config = _config(
            front_ends=3,
            log_dir=Path("/srv/logs"),
            cache_capacity_bytes=1000,
            max_bytes_in_flight=10,
            max_connections=0,
            max_queued_requests=7,
        )
        first = share_of(config, 0)
        third = share_of(config, 2)
        self.assertEqual(first.log_dir, Path("/srv/logs"))
        self.assertEqual(third.log_dir, Path("/srv/logs/front-end-2"))
        self.assertEqual(
            (
                third.cache_capacity_bytes,
                third.max_bytes_in_flight,
                third.max_connections,
                third.max_queued_requests,
            ),
            (334, 4, 0, 3),
        )
        self.assertEqual(third.worker_ids(2), ["cpu/w2"])

    def test_roles(self) -> None:
        """Alone: the whole config; first or other of several: their share."""
        alone = Topology(_config(cache_capacity_bytes=1000))
        self.assertEqual(alone.role, "alone")
        self.assertIs(alone.config, alone.whole)
        first = Topology(_config(front_ends=2, cache_capacity_bytes=1000))
        self.assertEqual((first.role, first.config.cache_capacity_bytes), ("first", 500))
        other = Topology(_config(front_ends=2), FrontEnd(index=1, broker=BROKER))
        self.assertEqual(other.role, "other")
        self.assertTrue(first.speaks_for_the_server)
        self.assertFalse(other.speaks_for_the_server)

    def test_leases(self) -> None:
        """The others ask the first's arbiter through the broker."""
        reactor = MemoryReactorClock()
        first = Topology(_config(front_ends=2))
        other = Topology(_config(front_ends=2), FrontEnd(index=1, broker=BROKER))
        self.assertIsInstance(first.leases((), reactor), LeaseArbiter)
        self.assertIsInstance(other.leases((), reactor), RemoteArbiter)


class ChildrenTests(SynchronousTestCase):
    """The root service's children, by role."""

    def names(self, config: ServerConfig, front_end: FrontEnd | None = None) -> list[str]:
        root = makeService(
            config,
            "tcp:port=0:interface=127.0.0.1",
            reactor=MemoryReactorClock(),
            front_end=front_end,
        )
        return [child.name for child in root]

    def test_alone(self) -> None:
        self.assertEqual(
            self.names(_config()), ["threads", "logs", "caches", "linger", "workers", "http"]
        )

    def test_first(self) -> None:
        """The first starts the others and reports its health, after it listens."""
        self.assertEqual(
            self.names(_config(front_ends=2)),
            [
                "threads",
                "logs",
                "caches",
                "linger",
                "workers",
                "http",
                "front-ends",
                "health-reports",
            ],
        )

    def test_other(self) -> None:
        """Another connects to the broker before anything else."""
        self.assertEqual(
            self.names(_config(front_ends=2), FrontEnd(index=1, broker=BROKER)),
            ["threads", "broker", "logs", "caches", "linger", "workers", "http", "health-reports"],
        )

    def test_other_has_its_share(self) -> None:
        """Its pool has its seats and its API reports its index."""
        root = makeService(
            _config(front_ends=2),
            "tcp:port=0:interface=127.0.0.1",
            reactor=MemoryReactorClock(),
            front_end=FrontEnd(index=1, broker=BROKER),
        )
        self.assertEqual([seat.worker_id for seat in root.pool.seats], ["cpu/w1", "cpu/w3"])
        self.assertEqual(root.api.local_health()["front_end"], {"index": 1, "of": 2})
        self.assertEqual(root.config.max_queued_requests, 512)


class SpecTests(SynchronousTestCase):
    def test_the_first_hands_the_place_down(self) -> None:
        """
        The SPEC the first writes for front end 1 starts
        C{kcoral.server.frontend_main} and reads back as the whole config,
        its place and the endpoints.
        """
        config = _config(front_ends=2, cache_capacity_bytes=1000)
        reactor = ProcessReactor()
        front_ends = FrontEndsService(reactor, config, ["tcp:port=8000"], LeaseArbiter((), reactor))
        front_ends.start()
        self.addCleanup(lambda: self.successResultOf(ensureDeferred(front_ends.stop(0))))
        [spawned] = reactor.spawned
        self.assertEqual(spawned["args"][1:3], ["-m", "kcoral.server.frontend_main"])
        spec = Path(spawned["args"][3])
        whole, place, endpoints = read_spec(spec)
        self.assertEqual(whole, config)
        self.assertEqual(place, FrontEnd(index=1, broker=front_ends.broker_path))
        self.assertEqual(endpoints, ["tcp:port=8000"])
        self.assertNotIn("front_end_index", json.loads(spec.read_text())["config"])
        # The process ends at SIGTERM; the test ends it here.
        spawned["protocol"].processEnded(SimpleNamespace(value=SimpleNamespace(exitCode=0)))


class HealthReportsTests(SynchronousTestCase):
    """
    L{HealthReports}: every second, this front end's health with its packed
    metrics; metrics too large for one AMP value are left out (once said),
    never the health.
    """

    def make(self, samples: int) -> tuple[list[tuple[int, dict[str, Any]]], Any, list[Any]]:
        from twisted.internet.task import Clock
        from twisted.logger import globalLogPublisher

        from kcoral.server.observe.metrics import Metrics

        metrics = Metrics()
        for i in range(samples):
            metrics.worker_replacements.labels(f"reason-{i:05d}-{'x' * 40}").inc()
        api = SimpleNamespace(local_health=lambda: {"front_end": {"index": 1}}, metrics=metrics)
        sent: list[tuple[int, dict[str, Any]]] = []
        events: list[Any] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        clock = Clock()
        reports = HealthReports(clock, api, 1, lambda i, h: sent.append((i, h)))  # type: ignore[arg-type]
        self.successResultOf(ensureDeferred(reports.start()))
        self.addCleanup(lambda: self.successResultOf(ensureDeferred(reports.stop())))
        return sent, clock, events

    def test_metrics_travel_with_the_health(self) -> None:
        from kcoral.server.observe.metrics import METRICS_REPORT_KEY, unpack_families

        sent, clock, _ = self.make(3)
        clock.advance(1.0)
        self.assertEqual([i for i, _ in sent], [1, 1])
        names = {f["name"] for f in unpack_families(sent[-1][1][METRICS_REPORT_KEY])}
        self.assertIn("kcoral_worker_replacements", names)

    def test_too_large_metrics_left_out(self) -> None:
        from kcoral.server.observe.metrics import METRICS_REPORT_KEY

        sent, clock, events = self.make(20_000)
        clock.advance(1.0)
        self.assertEqual(len(sent), 2)
        self.assertTrue(all(METRICS_REPORT_KEY not in health for _, health in sent))
        self.assertEqual(sent[0][1]["front_end"], {"index": 1})
        said = [e for e in events if "too large to report" in e.get("log_format", "")]
        self.assertEqual(len(said), 1)
