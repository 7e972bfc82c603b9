"""
Tests for L{kcoral.server.frontends}: what each front end gets, and the
shared port.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from twisted.internet.defer import ensureDeferred
from twisted.internet.protocol import Factory, Protocol
from twisted.trial.unittest import SynchronousTestCase

from kcoral.config import ServerConfig
from kcoral.server.frontends import listen_reusing_port, merge_health, share_of


class ShareTests(SynchronousTestCase):
    def test_caps_logs_and_broker(self) -> None:
        config = ServerConfig(
            device="cpu",
            num_workers=4,
            front_ends=3,
            log_dir=Path("/srv/logs"),
            cache_capacity_bytes=1000,
            max_bytes_in_flight=10,
            max_connections=0,
            max_queued_requests=7,
        )
        first = share_of(config, 0, None)
        third = share_of(config, 2, Path("/run/broker.sock"))
        self.assertEqual(first.log_dir, Path("/srv/logs"))
        self.assertEqual(third.log_dir, Path("/srv/logs/front-end-2"))
        self.assertEqual((third.front_end_index, third.lease_broker), (2, Path("/run/broker.sock")))
        # Caps are split (rounded up); 0 (no cap) stays 0.
        self.assertEqual(
            (
                third.cache_capacity_bytes,
                third.max_bytes_in_flight,
                third.max_connections,
                third.max_queued_requests,
            ),
            (334, 4, 0, 3),
        )
        self.assertEqual(third.worker_ids(), ["cpu/w2"])


class _Reactor:
    """Enough of a reactor for L{listen_reusing_port}: what it adopts."""

    def __init__(self) -> None:
        self.adopted: list[tuple[int, int]] = []

    def adoptStreamPort(self, fd: int, family: int, factory: object) -> object:  # noqa: N802
        # The reactor keeps a duplicate, as Twisted's does.
        self.adopted.append((os.dup(fd), family))
        return object()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class ReusePortTests(SynchronousTestCase):
    def test_every_front_end_binds_the_port(self) -> None:
        reactor = _Reactor()
        port = _free_port()
        factory = Factory.forProtocol(Protocol)
        description = f"tcp:port={port}:interface=127.0.0.1:backlog=64"
        listen_reusing_port(reactor, description, factory, first=True)
        listen_reusing_port(reactor, description, factory, first=False)
        self.assertEqual(len(reactor.adopted), 2)
        for fd, family in reactor.adopted:
            self.assertEqual(family, socket.AF_INET)
            bound = socket.socket(fileno=fd)
            self.assertEqual(bound.getsockname(), ("127.0.0.1", port))
            bound.close()

    def test_the_first_refuses_a_taken_port(self) -> None:
        """A port someone else holds, even with SO_REUSEPORT set, is not shared."""
        port = _free_port()
        other = socket.socket()
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", port))
        other.listen(1)
        self.addCleanup(other.close)
        with self.assertRaises(OSError):
            listen_reusing_port(_Reactor(), f"tcp:port={port}:interface=127.0.0.1", Factory(), True)

    def test_only_tcp(self) -> None:
        with self.assertRaisesRegex(ValueError, "plain TCP"):
            listen_reusing_port(_Reactor(), "ssl:8443:privateKey=k.pem", Factory(), True)


def _health(index: int, workers: list[str], ready: int, active: int) -> dict[str, Any]:
    return {
        "status": "ok",
        "load": {
            "request_capacity": len(workers),
            "requests_in_progress": active,
            "requests_waiting": 0,
        },
        "active_requests": active,
        "queue_length": 0,
        "workers": [{"worker_id": w} for w in workers],
        "spares": [],
        "gpus": [{"gpu_id": 0, "lease_depth": 1, "holder": "gpu0/w1", "spares_ready": ready}],
        "front_end": {"index": index, "of": 2},
    }


class MergeHealthTests(SynchronousTestCase):
    def test_the_whole_server(self) -> None:
        own = _health(1, ["gpu0/w1", "gpu0/w3"], ready=1, active=1)
        peers = {0: _health(0, ["gpu0/w0", "gpu0/w2"], ready=2, active=0), 1: {"stale": True}}
        merged = merge_health(own, peers, 1)
        self.assertEqual(
            merged["load"],
            {"request_capacity": 4, "requests_in_progress": 1, "requests_waiting": 0},
        )
        self.assertEqual(
            [(w["worker_id"], w["front_end"]) for w in merged["workers"]],
            [("gpu0/w0", 0), ("gpu0/w2", 0), ("gpu0/w1", 1), ("gpu0/w3", 1)],
        )
        # The lease figures are this process's (the broker's); spares are summed.
        self.assertEqual(merged["gpus"][0]["holder"], "gpu0/w1")
        self.assertEqual(merged["gpus"][0]["spares_ready"], 3)
        self.assertEqual(merged["front_end"], {"index": 1, "of": 2, "reporting": [0, 1]})
        self.assertEqual(own["load"]["request_capacity"], 2)  # not changed in place


class SocketPlaceTests(SynchronousTestCase):
    def test_a_deep_temporary_directory_is_not_used(self) -> None:
        """A Unix socket path has a kernel limit: under a deep TMPDIR the broker uses /tmp."""
        import tempfile

        from kcoral.server import frontends

        self.patch(tempfile, "tempdir", "/tmp/" + "d" * 90)
        self.assertEqual(frontends._socket_parent(), "/tmp")
        self.patch(tempfile, "tempdir", "/var/tmp")
        self.assertEqual(frontends._socket_parent(), "/var/tmp")


class HealthReportsTests(SynchronousTestCase):
    """
    L{kcoral.server.service._HealthReports}: every second, this front end's
    health with its packed metrics; metrics too large for one AMP value are
    left out (once said), never the health.
    """

    def make(self, samples: int) -> tuple[list[tuple[int, dict[str, Any]]], Any, list[Any]]:
        from twisted.internet.task import Clock
        from twisted.logger import globalLogPublisher

        from kcoral.server.observe.metrics import Metrics
        from kcoral.server.service import _HealthReports

        metrics = Metrics()
        for i in range(samples):
            metrics.worker_replacements.labels(f"reason-{i:05d}-{'x' * 40}").inc()
        api = SimpleNamespace(
            config=SimpleNamespace(front_end_index=1),
            local_health=lambda: {"front_end": {"index": 1}},
            metrics=metrics,
        )
        sent: list[tuple[int, dict[str, Any]]] = []
        events: list[Any] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        clock = Clock()
        reports = _HealthReports(clock, api, lambda i, h: sent.append((i, h)))  # type: ignore[arg-type]
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
