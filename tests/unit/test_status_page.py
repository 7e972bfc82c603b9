"""
Tests for L{kcoral.server.observe.status}.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from twisted.logger import Logger, LogPublisher
from twisted.trial.unittest import SkipTest, SynchronousTestCase

from kcoral.server.observe.status import STATUS_PAGE, RecentRequests, status_snapshot

HEALTH: dict[str, Any] = {
    "status": "ok",
    "instance_id": "5b0f6c1e-0000-4000-8000-000000000001",
    "started_at": "2026-08-29T18:42:11.019012Z",
    "gpu_count": 1,
    "load": {"request_capacity": 2, "requests_in_progress": 1, "requests_waiting": 3},
    "target": {"arch": "sm_90a"},
    "versions": {"cuda": "12.8"},
    "workers": [
        {
            "worker_id": "gpu0/w0",
            "gpu_id": 0,
            "status": "busy",
            "uptime_seconds": 3725.5,
            "generation": 2,
            "pid": 4242,
        },
        {
            "worker_id": "gpu0/w1",
            "gpu_id": 0,
            "status": "idle",
            "uptime_seconds": 12.0,
            "generation": 0,
            "pid": 4243,
        },
    ],
    "spares": [
        {"spare_id": "gpu0/s1", "gpu_id": 0, "state": "ready", "pid": 4250, "uptime_seconds": 2.0}
    ],
    "gpus": [{"gpu_id": 0, "lease_depth": 1, "holder": "gpu0/w0", "maintenance": 0}],
    "queue_length": 3,
    "active_requests": 1,
}


def chromium_binary() -> str | None:
    """
    The headless browser to use: C{$CHROMIUM} or the first of the usual
    names on C{PATH}.
    """
    if os.environ.get("CHROMIUM"):
        return os.environ["CHROMIUM"]
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


# Serves the page and a canned status.json with twisted.web on a random
# 127.0.0.1 port and prints the port.
SERVER_SCRIPT = """
import sys
from twisted.internet import reactor
from twisted.web.resource import Resource
from twisted.web.server import Site
from twisted.web.static import Data

with open(sys.argv[1], "rb") as f:
    page = f.read()
with open(sys.argv[2], "rb") as f:
    status = f.read()
