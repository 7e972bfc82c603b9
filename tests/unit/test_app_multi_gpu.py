"""
Tests for C{gpu_count} programs in L{kcoral.server.http.app.KcoralAPI}: the
one-request worker starts while no lease is held, on the least busy GPUs.
Fake pool and workers on a clock; the lease arbiter is the real one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from treq.testing import StubTreq
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.trial.unittest import SynchronousTestCase

from kcoral.config import ServerConfig
from kcoral.server.http.app import KcoralAPI
from kcoral.server.leases.lease import LeaseArbiter
from kcoral.server.workers.job import JobResult
from kcoral.testing.fakes import (
    FakeBlobs,
    FakeSandbox,
    FakeWorker,
    RecordingPool,
    SyncReactor,
    SyncThreadPool,
    seat_with,
)
from kcoral.testing.live_server import multipart_body
from kcoral.wire.channel import Outcome
from tests.unit.test_app import URL

PROGRAM = {
    "instructions": [
        {"op": "upload", "kind": "module", "id": "m", "source": "def f():\n    return 1\n"},
        {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
        {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": []},
        {"op": "return", "key": "r", "value": {"$ref": "r"}},
    ]
}


class MultiGpuTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.reactor = SyncReactor()
        self.leases = LeaseArbiter((0, 1), self.reactor)
        config = ServerConfig(device="gpu", gpus=(0, 1), max_request_bytes=4096)
        self.pool = RecordingPool(
            config,
            self.reactor,
            self.leases,
            FakeSandbox(),
            lambda f, *a, **k: maybeDeferred(f, *a, **k),
            Path("/nonexistent-kcoral-root"),
            preset=seat_with(FakeWorker(seat="gpu0/w0", gpus=(0,)), "gpu0/w0", gpu_id=0),
        )
        self.api = KcoralAPI(
            config,
            self.pool,
            self.leases,
            FakeBlobs(),
            SyncThreadPool(),
            self.reactor,
            started_at=0.0,
        )
        self.treq: Any = StubTreq(self.api.resource())

    def post(self, gpu_count: int) -> Deferred[Any]:
        content_type, body = multipart_body({**PROGRAM, "options": {"gpu_count": gpu_count}})
        return self.treq.post(URL, data=body, headers={"Content-Type": [content_type]})

    def test_worker_starts_without_a_lease(self) -> None:
        """While the two-GPU worker starts, both GPUs stay free for single-GPU requests."""
        response = self.post(2)
        [(seat, gpus, started)] = self.pool.starts
        self.assertIs(seat, self.pool.preset)
        self.assertEqual(gpus, (0, 1))
        self.assertEqual([self.leases.holder_of(g) for g in (0, 1)], [None, None])
        self.assertEqual([self.leases.depth(g) for g in (0, 1)], [0, 0])
        self.successResultOf(self.leases.acquire("single", (1,)))
        self.leases.release("single")

        outcome = Outcome(status="COMPLETED", results={"r": {"type": "integer", "value": 1}})
        worker = FakeWorker(gpus=(0, 1), result=JobResult("outcome", outcome=outcome))
        self.reactor.advance(6.0)  # the worker's start counts against the budget
        started.callback((worker, Path("/t/work")))
        self.treq.flush()
        done = self.successResultOf(response)
        self.assertEqual(done.code, 200)
        body = json.loads(self.successResultOf(self.treq.content(done)))
        self.assertEqual(body["status"], "COMPLETED")
        self.assertEqual((body["gpu_ids"], body["gpu_count"]), ([0, 1], 2))
        self.assertEqual(worker.jobs[0].workspace, "/t/work")
        self.assertEqual(worker.jobs[0].timeout_seconds, ServerConfig().default_timeout_seconds - 6)
        self.assertEqual(self.pool.removed, [worker])
        self.assertEqual([seat for seat, _ in self.pool.released], [self.pool.preset])

    def test_least_busy_gpu(self) -> None:
        """One GPU of two: the one nobody holds or waits for."""
        self.successResultOf(self.leases.acquire("single", (0,)))
        self.post(1)
        self.assertEqual(self.pool.starts[0][1], (1,))
