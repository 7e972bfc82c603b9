"""
Tests for L{kcoral.server.observe.metrics}.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from twisted.logger import Logger, LogPublisher
from twisted.trial.unittest import SynchronousTestCase

from kcoral.server.http.refusals import REFUSALS
from kcoral.server.observe.metrics import Metrics, pack_families, unpack_families


def parsed(body: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """An exposition as C{{(sample name, sorted labels): value}}."""
    result = {}
    for family in text_string_to_metric_families(body.decode("utf-8")):
        for sample in family.samples:
            result[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return result


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Parse C{metrics.render()} (see L{parsed})."""
    return parsed(metrics.render()[0])


class MetricsTests(SynchronousTestCase):
    """
    Tests for L{Metrics} fed through a real L{Logger}.
    """

    def setUp(self) -> None:
        self.state: dict[str, Any] = {
            "queue_length": 3,
            "active_requests": 2,
            "request_capacity": 8,
            "cache_bytes": {"memory": 1024, "disk": 4096},
            "lease_depth": {0: 2, 1: 0},
            "spare_workers": {(0, "ready"): 3, (0, "starting"): 1},
        }
        self.metrics = Metrics(lambda: self.state)
        self.log = Logger(namespace="kcoral.test", observer=LogPublisher(self.metrics))

    def test_content_type(self) -> None:
        """
        C{render} returns bytes and the Prometheus text content type.
        """
        body, content_type = self.metrics.render()
        self.assertIsInstance(body, bytes)
        self.assertEqual(content_type, CONTENT_TYPE_LATEST)

    def test_no_created_series(self) -> None:
        """
        No C{*_created} sample is exported, in either format, though the
        counters and histograms are there.
        """
        self.log.info("x", kcoral_event="request_finished", finish_reason="completed")
        for accept in (None, "application/openmetrics-text; version=1.0.0"):
            body, _ = self.metrics.expose(accept=accept)
            self.assertIn(b"kcoral_requests_total", body)
            self.assertNotIn(b"_created", body)
        self.assertNotIn(b"_created", self.metrics.render()[0])
        self.assertFalse(
            [f for f in self.metrics.families() for s in f["samples"] if "_created" in s[0]]
        )

    def test_process_and_platform_collectors(self) -> None:
        """The standard process_* series and python_info describe the server process."""
        names = {name for name, _ in samples(self.metrics)}
        for name in (
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_open_fds",
            "process_start_time_seconds",
            "python_info",
        ):
            self.assertIn(name, names)

    def test_openmetrics_when_asked(self) -> None:
        """
        A scraper that accepts OpenMetrics gets it (its content type, the
        C{# EOF} end); any other C{Accept} gets the text format.
        """
        from prometheus_client.openmetrics.parser import (
            text_string_to_metric_families as openmetrics_families,
        )

        body, headers = self.metrics.expose(
            accept="application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
        )
        self.assertTrue(headers["Content-Type"].startswith("application/openmetrics-text"))
        self.assertTrue(body.endswith(b"# EOF\n"))
        names = {f.name for f in openmetrics_families(body.decode())}
        self.assertIn("kcoral_requests", names)
        for accept in (None, "*/*", "text/plain"):
            body, headers = self.metrics.expose(accept=accept)
            self.assertTrue(headers["Content-Type"].startswith("text/plain; version="))
            self.assertNotIn(b"# EOF", body)

    def test_gzip_when_accepted(self) -> None:
        """
        C{Accept-Encoding: gzip} gets the same exposition gzipped, marked
        C{Content-Encoding: gzip}; without it the body is plain.
        """
        import gzip

        body, headers = self.metrics.expose(accept_encoding="gzip, deflate")
        self.assertEqual(headers["Content-Encoding"], "gzip")
        plain, plain_headers = self.metrics.expose()
        self.assertNotIn("Content-Encoding", plain_headers)
        unzipped = gzip.decompress(body)
        self.assertEqual(
            {k for k in parsed(unzipped) if not k[0].startswith("process_")},
            {k for k in parsed(plain) if not k[0].startswith("process_")},
        )
        self.assertIn("Accept-Encoding", headers["Vary"])

    def test_requests_by_outcome(self) -> None:
        """
        C{request_finished} counts by C{finish_reason}; known outcomes start
        at zero.
        """
        for reason in ["completed", "completed", "timeout", "something_new"]:
            self.log.info(
                "done",
                kcoral_event="request_finished",
                request_id="r",
                http_status=200,
                finish_reason=reason,
            )
        found = samples(self.metrics)
        self.assertEqual(found[("kcoral_requests_total", (("outcome", "completed"),))], 2)
        self.assertEqual(found[("kcoral_requests_total", (("outcome", "timeout"),))], 1)
        self.assertEqual(found[("kcoral_requests_total", (("outcome", "something_new"),))], 1)
        self.assertEqual(found[("kcoral_requests_total", (("outcome", "crashed"),))], 0)

    def test_only_kcoral_events(self) -> None:
        """
        Plain events (even with matching field names) count nothing.
        """
        self.log.info("done", finish_reason="completed")
        found = samples(self.metrics)
        self.assertEqual(found[("kcoral_requests_total", (("outcome", "completed"),))], 0)

    def test_worker_replacements(self) -> None:
        """
        C{worker_retired} counts by C{reason}.
        """
        self.log.warn(
            "retired", kcoral_event="worker_retired", worker_id="gpu0/w1", reason="crashed"
        )
        self.log.info(
            "retired", kcoral_event="worker_retired", worker_id="gpu0/w1", reason="request_limit"
        )
        self.log.info(
            "retired", kcoral_event="worker_retired", worker_id="gpu0/w2", reason="request_limit"
        )
        found = samples(self.metrics)
        self.assertEqual(
            found[("kcoral_worker_replacements_total", (("reason", "request_limit"),))], 2
        )
        self.assertEqual(found[("kcoral_worker_replacements_total", (("reason", "crashed"),))], 1)

    def test_lease_histograms(self) -> None:
        """
        C{lease_wait_ms} and C{lease_held_ms} of C{request_finished} feed the
        histograms in seconds, labelled by GPU; events without a GPU or with
        missing values observe nothing.
        """
        self.log.info(
            "done",
            kcoral_event="request_finished",
            finish_reason="completed",
            gpu_id=0,
            lease_wait_ms=20.0,
            lease_held_ms=1500,
        )
        self.log.info(
            "done",
            kcoral_event="request_finished",
            finish_reason="completed",
            gpu_id=1,
            lease_wait_ms=None,
            lease_held_ms=None,
        )
        self.log.info(
            "done",
            kcoral_event="request_finished",
            finish_reason="completed",
            gpu_id=None,
            lease_wait_ms=5.0,
            lease_held_ms=5.0,
        )
        found = samples(self.metrics)
        gpu0 = (("gpu", "0"),)
        self.assertEqual(found[("kcoral_lease_wait_seconds_count", gpu0)], 1)
        self.assertAlmostEqual(found[("kcoral_lease_wait_seconds_sum", gpu0)], 0.02)
        self.assertEqual(found[("kcoral_lease_held_seconds_count", gpu0)], 1)
        self.assertAlmostEqual(found[("kcoral_lease_held_seconds_sum", gpu0)], 1.5)
        self.assertEqual(
            found[("kcoral_lease_wait_seconds_bucket", (("gpu", "0"), ("le", "0.025")))], 1
        )
        self.assertEqual(
            found[("kcoral_lease_wait_seconds_bucket", (("gpu", "0"), ("le", "0.01")))], 0
        )
        self.assertNotIn(("kcoral_lease_wait_seconds_count", (("gpu", "1"),)), found)
        self.assertNotIn(("kcoral_lease_wait_seconds_count", (("gpu", "None"),)), found)

    def test_cache_counters(self) -> None:
        """
        C{cache_hit}, C{cache_miss} and C{cache_evicted} count per cache,
        by C{count} when given.
        """
        self.log.debug("hit", kcoral_event="cache_hit", cache="memory")
        self.log.debug("hit", kcoral_event="cache_hit", cache="memory")
        self.log.debug("miss", kcoral_event="cache_miss", cache="disk")
        self.log.debug("evicted", kcoral_event="cache_evicted", cache="disk", count=3)
        found = samples(self.metrics)
        self.assertEqual(found[("kcoral_cache_hits_total", (("cache", "memory"),))], 2)
        self.assertEqual(found[("kcoral_cache_hits_total", (("cache", "disk"),))], 0)
        self.assertEqual(found[("kcoral_cache_misses_total", (("cache", "disk"),))], 1)
        self.assertEqual(found[("kcoral_cache_evictions_total", (("cache", "disk"),))], 3)
        self.assertEqual(found[("kcoral_cache_evictions_total", (("cache", "memory"),))], 0)

    def test_state_gauges(self) -> None:
        """
        Gauges come from C{state()} at each scrape.
        """
        found = samples(self.metrics)
        self.assertEqual(found[("kcoral_queue_length", ())], 3)
        self.assertEqual(found[("kcoral_active_requests", ())], 2)
        self.assertEqual(found[("kcoral_request_capacity", ())], 8)
        self.assertEqual(found[("kcoral_cache_bytes", (("cache", "memory"),))], 1024)
        self.assertEqual(found[("kcoral_cache_bytes", (("cache", "disk"),))], 4096)
        self.assertEqual(found[("kcoral_lease_depth", (("gpu", "0"),))], 2)
        self.assertEqual(found[("kcoral_lease_depth", (("gpu", "1"),))], 0)
        spares = (("gpu", "0"), ("state", "ready"))
        self.assertEqual(found[("kcoral_spare_workers", spares)], 3)
        self.state["queue_length"] = 0
        self.state["lease_depth"] = {0: 1}
        found = samples(self.metrics)
        self.assertEqual(found[("kcoral_queue_length", ())], 0)
        self.assertEqual(found[("kcoral_lease_depth", (("gpu", "0"),))], 1)
        self.assertNotIn(("kcoral_lease_depth", (("gpu", "1"),)), found)

    def test_state_not_called_at_construction(self) -> None:
        """
        C{state()} is only called when scraping, not when the collector is
        registered.
        """
        calls: list[None] = []
        metrics = Metrics(lambda: calls.append(None) or {})
        self.assertEqual(calls, [])
        metrics.render()
        self.assertEqual(calls, [None])

    def test_state_failure(self) -> None:
        """
        A failing C{state()} leaves the gauges out (and is logged) but the
        counters are still served.
        """

        def broken() -> dict[str, Any]:
            raise RuntimeError("pool gone")

        found = samples(Metrics(broken))
        self.assertNotIn(("kcoral_queue_length", ()), found)
        self.assertIn(("kcoral_requests_total", (("outcome", "completed"),)), found)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    def test_no_state(self) -> None:
        """
        Without C{state}, only the event counters are exported.
        """
        found = samples(Metrics())
        self.assertNotIn(("kcoral_queue_length", ()), found)
        self.assertIn(("kcoral_requests_total", (("outcome", "completed"),)), found)

    def test_private_registries(self) -> None:
        """
        Two instances do not share counters.
        """
        other = Metrics()
        self.log.info("done", kcoral_event="request_finished", finish_reason="completed")
        self.assertEqual(samples(other)[("kcoral_requests_total", (("outcome", "completed"),))], 0)

    def test_malformed_event(self) -> None:
        """
        Odd field values never raise out of the observer.
        """
        self.metrics(
            {
                "kcoral_event": "request_finished",
                "finish_reason": None,
                "gpu_id": 0,
                "lease_wait_ms": "soon",
                "lease_held_ms": float("nan"),
            }
        )
        self.metrics({"kcoral_event": "cache_hit", "cache": "memory", "count": -1})
        found = samples(self.metrics)
        self.assertEqual(found[("kcoral_requests_total", (("outcome", "unknown"),))], 1)
        self.assertEqual(found[("kcoral_cache_hits_total", (("cache", "memory"),))], 0)


