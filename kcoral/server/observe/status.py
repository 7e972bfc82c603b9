# -*- test-case-name: tests.unit.test_status_page -*-
"""
The operator status page: C{GET /status} and C{GET /status.json}.

  - L{RecentRequests} is an L{ILogObserver} that remembers the requests in
    flight (from C{request_routed}), the last finished ones (from
    C{request_finished}) and, apart from those so that a busy server does
    not scroll them away, the last failures (L{FAILURE_REASONS} and the
    worker and start-up events in L{FAILURE_EVENTS}) and the last refusals
    (C{request_refused}) with a count of every refusal since start by status
    and reason.
  - L{status_snapshot} merges the C{/health} dictionary and those requests
    into the JSON the page reads.
  - L{STATUS_PAGE} is one self-contained HTML page (no framework, no
    external resources) that fetches C{status.json} (a relative URL, so the
    page works behind a path prefix) every second and renders tables of
    workers, GPU leases, load and recent requests.  Serve it at C{/status}
    next to C{/status.json}.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Mapping
from typing import Any

from twisted.logger import ILogObserver
from zope.interface import implementer

from kcoral.server.observe.logs import format_timestamp

__all__ = ["FAILURE_EVENTS", "FAILURE_REASONS", "STATUS_PAGE", "RecentRequests", "status_snapshot"]

#: C{request_finished} reasons that are the server's failures (a program's
#: own error, C{program_failed}, is the user's business).
FAILURE_REASONS = frozenset({"crashed", "server_error", "timeout", "no_worker", "rejected"})

#: Other events shown among the failures.
FAILURE_EVENTS = frozenset(
    {
        "worker_failed",
        "worker_replace_failed",
        "server_start_failed",
        "sandbox_disabled",
        "template_failed",
        "worker_start_fallback",
    }
)


def _short(value: object, limit: int = 300) -> object:
    if isinstance(value, str) and len(value) > limit:
        return value[:limit] + "..."
    return value


@implementer(ILogObserver)
class RecentRequests:
    """
    The requests in flight and the last C{maxlen} finished ones, collected
    from kcoral events.

    Finished entries: C{request_id}, C{finish_reason}, C{http_status},
    C{worker_id}, C{elapsed_ms}, C{queue_ms}, C{time} (the C{request_finished}
    event's time, ISO-8601).  In-flight entries: C{request_id},
    C{worker_id}, C{gpu_id}, C{queue_ms}, C{time} (when it was routed).
    """

    def __init__(
        self,
        maxlen: int = 50,
        max_in_flight: int = 1000,
        max_failures: int = 20,
        max_refusals: int = 20,
    ) -> None:
        """
        @param maxlen: finished requests kept.
        @param max_in_flight: in-flight entries kept; the oldest are dropped
            beyond this (a request whose server died never finishes).
        @param max_failures: failures kept.
        @param max_refusals: refusals kept.
        """
        self._finished: deque[dict[str, Any]] = deque(maxlen=maxlen)
        self._failures: deque[dict[str, Any]] = deque(maxlen=max_failures)
        self._refusals: deque[dict[str, Any]] = deque(maxlen=max_refusals)
        self._refusal_counts: Counter[tuple[int, str]] = Counter()
        self._in_flight: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._max_in_flight = max_in_flight

    def __call__(self, event: dict[str, Any]) -> None:
        name = event.get("kcoral_event")
        if name == "request_routed":
            self._routed(event)
        elif name == "request_finished":
            self._finished_event(event)
            if event.get("finish_reason") in FAILURE_REASONS:
                self._failure(event, str(event.get("finish_reason")))
        elif name == "request_refused":
            self._refused(event)
        elif name in FAILURE_EVENTS:
            self._failure(event, str(event.get("phase") or event.get("reason") or name))

    def _refused(self, event: Mapping[str, Any]) -> None:
        status, reason = event.get("status"), event.get("reason")
        if not isinstance(status, int) or not isinstance(reason, str):
            return
        self._refusal_counts[(status, reason)] += 1
        self._refusals.append(
            {
                "time": format_timestamp(event.get("log_time")),
                "status": status,
                "reason": reason,
                "client": event.get("client"),
                "request_id": event.get("request_id"),
                "path": _short(event.get("path"), 100),
            }
        )

    def _failure(self, event: Mapping[str, Any], reason: str) -> None:
        message = event.get("error_message") or event.get("error") or event.get("message")
        self._failures.append(
            {
                "time": format_timestamp(event.get("log_time")),
                "event": event.get("kcoral_event"),
                "reason": reason,
                "request_id": event.get("request_id"),
                "worker_id": event.get("worker_id"),
                "http_status": event.get("http_status"),
                "error_kind": event.get("error_kind"),
                "message": _short(message),
            }
        )

    def _routed(self, event: Mapping[str, Any]) -> None:
        request_id = event.get("request_id")
        if request_id is None:
            return
        self._in_flight.pop(str(request_id), None)
        self._in_flight[str(request_id)] = {
            "request_id": request_id,
            "worker_id": event.get("worker_id"),
            "gpu_id": event.get("gpu_id"),
            "queue_ms": event.get("queue_ms"),
            "time": format_timestamp(event.get("log_time")),
        }
        while len(self._in_flight) > self._max_in_flight:
            self._in_flight.popitem(last=False)

    def _finished_event(self, event: Mapping[str, Any]) -> None:
        request_id = event.get("request_id")
        routed = self._in_flight.pop(str(request_id), None) or {}
        self._finished.append(
            {
                "request_id": request_id,
                "finish_reason": event.get("finish_reason"),
                "http_status": event.get("http_status"),
                "worker_id": event.get("worker_id", routed.get("worker_id")),
                "elapsed_ms": event.get("elapsed_ms"),
                "queue_ms": event.get("queue_ms", routed.get("queue_ms")),
                "time": format_timestamp(event.get("log_time")),
            }
        )

    def recent(self) -> list[dict[str, Any]]:
        """
        The finished requests, newest first (copies).
        """
        return [dict(entry) for entry in reversed(self._finished)]

    def failures(self) -> list[dict[str, Any]]:
        """
        The recent failures, newest first (copies).
        """
        return [dict(entry) for entry in reversed(self._failures)]

    def refusals(self) -> list[dict[str, Any]]:
        """
        The recent refusals, newest first (copies).
        """
        return [dict(entry) for entry in reversed(self._refusals)]

    def refusal_counts(self) -> list[dict[str, Any]]:
        """
        Every refusal since start, as C{{status, reason, count}} by status
        then reason.
        """
        return [
            {"status": status, "reason": reason, "count": count}
            for (status, reason), count in sorted(self._refusal_counts.items())
        ]

    def in_flight(self) -> list[dict[str, Any]]:
        """
        The routed, unfinished requests, oldest first (copies).
        """
        return [dict(entry) for entry in self._in_flight.values()]


def _load_value(health: Mapping[str, Any], key: str, load_key: str) -> Any:
    if key in health:
        return health[key]
    load = health.get("load")
    if isinstance(load, Mapping):
        return load.get(load_key)
    return None


#: What C{status.json} copies from C{/health} as it is.
_COPIED = ("status", "sandbox", "worker_start", "instance_id", "started_at", "target", "load")

#: The columns C{status.json} keeps of each C{/health} row.
_WORKER_COLUMNS = ("worker_id", "gpu_id", "status", "generation", "pid", "uptime_seconds")
_SPARE_COLUMNS = ("spare_id", "gpu_id", "state", "pid", "uptime_seconds")
_GPU_COLUMNS = ("gpu_id", "lease_depth", "holder", "maintenance")


def _rows(health: Mapping[str, Any], key: str, columns: tuple[str, ...]) -> list[dict[str, object]]:
    """C{health[key]}'s rows, each cut to C{columns} (a missing one is C{None})."""
    return [{column: row.get(column) for column in columns} for row in health.get(key) or ()]


def status_snapshot(health: Mapping[str, Any], recent: RecentRequests) -> dict[str, Any]:
    """
    Build the C{status.json} document read by L{STATUS_PAGE}.

    @param health: the server's C{/health} dictionary, with the extra keys
        C{workers} (C{[{worker_id, gpu_id, status, uptime_seconds,
        generation, pid}]}), C{spares} (C{[{spare_id, gpu_id, state, pid,
        uptime_seconds}]}), C{gpus} (C{[{gpu_id, lease_depth, holder,
        maintenance}]}), C{queue_length} and C{active_requests}; missing
        ones are empty.
    @param recent: the request observer.
    @return: a JSON-ready dictionary: C{status}, C{instance_id},
        C{started_at}, C{target}, C{load}, C{queue_length},
        C{active_requests}, C{request_capacity}, C{workers}, C{spares}, C{gpus},
        C{in_flight}, C{recent}, C{failures} and C{refusals} (newest
        first), C{refusal_counts} (every refusal since start by status and
        reason), and
        C{sandbox} (the worker isolation in use: C{bubblewrap} or C{none}),
        C{worker_start} (C{fork} or C{spawn}, L{kcoral.server.workers.template}).
    """
    return {
        **{key: health.get(key) for key in _COPIED},
        "queue_length": _load_value(health, "queue_length", "requests_waiting"),
        "active_requests": _load_value(health, "active_requests", "requests_in_progress"),
        "request_capacity": _load_value(health, "request_capacity", "request_capacity"),
        "workers": _rows(health, "workers", _WORKER_COLUMNS),
        "spares": _rows(health, "spares", _SPARE_COLUMNS),
        "gpus": _rows(health, "gpus", _GPU_COLUMNS),
        "in_flight": recent.in_flight(),
        "recent": recent.recent(),
        "failures": recent.failures(),
        "refusals": recent.refusals(),
        "refusal_counts": recent.refusal_counts(),
    }


STATUS_PAGE = b"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>kcoral status</title>
<style>
body { font: 13px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; margin: 0 0 .3em; }
h2 { font-size: 1.05em; margin: 1.2em 0 .3em; }
table { border-collapse: collapse; }
th, td { border: 1px solid #ccc; padding: 2px 8px; text-align: left; }
th { background: #f2f2f2; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
#state.error { color: #b00; }
.bad { color: #b00; } .warn { color: #a60; }
</style>
</head>
<body>
<h1>kcoral status</h1>
<div id="state">loading&hellip;</div>
<h2>Load</h2>
<table id="load"><tr><th>queue length</th><th>active requests</th><th>capacity</th></tr>
<tr><td class="num" id="queue_length"></td><td class="num" id="active_requests"></td>
<td class="num" id="request_capacity"></td></tr></table>
<h2>Workers</h2>
<table id="workers"><thead><tr><th>worker_id</th><th>gpu_id</th><th>status</th>
<th>generation</th><th>pid</th><th>uptime</th></tr></thead><tbody></tbody></table>
<h2>Warm spares</h2>
<table id="spares"><thead><tr><th>spare_id</th><th>gpu_id</th><th>state</th><th>pid</th>
<th>uptime</th></tr></thead><tbody></tbody></table>
<h2>GPU leases</h2>
<table id="leases"><thead><tr><th>gpu</th><th>lease_depth</th><th>holder</th>
<th>maintenance</th></tr></thead><tbody></tbody></table>
<h2>In flight</h2>
<table id="in_flight"><thead><tr><th>request_id</th><th>worker_id</th><th>gpu_id</th>
<th>queue_ms</th><th>routed at</th></tr></thead><tbody></tbody></table>
<h2>Recent requests</h2>
<table id="recent"><thead><tr><th>time</th><th>request_id</th><th>finish_reason</th>
<th>http_status</th><th>worker_id</th><th>queue_ms</th><th>elapsed_ms</th></tr></thead>
<tbody></tbody></table>
<h2>Recent failures</h2>
<table id="failures"><thead><tr><th>time</th><th>event</th><th>reason</th><th>request_id</th>
<th>worker_id</th><th>http_status</th><th>error</th></tr></thead><tbody></tbody></table>
<h2>Refusals</h2>
<table id="refusal_counts"><thead><tr><th>status</th><th>reason</th><th>since start</th></tr>
</thead><tbody></tbody></table>
<h2>Recent refusals</h2>
<table id="refusals"><thead><tr><th>time</th><th>status</th><th>reason</th><th>client</th>
<th>request_id</th><th>path</th></tr></thead><tbody></tbody></table>
<script>
"use strict";
function text(v) { return v === null || v === undefined ? "" : String(v); }
function ms(v) { return typeof v === "number" ? v.toFixed(1) : text(v); }
function uptime(s) {
  if (typeof s !== "number") return text(s);
  s = Math.floor(s);
  var h = Math.floor(s / 3600), m = Math.floor(s % 3600 / 60);
  return (h ? h + "h " : "") + (h || m ? m + "m " : "") + (s % 60) + "s";
}
function fill(id, rows, cells) {
  var body = document.querySelector("#" + id + " tbody"), out = document.createDocumentFragment();
  (rows || []).forEach(function (row) {
    var tr = document.createElement("tr");
    cells(row).forEach(function (c) {
      var td = document.createElement("td");
      if (Array.isArray(c)) { td.textContent = c[0]; td.className = c[1]; }
      else td.textContent = c;
      tr.appendChild(td);
    });
    out.appendChild(tr);
  });
  body.replaceChildren(out);
}
function reasonClass(r) {
  return r === "crashed" || r === "server_error" ? "bad" :
    (r === "timeout" || r === "no_worker" || r === "rejected" ? "warn" : "");
}
function render(s) {
  ["queue_length", "active_requests", "request_capacity"].forEach(function (k) {
    document.getElementById(k).textContent = text(s[k]);
  });
  fill("workers", s.workers, function (w) {
    return [text(w.worker_id), text(w.gpu_id), text(w.state || w.status), text(w.generation),
            text(w.pid), [uptime(w.uptime_seconds), "num"]];
  });
  fill("spares", s.spares, function (w) {
    return [text(w.spare_id), text(w.gpu_id), text(w.state), text(w.pid),
            [uptime(w.uptime_seconds), "num"]];
  });
  fill("leases", s.gpus, function (g) {
    return [text(g.gpu_id), [text(g.lease_depth), "num"], text(g.holder),
            [text(g.maintenance), "num"]];
  });
  fill("in_flight", s.in_flight, function (r) {
    return [text(r.request_id), text(r.worker_id), text(r.gpu_id), [ms(r.queue_ms), "num"],
            text(r.time)];
  });
  fill("recent", s.recent, function (r) {
    return [text(r.time), text(r.request_id), [text(r.finish_reason), reasonClass(r.finish_reason)],
            text(r.http_status), text(r.worker_id), [ms(r.queue_ms), "num"],
            [ms(r.elapsed_ms), "num"]];
  });
  fill("failures", s.failures, function (f) {
    return [text(f.time), text(f.event), [text(f.reason), "bad"], text(f.request_id),
            text(f.worker_id), text(f.http_status),
            text(f.error_kind ? f.error_kind + ": " + text(f.message) : f.message)];
  });
  fill("refusal_counts", s.refusal_counts, function (c) {
    return [text(c.status), text(c.reason), [text(c.count), "num"]];
  });
  fill("refusals", s.refusals, function (r) {
    return [text(r.time), text(r.status), [text(r.reason), r.status === 503 ? "warn" : ""],
            text(r.client), text(r.request_id), text(r.path)];
  });
  var state = document.getElementById("state");
  state.className = "";
  state.textContent = text(s.status) + " \\u00b7 sandbox " + text(s.sandbox) +
    " \\u00b7 workers by " + text(s.worker_start) +
    " \\u00b7 instance " + text(s.instance_id) +
    " \\u00b7 started " + text(s.started_at) + " \\u00b7 updated " + new Date().toISOString();
}
function poll() {
  fetch("status.json", {cache: "no-store"})
    .then(function (r) { if (!r.ok) throw new Error("HTTP " + r.status); return r.json(); })
    .then(render)
    .catch(function (e) {
      var state = document.getElementById("state");
      state.className = "error";
      state.textContent = "status.json unavailable: " + e.message;
    });
}
poll();
setInterval(poll, 1000);
</script>
</body>
</html>
"""
