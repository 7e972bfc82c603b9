# -*- test-case-name: tests.unit.test_metrics -*-
"""
Prometheus metrics for C{GET /metrics}.

L{Metrics} is an L{ILogObserver}: it sees the same kcoral events as the log
files and counts them, so the emitters never call metric objects directly.
Gauges that describe current state (queue length, cache sizes, lease depth)
are read at scrape time from a C{state()} callable.

Counters and histograms (from events):

  - C{kcoral_requests_total{outcome}}: C{request_finished} by
    C{finish_reason}.
  - C{kcoral_request_duration_seconds{outcome}}: from a request's
    C{request_received} to its C{request_finished} (the event times), by
    C{finish_reason}: the latency the server adds up, queueing included.
  - C{kcoral_worker_replacements_total{reason}}: C{worker_retired} by
    C{reason}.
  - C{kcoral_lease_wait_seconds{gpu}}, C{kcoral_lease_held_seconds{gpu}}:
    C{request_finished}'s C{lease_wait_ms} / C{lease_held_ms} when it has a
    C{gpu_id}.
  - C{kcoral_refusals_total{status, reason}}: C{request_refused} by its
    C{status} and C{reason} (every L{REFUSALS} pair is exported from the
    start, at zero): requests and connections the server would not take.
  - C{kcoral_cache_hits_total{cache}}, C{kcoral_cache_misses_total{cache}},
    C{kcoral_cache_evictions_total{cache}}: C{cache_hit}, C{cache_miss},
    C{cache_evicted} with C{cache} = C{memory} or C{disk} and an optional
    C{count} (default 1).

Gauges (from C{state()}): C{kcoral_queue_length}, C{kcoral_active_requests},
C{kcoral_request_capacity}, C{kcoral_cache_bytes{cache}},
C{kcoral_lease_depth{gpu}}, C{kcoral_spare_workers{gpu,state}}.

C{kcoral_build_info{version, python, twisted}} is always 1; its labels
name what is running.  C{prometheus_client}'s process collector
(C{process_cpu_seconds_total}, C{process_resident_memory_bytes},
C{process_open_fds}, C{process_start_time_seconds}, ...) and platform
collector (C{python_info}) describe the server process.  No C{*_created}
series are exported.

L{Metrics.expose} answers as C{prometheus_client}'s own handlers do: the
OpenMetrics format when the scraper's C{Accept} asks for it, the text
format otherwise, gzipped when its C{Accept-Encoding} allows.

The registry is private to the instance, so several servers (or tests) in
one process do not share counters.

With several front ends (C{--front-ends N}) each front end's report to the
others carries its metrics (L{pack_families}), and whichever front end
answers C{GET /metrics} renders every front end's series, each with a
C{front_end} label: its own as they are, the others' as of their last
report (at most a second old).  Sum over C{front_end} for the server's
totals; the lease gauges are the broker's, the same in every front end.
"""

from __future__ import annotations

import base64
import gzip
import json
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder, generate_latest, gzip_accepted
from prometheus_client.registry import Collector
from twisted.logger import ILogObserver, Logger
from zope.interface import implementer

from kcoral.server.http.refusals import REFUSALS

__all__ = [
    "FINISH_REASONS",
    "LEASE_BUCKETS",
    "METRICS_REPORT_KEY",
    "Metrics",
    "StateCallable",
    "pack_families",
    "unpack_families",
]

#: The key of a front end's packed metrics in its report to the others.
METRICS_REPORT_KEY = "metrics"

#: Signature of the scrape-time state callable.
StateCallable = Callable[[], Mapping[str, Any]]

#: C{finish_reason} values exported with a zero count from the start.
FINISH_REASONS = (
    "completed",
    "program_failed",
    "timeout",
    "crashed",
    "no_worker",
    "rejected",
    "cache_miss",
    "server_error",
    "invalid_request",
)

#: Histogram buckets (seconds) for lease waits and holds: 1 ms to 15 min.
LEASE_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    900.0,
    float("inf"),
)

_CACHES = ("memory", "disk")

#: Requests received and not yet finished that are remembered for the
#: duration histogram; beyond this the oldest are forgotten.
MAX_OPEN_REQUESTS = 10000


