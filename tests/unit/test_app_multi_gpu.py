"""
Tests for C{gpu_count} programs in L{kcoral.server.app.KcoralAPI}: the
one-request worker starts while no lease is held, on the least busy GPUs.
Fake pool and workers on a clock; the lease arbiter is the real one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
from treq.testing import StubTreq
from twisted.internet.defer import Deferred, succeed
from twisted.trial.unittest import SynchronousTestCase

from kcoral.config import ServerConfig
from kcoral.server.app import KcoralAPI
from kcoral.server.lease import LeaseArbiter
from kcoral.server.workerproc import Job, JobResult
from kcoral.testing import multipart_body
from kcoral.wire.channel import Outcome
from tests.unit.test_app import URL, FakeBlobs, SyncReactor, SyncThreadPool

PROGRAM = {
    "instructions": [
        {"op": "upload", "kind": "module", "id": "m", "source": "def f():\n    return 1\n"},
        {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
        {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": []},
        {"op": "return", "key": "r", "value": {"$ref": "r"}},
    ]
}


@attrs.define(eq=False)
class _Worker:
    pid: int = 77
    jobs: list[Job] = attrs.field(factory=list)

    def run(self, job: Job) -> Deferred[JobResult]:
        self.jobs.append(job)
        outcome = Outcome(status="COMPLETED", results={"r": {"type": "integer", "value": 1}})
        return succeed(JobResult("outcome", outcome=outcome))


@attrs.define(eq=False)
class _Seat:
    worker_id: str = "gpu0/w0"
    gpu_id: int = 0
    generation: int = 1
    served: int = 0
    work_dir: Path = Path("/w")

    @property
    def gpus(self) -> tuple[int, ...]:
        return (self.gpu_id,)


class _Sandbox:
    reserved = None

    def worker_path(self, work_dir: Any) -> str:
        return str(work_dir)


@attrs.define(eq=False)
class _Pool:
    """Hands out one seat; records the one-request workers it is asked for."""

    seat: _Seat = attrs.field(factory=_Seat)
    sandbox: _Sandbox = attrs.field(factory=_Sandbox)
    starts: list[tuple[Any, tuple[int, ...], Deferred[Any]]] = attrs.field(factory=list)
    removed: list[Any] = attrs.field(factory=list)
    released: list[Any] = attrs.field(factory=list)
    capacity: int = 1
    active: int = 0
    queue_length: int = 0

    def acquire(self, timeout: float) -> Deferred[Any]:
        return succeed(self.seat)

    def release(self, seat: Any, *, retire: str | None = None) -> None:
        self.released.append(seat)

    def start_transient(self, seat: Any, gpus: tuple[int, ...]) -> Deferred[Any]:
        d: Deferred[Any] = Deferred()
        self.starts.append((seat, gpus, d))
        return d

    def remove_transient(self, worker: Any, work_dir: Path) -> Deferred[None]:
        self.removed.append(worker)
        return succeed(None)


class MultiGpuTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.reactor = SyncReactor()
        self.pool = _Pool()
        self.leases = LeaseArbiter((0, 1), self.reactor)
        self.api = KcoralAPI(
            ServerConfig(device="gpu", gpus=(0, 1), max_request_bytes=4096),
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
        self.assertIs(seat, self.pool.seat)
        self.assertEqual(gpus, (0, 1))
        self.assertEqual([self.leases.holder_of(g) for g in (0, 1)], [None, None])
        self.assertEqual([self.leases.depth(g) for g in (0, 1)], [0, 0])
        self.successResultOf(self.leases.acquire("single", (1,)))
        self.leases.release("single")

        worker = _Worker()
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
        self.assertEqual(self.pool.released, [self.pool.seat])

    def test_least_busy_gpu(self) -> None:
        """One GPU of two: the one nobody holds or waits for."""
        self.successResultOf(self.leases.acquire("single", (0,)))
        self.post(1)
        self.assertEqual(self.pool.starts[0][1], (1,))