class RequestDurationAndBuildInfoTests(SynchronousTestCase):
    """
    C{kcoral_request_duration_seconds} and C{kcoral_build_info}.
    """

    def setUp(self) -> None:
        self.metrics = Metrics()

    def event(self, name: str, request_id: str, at: float, **fields: Any) -> None:
        self.metrics({"kcoral_event": name, "request_id": request_id, "log_time": at, **fields})

    def test_duration_from_received_to_finished(self) -> None:
        """
        A request's duration runs from its C{request_received} to its
        C{request_finished}, labelled by outcome.
        """
        self.event("request_received", "a", 100.0)
        self.event("request_received", "b", 100.5)
        self.event("request_finished", "b", 100.6, finish_reason="cache_miss")
        self.event("request_finished", "a", 102.0, finish_reason="completed")
        result = samples(self.metrics)
        completed = (("outcome", "completed"),)
        self.assertEqual(result[("kcoral_request_duration_seconds_count", completed)], 1.0)
        self.assertEqual(result[("kcoral_request_duration_seconds_sum", completed)], 2.0)
        self.assertEqual(
            result[("kcoral_request_duration_seconds_bucket", (("le", "2.5"), *completed))], 1.0
        )
        self.assertEqual(
            result[("kcoral_request_duration_seconds_bucket", (("le", "1.0"), *completed))], 0.0
        )
        miss = (("outcome", "cache_miss"),)
        self.assertAlmostEqual(result[("kcoral_request_duration_seconds_sum", miss)], 0.1)

    def test_finished_without_received(self) -> None:
        """A finish whose start was never seen counts, but has no duration."""
        self.event("request_finished", "x", 5.0, finish_reason="completed")
        result = samples(self.metrics)
        self.assertEqual(result[("kcoral_requests_total", (("outcome", "completed"),))], 1.0)
        self.assertNotIn(
            ("kcoral_request_duration_seconds_count", (("outcome", "completed"),)), result
        )

    def test_open_requests_bounded(self) -> None:
        """Requests that never finish are forgotten beyond a bound."""
        from kcoral.server.observe import metrics

        self.patch(metrics, "MAX_OPEN_REQUESTS", 3)
        for i in range(5):
            self.event("request_received", f"r{i}", float(i))
        self.assertEqual(list(self.metrics._received), ["r2", "r3", "r4"])

    def test_build_info(self) -> None:
        """C{kcoral_build_info} is 1, labelled with the running versions."""
        import platform

        [(labels, value)] = [
            (dict(labels), value)
            for (name, labels), value in samples(self.metrics).items()
            if name == "kcoral_build_info"
        ]
        self.assertEqual(value, 1.0)
        self.assertEqual(labels["python"], platform.python_version())
        self.assertEqual(set(labels), {"version", "python", "twisted"})