def build_info() -> dict[str, str]:
    """The labels of C{kcoral_build_info}: kcoral, Python and Twisted versions."""
    import platform
    from importlib import metadata

    def version(distribution: str) -> str:
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            return "unknown"

    return {
        "version": version("kcoral-server"),
        "python": platform.python_version(),
        "twisted": version("twisted"),
    }


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if value != value or value in (float("inf"), float("-inf")):
        return None
    return float(value)


class _StateCollector(Collector):
    """
    Gauges read from C{state()} at scrape time.
    """

    log = Logger()

    def __init__(self, state: StateCallable | None) -> None:
        self._state = state

    def _families(self) -> dict[str, GaugeMetricFamily]:
        return {
            "queue_length": GaugeMetricFamily(
                "kcoral_queue_length", "Requests waiting for an idle worker."
            ),
            "active_requests": GaugeMetricFamily(
                "kcoral_active_requests", "Requests assigned to a worker and not finished."
            ),
            "request_capacity": GaugeMetricFamily(
                "kcoral_request_capacity", "Requests the server can run at once."
            ),
            "cache_bytes": GaugeMetricFamily(
                "kcoral_cache_bytes", "Bytes held by each cache.", labels=["cache"]
            ),
            "lease_depth": GaugeMetricFamily(
                "kcoral_lease_depth",
                "GPU lease holder plus waiters, per GPU.",
                labels=["gpu"],
            ),
            "spare_workers": GaugeMetricFamily(
                "kcoral_spare_workers",
                "Warm spare workers per GPU (cpu in CPU mode), starting or ready.",
                labels=["gpu", "state"],
            ),
        }

    def describe(self) -> Iterator[Metric]:
        # Without this the registry would call collect() (and state()) when
        # the collector is registered, possibly before the pool exists.
        yield from self._families().values()

    def collect(self) -> Iterator[Metric]:
        if self._state is None:
            return
        try:
            state = self._state()
        except Exception:
            self.log.failure("metrics state() failed")
            return
        families = self._families()
        for key in ("queue_length", "active_requests", "request_capacity"):
            value = _number(state.get(key))
            if value is not None:
                families[key].add_metric([], value)
        for cache, size in sorted((state.get("cache_bytes") or {}).items()):
            value = _number(size)
            if value is not None:
                families["cache_bytes"].add_metric([str(cache)], value)
        for gpu, depth in sorted((state.get("lease_depth") or {}).items(), key=lambda i: str(i[0])):
            value = _number(depth)
            if value is not None:
                families["lease_depth"].add_metric([str(gpu)], value)
        for (gpu, spare_state), count in sorted(
            (state.get("spare_workers") or {}).items(), key=lambda i: (str(i[0][0]), i[0][1])
        ):
            value = _number(count)
            if value is not None:
                families["spare_workers"].add_metric([str(gpu), str(spare_state)], value)
        yield from families.values()