root = Resource()
root.putChild(b"status", Data(page, "text/html; charset=utf-8"))
root.putChild(b"status.json", Data(status, "application/json"))
port = reactor.listenTCP(0, Site(root), interface="127.0.0.1")
print(port.getHost().port, flush=True)
reactor.run()
"""


class RecentRequestsTests(SynchronousTestCase):
    """
    Tests for L{RecentRequests}.
    """

    def setUp(self) -> None:
        self.recent = RecentRequests(maxlen=3)
        self.log = Logger(namespace="kcoral.test", observer=LogPublisher(self.recent))

    def route(self, request_id: str, worker_id: str = "gpu0/w0") -> None:
        """
        Emit C{request_routed}.
        """
        self.log.info(
            "routed",
            kcoral_event="request_routed",
            request_id=request_id,
            worker_id=worker_id,
            gpu_id=0,
            gpu_ids=[0],
            generation=0,
            pid=1,
            queue_ms=1.5,
        )

    def finish(self, request_id: str, reason: str = "completed", **fields: Any) -> None:
        """
        Emit C{request_finished}.
        """
        self.log.info(
            "finished",
            kcoral_event="request_finished",
            request_id=request_id,
            http_status=200,
            finish_reason=reason,
            **fields,
        )

    def test_newest_first_and_bounded(self) -> None:
        """
        Finished requests are listed newest first, at most C{maxlen}.
        """
        for i in range(5):
            self.finish(f"r{i}", elapsed_ms=float(i))
        self.assertEqual([r["request_id"] for r in self.recent.recent()], ["r4", "r3", "r2"])
        entry = self.recent.recent()[0]
        self.assertEqual(
            sorted(entry),
            sorted(
                [
                    "request_id",
                    "finish_reason",
                    "http_status",
                    "worker_id",
                    "elapsed_ms",
                    "queue_ms",
                    "time",
                ]
            ),
        )
        self.assertEqual(entry["elapsed_ms"], 4.0)
        self.assertRegex(entry["time"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")

    def test_in_flight(self) -> None:
        """
        Routed requests are in flight until they finish; the finished entry
        keeps the routed worker and queue time when the event has none.
        """
        self.route("a", "gpu0/w0")
        self.route("b", "gpu0/w1")
        self.assertEqual([r["request_id"] for r in self.recent.in_flight()], ["a", "b"])
        self.finish("a", reason="crashed")
        self.assertEqual([r["request_id"] for r in self.recent.in_flight()], ["b"])
        [done] = self.recent.recent()
        self.assertEqual(done["worker_id"], "gpu0/w0")
        self.assertEqual(done["queue_ms"], 1.5)
        self.assertEqual(done["finish_reason"], "crashed")

    def test_in_flight_bounded(self) -> None:
        """
        In-flight entries beyond C{max_in_flight} drop the oldest.
        """
        recent = RecentRequests(max_in_flight=2)
        for request_id in ["a", "b", "c"]:
            recent({"kcoral_event": "request_routed", "request_id": request_id})
        self.assertEqual([r["request_id"] for r in recent.in_flight()], ["b", "c"])

    def test_other_events_ignored(self) -> None:
        """
        Other events, and plain ones, change nothing.
        """
        self.log.info("x", kcoral_event="request_received", request_id="z")
        self.log.info("x", request_id="z")
        self.assertEqual(self.recent.recent(), [])
        self.assertEqual(self.recent.in_flight(), [])


class StatusSnapshotTests(SynchronousTestCase):
    """
    Tests for L{status_snapshot}.
    """

    def test_snapshot(self) -> None:
        """
        The snapshot carries workers, GPUs, load figures and requests, and is
        JSON-encodable.
        """
        recent = RecentRequests()
        recent({"kcoral_event": "request_finished", "request_id": "r1", "log_time": 0.0})
        snapshot = status_snapshot(HEALTH, recent)
        json.dumps(snapshot, allow_nan=False)
        self.assertEqual([w["worker_id"] for w in snapshot["workers"]], ["gpu0/w0", "gpu0/w1"])
        self.assertEqual(snapshot["gpus"], HEALTH["gpus"])
        self.assertEqual(snapshot["spares"], HEALTH["spares"])
        self.assertEqual(snapshot["queue_length"], 3)
        self.assertEqual(snapshot["active_requests"], 1)
        self.assertEqual(snapshot["request_capacity"], 2)
        self.assertEqual(snapshot["recent"][0]["request_id"], "r1")
        self.assertEqual(snapshot["recent"][0]["time"], "1970-01-01T00:00:00.000Z")

    def test_load_fallback(self) -> None:
        """
        Without the extra keys, figures come from C{load}; lists are empty.
        """
        snapshot = status_snapshot({"load": HEALTH["load"]}, RecentRequests())
        self.assertEqual(snapshot["queue_length"], 3)
        self.assertEqual(snapshot["active_requests"], 1)
        self.assertEqual(snapshot["request_capacity"], 2)
        self.assertEqual(snapshot["workers"], [])
        self.assertEqual(snapshot["gpus"], [])


class StatusPageTests(SynchronousTestCase):
    """
    Tests for L{STATUS_PAGE}.
    """

    def test_self_contained(self) -> None:
        """
        The page is titled C{kcoral status}, polls the relative
        C{status.json} every second and loads nothing from elsewhere.
        """
        page = STATUS_PAGE.decode("utf-8")
        self.assertIn("<title>kcoral status</title>", page)
        self.assertIn('fetch("status.json"', page)
        self.assertIn("setInterval(poll, 1000)", page)
        self.assertNotIn("http://", page)
        self.assertNotIn("https://", page)
        self.assertNotIn("src=", page)

    @pytest.mark.integration
    def test_renders_in_chromium(self) -> None:
        """
        Served over real HTTP on 127.0.0.1, the page rendered by headless
        Chromium shows the worker ids and the recent request id.
        """
        browser = chromium_binary()
        if browser is None:
            raise SkipTest("no chromium binary found")
        work = Path(tempfile.mkdtemp(prefix="kcoral-test-status-"))
        self.addCleanup(shutil.rmtree, work, True)
        recent = RecentRequests()
        recent(
            {
                "kcoral_event": "request_routed",
                "request_id": "inflight-req-7",
                "worker_id": "gpu0/w0",
                "gpu_id": 0,
                "queue_ms": 0.4,
            }
        )
        recent(
            {
                "kcoral_event": "request_finished",
                "request_id": "req-0a1b2c3d",
                "http_status": 200,
                "finish_reason": "completed",
                "worker_id": "gpu0/w1",
                "elapsed_ms": 12.25,
                "queue_ms": 0.5,
                "log_time": 1.0e9,
            }
        )
        recent(
            {
                "kcoral_event": "request_finished",
                "request_id": "req-crashed-9",
                "http_status": 500,
                "finish_reason": "crashed",
                "worker_id": "gpu0/w1",
                "log_time": 1.0e9 + 1,
            }
        )
        recent(
            {
                "kcoral_event": "request_refused",
                "status": 503,
                "reason": "connection_cap",
                "client": "127.0.0.9",
                "request_id": "refused-req-5",
                "path": None,
                "log_time": 1.0e9 + 2,
            }
        )
        (work / "page.html").write_bytes(STATUS_PAGE)
        health = {**HEALTH, "sandbox": "bubblewrap"}
        (work / "status.json").write_text(json.dumps(status_snapshot(health, recent)))

        server = subprocess.Popen(
            [
                sys.executable,
                "-c",
                SERVER_SCRIPT,
                str(work / "page.html"),
                str(work / "status.json"),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )

        def stop() -> None:
            server.terminate()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
            assert server.stdout is not None
            server.stdout.close()

        self.addCleanup(stop)
        assert server.stdout is not None
        port = int(server.stdout.readline())

        result = subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={work / 'profile'}",
                "--virtual-time-budget=3000",
                "--dump-dom",
                f"http://127.0.0.1:{port}/status",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        dom = result.stdout
        self.assertIn("<title>kcoral status</title>", dom, result.stderr[-2000:])
        self.assertIn("<td>gpu0/w0</td>", dom)
        self.assertIn("<td>gpu0/w1</td>", dom)
        self.assertIn("<td>req-0a1b2c3d</td>", dom)
        self.assertIn("<td>inflight-req-7</td>", dom)
        self.assertIn("1h 2m 5s", dom)
        self.assertIn('id="queue_length">3<', dom)
        self.assertIn('<div id="state" class="">ok ', dom)
        self.assertIn("sandbox bubblewrap", dom)
        self.assertIn('<td class="bad">crashed</td>', dom)
        self.assertIn("<td>refused-req-5</td>", dom)
        self.assertIn('<td class="warn">connection_cap</td>', dom)
        self.assertIn('<td class="num">1</td>', dom)


class FailureTests(SynchronousTestCase):
    """
    Recent failures and the sandbox mode in L{status_snapshot}.
    """

    def test_failures_kept_apart(self) -> None:
        """
        Server-side failures and worker failures are listed newest first and
        survive many later successes; a program's own error is not one.
        """
        recent = RecentRequests(maxlen=2)
        recent(
            {
                "kcoral_event": "request_finished",
                "request_id": "t1",
                "finish_reason": "timeout",
                "http_status": 504,
                "worker_id": "cpu/w0",
                "log_time": 1.0,
            }
        )
        recent(
            {
                "kcoral_event": "worker_failed",
                "worker_id": "cpu/w1",
                "phase": "respawn",
                "error": "x" * 1000,
                "log_time": 2.0,
            }
        )
        for i in range(5):
            recent(
                {
                    "kcoral_event": "request_finished",
                    "request_id": f"ok{i}",
                    "finish_reason": "program_failed" if i == 0 else "completed",
                    "log_time": 3.0 + i,
                }
            )
        snapshot = status_snapshot({**HEALTH, "sandbox": "none"}, recent)
        self.assertEqual(snapshot["sandbox"], "none")
        failures = snapshot["failures"]
        self.assertEqual([f["reason"] for f in failures], ["respawn", "timeout"])
        self.assertEqual(failures[0]["event"], "worker_failed")
        self.assertEqual(len(failures[0]["message"]), 303)
        self.assertEqual(failures[1]["request_id"], "t1")
        self.assertEqual(failures[1]["http_status"], 504)
        self.assertEqual(len(snapshot["recent"]), 2)

    def test_template_failure_listed(self) -> None:
        """A failed worker template is a failure, and how workers start is shown."""
        recent = RecentRequests()
        recent(
            {
                "kcoral_event": "template_failed",
                "template": "gpu0",
                "reason": "socket closed",
                "log_time": 1.0,
            }
        )
        snapshot = status_snapshot({**HEALTH, "worker_start": "spawn"}, recent)
        self.assertEqual(snapshot["worker_start"], "spawn")
        [failure] = snapshot["failures"]
        self.assertEqual(
            (failure["event"], failure["reason"]), ("template_failed", "socket closed")
        )


class RefusalStatusTests(SynchronousTestCase):
    """/status shows the refusals: the last ones and a count by status and reason."""

    def test_refusals(self) -> None:
        recent = RecentRequests(max_refusals=2)
        log = Logger(namespace="kcoral.test", observer=LogPublisher(recent))
        for n, (status, reason) in enumerate(
            [(401, "unauthorized"), (408, "head_timeout"), (401, "unauthorized")]
        ):
            log.info(
                "refused",
                kcoral_event="request_refused",
                status=status,
                reason=reason,
                client="127.0.0.1",
                request_id=f"r{n}",
                path="/execute",
            )
        recent({"kcoral_event": "request_refused", "status": "odd", "reason": 3})
        snapshot = status_snapshot({}, recent)
        json.dumps(snapshot, allow_nan=False)
        self.assertEqual([r["request_id"] for r in snapshot["refusals"]], ["r2", "r1"])
        self.assertEqual(
            snapshot["refusals"][0],
            {
                "time": snapshot["refusals"][0]["time"],
                "status": 401,
                "reason": "unauthorized",
                "client": "127.0.0.1",
                "request_id": "r2",
                "path": "/execute",
            },
        )
        self.assertEqual(
            snapshot["refusal_counts"],
            [
                {"status": 401, "reason": "unauthorized", "count": 2},
                {"status": 408, "reason": "head_timeout", "count": 1},
            ],
        )
        self.assertIn(b'id="refusals"', STATUS_PAGE)
        self.assertIn(b'id="refusal_counts"', STATUS_PAGE)