class FrontEndsTests(SynchronousTestCase):
    """
    With several front ends, whichever answers C{/metrics} renders every
    front end's series, each labelled with its C{front_end}.
    """

    def make(self, completed: int) -> Metrics:
        metrics = Metrics(lambda: {"queue_length": completed, "lease_depth": {0: 1}})
        log = Logger(namespace="kcoral.test", observer=LogPublisher(metrics))
        for _ in range(completed):
            log.info("done", kcoral_event="request_finished", finish_reason="completed")
        return metrics

    def test_pack_round_trip(self) -> None:
        metrics = self.make(2)
        families = metrics.families()
        self.assertEqual(unpack_families(pack_families(families)), families)
        # Compact enough for a report every second (an AMP value is at most 64 KiB).
        self.assertLess(len(pack_families(families)), 8000)

    def test_every_front_end_labelled(self) -> None:
        own, second, third = self.make(2), self.make(5), self.make(0)
        peers = {1: second.families(), 2: third.families()}
        body, content_type = own.render(peers, index=0)
        self.assertEqual(content_type, CONTENT_TYPE_LATEST)
        found = parsed(body)
        completed = {
            dict(labels)["front_end"]: value
            for (name, labels), value in found.items()
            if name == "kcoral_requests_total" and dict(labels)["outcome"] == "completed"
        }
        self.assertEqual(completed, {"0": 2.0, "1": 5.0, "2": 0.0})
        self.assertEqual(found[("kcoral_queue_length", (("front_end", "1"),))], 5.0)
        # One HELP and TYPE per family, however many front ends.
        text = body.decode()
        self.assertEqual(text.count("# TYPE kcoral_requests_total counter"), 1)
        self.assertEqual(text.count("# HELP kcoral_lease_depth "), 1)
        build = [labels for (name, labels), _ in found.items() if name == "kcoral_build_info"]
        self.assertEqual(sorted(dict(labels)["front_end"] for labels in build), ["0", "1", "2"])

    def test_alone_unlabelled(self) -> None:
        """One front end: the exposition is what it always was."""
        metrics = self.make(1)
        self.assertNotIn(b"front_end", metrics.render()[0])
        alone, first = metrics.render(), metrics.render(None, index=0)
        self.assertEqual(alone[1:], first[1:])
        self.assertEqual(_without_process(alone[0]), _without_process(first[0]))