@implementer(ILogObserver)
class Metrics:
    """
    The server's Prometheus metrics; add it as a log observer.

    @ivar registry: the private L{CollectorRegistry}.
    """

    def __init__(self, state: StateCallable | None = None) -> None:
        """
        @param state: called at each scrape; returns C{{"queue_length": n,
            "active_requests": n, "request_capacity": n, "cache_bytes":
            {"memory": n, "disk": n}, "lease_depth": {gpu_id: n},
            "spare_workers": {(gpu_id or "cpu", state): n}}}.  Missing
            keys are left out of the output; C{None} exports no gauges.
        """
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kcoral_requests",
            "Finished requests by outcome (finish_reason).",
            ["outcome"],
            registry=self.registry,
        )
        self.request_duration = Histogram(
            "kcoral_request_duration_seconds",
            "Time from receiving a request to finishing it, by outcome (finish_reason).",
            ["outcome"],
            buckets=LEASE_BUCKETS,
            registry=self.registry,
        )
        self.build = Info("kcoral_build", "The running kcoral.", registry=self.registry)
        self.build.info(build_info())
        self._received: dict[str, float] = {}
        self.worker_replacements = Counter(
            "kcoral_worker_replacements",
            "Workers retired and replaced, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.lease_wait = Histogram(
            "kcoral_lease_wait_seconds",
            "Time a request waited for its GPU lease.",
            ["gpu"],
            buckets=LEASE_BUCKETS,
            registry=self.registry,
        )
        self.lease_held = Histogram(
            "kcoral_lease_held_seconds",
            "Time a request held its GPU lease.",
            ["gpu"],
            buckets=LEASE_BUCKETS,
            registry=self.registry,
        )
        self.cache_hits = Counter(
            "kcoral_cache_hits",
            "Cache lookups that found the entry.",
            ["cache"],
            registry=self.registry,
        )
        self.cache_misses = Counter(
            "kcoral_cache_misses",
            "Cache lookups that did not find the entry.",
            ["cache"],
            registry=self.registry,
        )
        self.cache_evictions = Counter(
            "kcoral_cache_evictions",
            "Entries evicted from a cache.",
            ["cache"],
            registry=self.registry,
        )
        self.refusals = Counter(
            "kcoral_refusals",
            "Requests and connections refused before reaching a worker, by status and reason.",
            ["status", "reason"],
            registry=self.registry,
        )
        # The GPU monitor (kcoral.server.leases.monitor), by GPU.
        self.gpu_events = {
            "gpu_interference": Counter(
                "kcoral_gpu_interference",
                "Leases during which another process used the GPU.",
                ["gpu"],
                registry=self.registry,
            ),
            "gpu_throttled": Counter(
                "kcoral_gpu_throttled",
                "Leases during which the GPU's clocks were throttled.",
                ["gpu"],
                registry=self.registry,
            ),
            "gpu_descendant_killed": Counter(
                "kcoral_gpu_descendants_killed",
                "Processes started by a program that used a GPU, killed.",
                ["gpu"],
                registry=self.registry,
            ),
        }
        for reason, status in REFUSALS.items():
            self.refusals.labels(status=str(status), reason=reason)
        for reason in FINISH_REASONS:
            self.requests.labels(outcome=reason)
        for cache in _CACHES:
            for counter in (self.cache_hits, self.cache_misses, self.cache_evictions):
                counter.labels(cache=cache)
        self.registry.register(_StateCollector(state))
        # The standard process_* (CPU, memory, open files, start time) and
        # python_info series, as prometheus_client's default registry has.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self._cache_counters = {
            "cache_hit": self.cache_hits,
            "cache_miss": self.cache_misses,
            "cache_evicted": self.cache_evictions,
        }

    def __call__(self, event: dict[str, Any]) -> None:
        name = event.get("kcoral_event")
        if name is None:
            return
        try:
            self._observe(name, event)
        except Exception:
            # A malformed event must not break the log publisher.
            pass

    def _observe(self, name: str, event: Mapping[str, Any]) -> None:
        if name == "request_received":
            received = _number(event.get("log_time"))
            if received is not None:
                self._received[str(event.get("request_id"))] = received
                while len(self._received) > MAX_OPEN_REQUESTS:
                    del self._received[next(iter(self._received))]
        elif name == "request_finished":
            outcome = str(event.get("finish_reason") or "unknown")
            self.requests.labels(outcome=outcome).inc()
            received = self._received.pop(str(event.get("request_id")), None)
            finished = _number(event.get("log_time"))
            if received is not None and finished is not None:
                self.request_duration.labels(outcome=outcome).observe(max(0.0, finished - received))
            gpu = event.get("gpu_id")
            if gpu is not None:
                wait = _number(event.get("lease_wait_ms"))
                if wait is not None:
                    self.lease_wait.labels(gpu=str(gpu)).observe(wait / 1000.0)
                held = _number(event.get("lease_held_ms"))
                if held is not None:
                    self.lease_held.labels(gpu=str(gpu)).observe(held / 1000.0)
        elif name == "request_refused":
            status = event.get("status")
            reason = str(event.get("reason") or "unknown")
            self.refusals.labels(status=str(status), reason=reason).inc()
        elif name == "worker_retired":
            self.worker_replacements.labels(reason=str(event.get("reason") or "unknown")).inc()
        elif name in self.gpu_events:
            self.gpu_events[name].labels(gpu=str(event.get("gpu_id"))).inc()
        elif name in self._cache_counters:
            count = _number(event.get("count", 1))
            if count is not None and count > 0:
                cache = str(event.get("cache") or "unknown")
                self._cache_counters[name].labels(cache=cache).inc(count)

    def render(
        self, peers: Mapping[int, list[dict[str, Any]]] | None = None, index: int = 0
    ) -> tuple[bytes, str]:
        """
        The text exposition for C{GET /metrics}.

        @param peers: with several front ends, the others' last
            L{families} by front-end index: every series then carries a
            C{front_end} label (C{index} for this process's own).
        @return: C{(body, content_type)}.
        """
        return generate_latest(self._exposed(peers, index)), CONTENT_TYPE_LATEST

    def expose(
        self,
        peers: Mapping[int, list[dict[str, Any]]] | None = None,
        index: int = 0,
        *,
        accept: str | None = None,
        accept_encoding: str | None = None,
    ) -> tuple[bytes, dict[str, str]]:
        """
        C{GET /metrics} as C{prometheus_client}'s own handlers answer it:
        OpenMetrics when C{accept} asks for it
        (C{application/openmetrics-text}), else the text format; gzipped
        when C{accept_encoding} allows it.

        @param peers: as for L{render}.
        @return: C{(body, headers)}: C{Content-Type}, C{Content-Encoding}
            when compressed, and C{Vary}.
        """
        encoder, content_type = choose_encoder(accept or "")
        body = encoder(self._exposed(peers, index))
        headers = {"Content-Type": content_type, "Vary": "Accept, Accept-Encoding"}
        if gzip_accepted(accept_encoding or ""):
            body = gzip.compress(body)
            headers["Content-Encoding"] = "gzip"
        return body, headers

    def _exposed(
        self, peers: Mapping[int, list[dict[str, Any]]] | None, index: int
    ) -> CollectorRegistry:
        """What C{/metrics} shows: this process's metrics, or every front end's."""
        registry = CollectorRegistry(auto_describe=False)
        if peers is None:
            registry.register(_WithoutCreated(self.registry))
        else:
            registry.register(_Families({**peers, index: self.families()}))
        return registry

    def families(self) -> list[dict[str, Any]]:
        """Every metric of this process as JSON-ready data (for the other front ends)."""
        return [
            {
                "name": metric.name,
                "type": metric.type,
                "help": metric.documentation,
                "samples": [[s.name, s.labels, s.value] for s in metric.samples],
            }
            for metric in _WithoutCreated(self.registry).collect()
        ]