def _without_process(exposition: bytes) -> list[bytes]:
    """
    The exposition's lines less the process collector's, whose CPU seconds
    and memory move between two renders.
    """
    return [line for line in exposition.splitlines() if b"process_" not in line]


class MissingPrometheusTests(SynchronousTestCase):
    """
    Without prometheus_client /metrics cannot work; the server says so at
    start-up instead of dropping it silently (issue 17, item 8).
    """

    def make_server(self) -> Any:
        from twisted.internet.testing import MemoryReactorClock

        from kcoral.config import ServerConfig
        from kcoral.server.service import KCoralService

        return KCoralService(
            ServerConfig(device="cpu", disk_cache_dir=None), reactor=MemoryReactorClock()
        )

    def hide_metrics_module(self) -> None:
        import sys

        # A module set to None in sys.modules fails to import.
        saved = sys.modules.get("kcoral.server.observe.metrics")
        sys.modules["kcoral.server.observe.metrics"] = None  # type: ignore[assignment]

        def restore() -> None:
            if saved is None:
                sys.modules.pop("kcoral.server.observe.metrics", None)
            else:
                sys.modules["kcoral.server.observe.metrics"] = saved

        self.addCleanup(restore)

    def test_metrics_unavailable(self) -> None:
        self.hide_metrics_module()
        server = self.make_server()
        self.assertIsNone(server.metrics)
        self.assertEqual(list(server.unavailable), ["/metrics"])
        self.assertIn("kcoral-server[server]", server.unavailable["/metrics"])
        # /status keeps working: it does not need prometheus_client.
        self.assertIsNotNone(server.recent)

    def test_announced(self) -> None:
        from twisted.logger import globalLogPublisher

        self.hide_metrics_module()
        server = self.make_server()
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        server._announce_unavailable()
        [event] = [e for e in events if e.get("kcoral_event") == "endpoint_unavailable"]
        self.assertEqual(event["endpoint"], "/metrics")
        self.assertEqual(event["log_level"].name, "warn")
        self.assertIn("kcoral.server.observe.metrics", event["error"])

    def test_all_endpoints_when_installed(self) -> None:
        server = self.make_server()
        self.assertEqual(server.unavailable, {})
        self.assertIsNotNone(server.metrics)
        self.assertIsNotNone(server.recent)


class RefusalTests(SynchronousTestCase):
    """C{kcoral_refusals_total} counts C{request_refused} by status and reason."""

    def test_refusals_by_status_and_reason(self) -> None:
        """Every known pair starts at zero; each event adds one to its pair."""
        metrics = Metrics()
        log = Logger(namespace="kcoral.test", observer=LogPublisher(metrics))
        for status, reason in [(408, "head_timeout"), (408, "head_timeout"), (503, "busy")]:
            log.info(
                "refused",
                kcoral_event="request_refused",
                status=status,
                reason=reason,
                client="127.0.0.1",
                request_id="r",
                path=None,
            )
        found = samples(metrics)
        for reason, status in REFUSALS.items():
            key = ("kcoral_refusals_total", (("reason", reason), ("status", str(status))))
            expected = {"head_timeout": 2.0, "busy": 1.0}.get(reason, 0.0)
            self.assertEqual(found[key], expected, reason)