class _WithoutCreated(Collector):
    """
    A registry's metrics without their C{*_created} samples: the creation
    time of each counter and histogram child, which doubles the series of
    every labelled family and says nothing a scraper needs (the process's
    start time is C{process_start_time_seconds}).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self._registry.collect():
            kept = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            kept.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield kept


class _Families(Collector):
    """Several front ends' L{Metrics.families}, each series labelled with its front end."""

    def __init__(self, by_front_end: Mapping[int, list[dict[str, Any]]]) -> None:
        self._by_front_end = by_front_end

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for index, families in sorted(self._by_front_end.items()):
            for family in families:
                metric = merged.get(family["name"])
                if metric is None:
                    metric = Metric(family["name"], family["help"], family["type"])
                    merged[family["name"]] = metric
                for name, labels, value in family["samples"]:
                    metric.add_sample(name, {**labels, "front_end": str(index)}, value)
        yield from merged.values()


def pack_families(families: list[dict[str, Any]]) -> str:
    """L{Metrics.families} as compact text for a front end's report (zlib, base64)."""
    raw = json.dumps(families, separators=(",", ":")).encode()
    return base64.b64encode(zlib.compress(raw, 6)).decode("ascii")


def unpack_families(text: str) -> list[dict[str, Any]]:
    """The inverse of L{pack_families}."""
    families: list[dict[str, Any]] = json.loads(zlib.decompress(base64.b64decode(text)))
    return families
