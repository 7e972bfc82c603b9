"""
Tests for L{kcoral.server.http.app.KcoralAPI} through treq's L{StubTreq}, with a
fake pool, blob store and thread pool: no processes, no network.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from treq.testing import StubTreq
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.testing import EventLoggingObserver
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource

from kcoral.config import ServerConfig
from kcoral.server.cache import Resolution
from kcoral.server.http.app import KcoralAPI
from kcoral.server.http.component import IKcoralRequest
from kcoral.server.leases.lease import LeaseArbiter
from kcoral.server.workers.compileonly import ParentCompiles
from kcoral.server.workers.job import JobResult
from kcoral.server.workers.pool import Seat
from kcoral.testing.fakes import (
    FakeBlobs,
    FakeSandbox,
    FakeWorker,
    RecordingPool,
    SyncReactor,
    SyncThreadPool,
    seat_with,
)
from kcoral.testing.live_server import multipart_body, sha256
from kcoral.wire.channel import CompileDone, Outcome
from kcoral.wire.multipart import decode_response
from kcoral.wire.values import decode_results

UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
URL = "http://127.0.0.1/execute"

PROGRAM = {
    "instructions": [
        {"op": "upload", "kind": "module", "id": "m", "source": "def f():\n    return 1\n"},
        {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
        {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": []},
        {"op": "return", "key": "r", "value": {"$ref": "r"}},
    ]
}


class APITestCase(SynchronousTestCase):
    def make(
        self, seat: Seat | None = None, busy: bool = False, blobs: FakeBlobs | None = None
    ) -> None:
        self.reactor = SyncReactor()
        self.reactor.advance(100.0)
        config = ServerConfig(device="cpu", num_workers=2, max_request_bytes=4096)
        self.pool = RecordingPool(
            config,
            self.reactor,
            LeaseArbiter((), self.reactor),
            FakeSandbox(),
            lambda f, *a, **k: maybeDeferred(f, *a, **k),
            Path("/nonexistent-kcoral-root"),
            preset=seat,
            saturated=busy,
        )
        self.api = KcoralAPI(
            config,
            self.pool,
            LeaseArbiter((), self.reactor),
            blobs or FakeBlobs(),
            SyncThreadPool(),
            self.reactor,
            started_at=90.0,
        )
        self.treq: Any = StubTreq(self.api.resource())

    def post(
        self, body: bytes, content_type: str, headers: dict[str, list[str]] | None = None
    ) -> tuple[Any, bytes]:
        all_headers = {"Content-Type": [content_type], **(headers or {})}
        response = self.successResultOf(self.treq.post(URL, data=body, headers=all_headers))
        content = self.successResultOf(self.treq.content(response))
        return response, content

    def execute(
        self, program: Any = PROGRAM, blobs: Sequence[bytes] = (), **headers: str
    ) -> tuple[Any, Any]:
        content_type, body = multipart_body(program, list(blobs))
        response, content = self.post(
            body, content_type, {k.replace("_", "-"): [v] for k, v in headers.items()}
        )
        return response, json.loads(content)

    def request_id(self, response: Any) -> str:
        values = response.headers.getRawHeaders("X-Request-ID")
        self.assertEqual(len(values), 1)
        return str(values[0])


class HealthTests(APITestCase):
    def test_health_body(self) -> None:
        self.make()
        response = self.successResultOf(self.treq.get("http://127.0.0.1/health"))
        self.assertEqual(response.code, 200)
        self.assertEqual(response.headers.getRawHeaders("Content-Type"), ["application/json"])
        body = json.loads(self.successResultOf(self.treq.content(response)))
        self.assertEqual(body["status"], "ok")
        self.assertTrue(UUID_RE.match(body["instance_id"]))
        self.assertTrue(body["started_at"].endswith("Z"))
        self.assertEqual(body["gpu_count"], 0)
        self.assertEqual(body["target"], {})
        self.assertEqual(body["gpus"], [])
        self.assertEqual(
            body["load"],
            {"request_capacity": 2, "requests_in_progress": 0, "requests_waiting": 0},
        )
        self.assertEqual(body["uptime_seconds"], 10.0)
        self.assertEqual(body["active_requests"], 0)
        self.assertEqual(body["queue_length"], 0)
        self.assertEqual(body["workers"][0]["gpu_id"], None)
        self.assertEqual(body["sandbox"], "none")

    def test_health_while_stopping(self) -> None:
        """
        In the lame duck, /health answers 503 with status C{stopping} (a load
        balancer's check fails) and the same figures.
        """
        self.make()
        self.api.stopping = True
        response = self.successResultOf(self.treq.get("http://127.0.0.1/health"))
        self.assertEqual(response.code, 503)
        body = json.loads(self.successResultOf(self.treq.content(response)))
        self.assertEqual(body["status"], "stopping")
        self.assertEqual(body["load"]["request_capacity"], 2)

    def test_health_follows_a_stopping_front_end(self) -> None:
        """
        With several front ends, one whose report says C{stopping} (the
        first, in its lame duck) makes every front end's /health say so.
        """
        self.make()
        peer = {**self.api.local_health(), "front_end": {"index": 1, "of": 2}}
        reports = {1: peer}
        self.api.peer_health = lambda: reports
        response = self.successResultOf(self.treq.get("http://127.0.0.1/health"))
        self.assertEqual(response.code, 200)
        reports[1] = {**peer, "status": "stopping"}
        response = self.successResultOf(self.treq.get("http://127.0.0.1/health"))
        self.assertEqual(response.code, 503)
        body = json.loads(self.successResultOf(self.treq.content(response)))
        self.assertEqual(body["status"], "stopping")

    def test_status_json_without_snapshot(self) -> None:
        self.make()
        response = self.successResultOf(self.treq.get("http://127.0.0.1/status.json"))
        body = json.loads(self.successResultOf(self.treq.content(response)))
        self.assertEqual(body["workers"][0]["worker_id"], "cpu/w0")

    def test_metrics_negotiated(self) -> None:
        """
        /metrics passes the scraper's C{Accept} and C{Accept-Encoding} on:
        OpenMetrics gzipped when both are asked for, plain text otherwise.
        (A bare agent: treq would ask for gzip and decode it itself.)
        """
        import gzip

        from treq import content
        from treq.testing import RequestTraversalAgent
        from twisted.web.http_headers import Headers

        from kcoral.server.observe.metrics import Metrics

        self.make()
        self.api.metrics = Metrics()
        agent = RequestTraversalAgent(self.api.resource())

        def get(headers: dict[bytes, list[bytes]]) -> tuple[Any, bytes]:
            response = self.successResultOf(
                agent.request(b"GET", b"http://127.0.0.1/metrics", Headers(headers))
            )
            body = content(response)
            agent.flush()
            return response, self.successResultOf(body)

        response, body = get(
            {
                b"Accept": [b"application/openmetrics-text; version=1.0.0"],
                b"Accept-Encoding": [b"gzip"],
            }
        )
        self.assertEqual(response.headers.getRawHeaders(b"Content-Encoding"), [b"gzip"])
        [content_type] = response.headers.getRawHeaders(b"Content-Type")
        self.assertTrue(content_type.startswith(b"application/openmetrics-text"))
        self.assertTrue(gzip.decompress(body).endswith(b"# EOF\n"))
        response, body = get({})
        self.assertIsNone(response.headers.getRawHeaders(b"Content-Encoding"))
        [content_type] = response.headers.getRawHeaders(b"Content-Type")
        self.assertTrue(content_type.startswith(b"text/plain"))
        self.assertIn(b"kcoral_requests_total", body)

    def test_metrics_absent(self) -> None:
        self.make()
        response = self.successResultOf(self.treq.get("http://127.0.0.1/metrics"))
        self.assertEqual(response.code, 404)


class _TooLarge(Resource):
    """Flags every request's component as too large, as LimitedRequest would."""

    isLeaf = True

    def __init__(self, inner: IResource) -> None:
        super().__init__()
        self._inner = inner

    def render(self, request: IRequest) -> Any:
        IKcoralRequest(request).too_large = True
        return self._inner.render(request)


class ExecuteErrorTests(APITestCase):
    def test_too_large_flag(self) -> None:
        self.make()
        # LimitedRequest sets this flag while the body arrives; StubTreq
        # serves plain Requests, so a resource in front sets it here.
        self.treq = StubTreq(_TooLarge(self.api.resource()))
        response, body = self.execute()
        self.assertEqual(response.code, 413)
        self.assertEqual(body["status"], "ERROR")
        self.assertEqual(body["error"]["kind"], "request_too_large")
        self.assertEqual(body["request_id"], self.request_id(response))

    def test_body_over_limit(self) -> None:
        self.make()
        blob = b"x" * 8192
        program = {
            "instructions": [
                {"op": "upload", "kind": "bytes", "id": "b", "blob": sha256(blob)},
                *PROGRAM["instructions"],
            ]
        }
        response, body = self.execute(program, [blob])
        self.assertEqual(response.code, 413)
        self.assertEqual(body["error"]["kind"], "request_too_large")

    def test_malformed_program(self) -> None:
        self.make()
        response, body = self.execute(b"{nope")
        self.assertEqual(response.code, 400)
        self.assertEqual(response.headers.getRawHeaders("Content-Type"), ["application/json"])
        self.assertEqual(body["status"], "ERROR")
        self.assertEqual(body["error"]["kind"], "parse")
        self.assertEqual(body["request_id"], self.request_id(response))

    def test_invalid_program(self) -> None:
        self.make()
        response, body = self.execute({"instructions": []})
        self.assertEqual(response.code, 400)
        self.assertEqual(body["error"]["message"], "'instructions' must be a non-empty array")

    def test_not_multipart(self) -> None:
        self.make()
        response, content = self.post(b"{}", "application/json")
        self.assertEqual(response.code, 400)
        self.assertEqual(json.loads(content)["error"]["kind"], "parse")

    def test_cache_miss(self) -> None:
        self.make()
        digest = sha256(b"missing")
        program = {
            "instructions": [
                {"op": "upload", "kind": "bytes", "id": "b", "blob": digest},
                *PROGRAM["instructions"],
            ]
        }
        response, body = self.execute(program)
        self.assertEqual(response.code, 200)
        self.assertEqual(
            body,
            {
                "status": "CACHE_MISS",
                "request_id": self.request_id(response),
                "missing_blobs": [digest],
            },
        )

    def test_busy(self) -> None:
        self.make(busy=True)
        response, body = self.execute()
        self.assertEqual(response.code, 503)
        self.assertEqual(response.headers.getRawHeaders("Retry-After"), ["1"])
        self.assertEqual(
            body,
            {
                "status": "ERROR",
                "request_id": self.request_id(response),
                "error": {"kind": "busy", "message": "server saturated"},
            },
        )

    def test_stopping(self) -> None:
        """
        A request the stopping pool cannot take is a 503 that says the
        server is stopping, not that it is saturated.
        """
        self.make()
        self.pool.stop_waiters()
        response, body = self.execute()
        self.assertEqual(response.code, 503)
        self.assertEqual(response.headers.getRawHeaders("Retry-After"), ["1"])
        self.assertEqual(body["error"], {"kind": "busy", "message": "server stopping"})

    def test_gpu_count_on_cpu(self) -> None:
        self.make()
        response, body = self.execute({**PROGRAM, "options": {"gpu_count": 1}})
        self.assertEqual(response.code, 400)
        self.assertEqual(
            body["error"]["message"], "gpu_count exceeds this GPU server's configured capacity"
        )


class ErrorHandlingTests(APITestCase):
    """The one error handler: domain errors, surprises and routing errors."""

    def test_unknown_route_keeps_404(self) -> None:
        """A path with no route is still Klein's plain 404."""
        self.make()
        response = self.successResultOf(self.treq.get("http://127.0.0.1/nope"))
        self.assertEqual(response.code, 404)

    def test_wrong_method_keeps_405(self) -> None:
        """A route asked with the wrong method is still a 405."""
        self.make()
        response = self.successResultOf(self.treq.get(URL))
        self.assertEqual(response.code, 405)

    def test_unexpected_error_is_engine_500(self) -> None:
        """An exception nobody expected is logged and answered as a 500."""

        class Broken(FakeBlobs):
            def resolve(self, kinds: Any, supplied: Any) -> Deferred[Resolution]:
                raise ZeroDivisionError("surprise")

        self.make(blobs=Broken())
        response, body = self.execute()
        self.assertEqual(response.code, 500)
        self.assertEqual(
            body,
            {
                "status": "ERROR",
                "request_id": self.request_id(response),
                "error": {"kind": "engine", "message": "internal server error"},
            },
        )
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)


class RequestIdTests(APITestCase):
    def test_valid_id_echoed(self) -> None:
        self.make()
        rid = str(uuid.uuid4())
        response, body = self.execute(b"{bad", X_Request_ID=rid)
        self.assertEqual(self.request_id(response), rid)
        self.assertEqual(body["request_id"], rid)

    def test_uppercase_replaced(self) -> None:
        self.make()
        rid = str(uuid.uuid4()).upper()
        response, body = self.execute(b"{bad", X_Request_ID=rid)
        chosen = self.request_id(response)
        self.assertNotEqual(chosen.lower(), rid.lower())
        self.assertTrue(UUID_RE.match(chosen))
        self.assertEqual(body["request_id"], chosen)

    def test_duplicated_replaced(self) -> None:
        self.make()
        rid = str(uuid.uuid4())
        content_type, data = multipart_body(PROGRAM)
        response, content = self.post(data, content_type, {"X-Request-ID": [rid, rid]})
        chosen = self.request_id(response)
        self.assertNotEqual(chosen, rid)
        self.assertEqual(json.loads(content)["request_id"], chosen)

    def test_missing_generated(self) -> None:
        self.make()
        response, body = self.execute(b"{bad")
        self.assertTrue(UUID_RE.match(self.request_id(response)))
        self.assertEqual(body["request_id"], self.request_id(response))


class RunTests(APITestCase):
    def run_with(self, result: JobResult, **options: Any) -> tuple[Any, Any]:
        self.worker = FakeWorker(result=result)
        self.make(seat_with(self.worker))
        program = {**PROGRAM, "options": options} if options else PROGRAM
        return self.execute(program)

    def test_client_address_for_reuse_scope(self) -> None:
        """The pool is told the client's address (the reuse scope's identity)."""
        self.run_with(JobResult("outcome", outcome=Outcome(status="COMPLETED")))
        pool = self.api.pool
        self.assertEqual(len(pool.clients), 1)
        self.assertIsInstance(pool.clients[0], str)

    def test_completed(self) -> None:
        outcome = Outcome(
            status="COMPLETED",
            results={"r": {"type": "integer", "value": 1}},
            stdout="hi\n",
        )
        response, body = self.run_with(JobResult("outcome", outcome=outcome), timeout_seconds=5000)
        self.assertEqual(response.code, 200)
        self.assertEqual(body["status"], "COMPLETED")
        self.assertEqual(body["results"], {"r": {"type": "integer", "value": 1}})
        self.assertEqual(body["stdout"], "hi\n")
        self.assertEqual(body["request_id"], self.request_id(response))
        self.assertEqual(body["lease_wait_ms"], 0)
        self.assertEqual(body["lease_held_ms"], 0)
        # The timeout is clamped to the server's maximum.
        self.assertEqual(self.worker.jobs[0].timeout_seconds, 900)
        # Default mode: the seat retires after one request.
        self.assertEqual(self.pool.released[0][1], "request_limit")

    def test_timeout(self) -> None:
        response, body = self.run_with(JobResult("timeout", instruction_index=2))
        self.assertEqual(response.code, 504)
        self.assertEqual(
            body,
            {
                "status": "ERROR",
                "request_id": self.request_id(response),
                "error": {"kind": "timeout", "message": "execution timed out"},
            },
        )
        self.assertEqual(self.pool.released[0][1], "timeout")

    def test_crash_in_instruction(self) -> None:
        response, body = self.run_with(JobResult("crashed", instruction_index=2, exit_code=3))
        self.assertEqual(response.code, 200)
        self.assertEqual(body["status"], "FAILED")
        self.assertEqual(body["error"]["kind"], "runtime")
        self.assertEqual(body["error"]["instruction_index"], 2)
        self.assertEqual(body["error"]["instruction_op"], "run")
        self.assertEqual(body["error"]["message"], "worker exited while executing the instruction")
        self.assertEqual(self.pool.released[0][1], "crashed")

    def test_crash_outside_instruction(self) -> None:
        response, body = self.run_with(JobResult("crashed", exit_code=3))
        self.assertEqual(response.code, 500)
        self.assertEqual(body["error"], {"kind": "engine", "message": "worker crashed"})

    def test_invalid_worker_reply(self) -> None:
        response, body = self.run_with(JobResult("invalid", detail="a 'ready' message"))
        self.assertEqual(response.code, 500)
        self.assertEqual(body["error"]["kind"], "engine")
        self.assertEqual(body["error"]["message"], "invalid worker response: a 'ready' message")
        self.assertEqual(self.pool.released[0][1], "channel_violation")


COMPILE = {
    "instructions": [
        {
            "op": "upload",
            "kind": "module",
            "id": "src",
            "language": "cuda",
            "source": "__global__ void k(float *p) { p[0] = 1; }\n",
        },
        {"op": "get_function", "id": "fn", "module": {"$ref": "src"}, "name": "k"},
        {
            "op": "run",
            "id": "image",
            "fn": "builtin.compile_cuda_binary",
            "args": [{"$ref": "fn"}, {"arch": "sm_90a"}],
        },
        {"op": "return", "key": "image", "value": {"$ref": "image"}},
    ]
}


class _Compiler:
    """An image compiler that answers every request with C{answer}."""

    def __init__(self, answer: tuple[Any, bytes | None]) -> None:
        self.answer = answer
        self.asked: list[Any] = []

    async def compile_image(self, request: Any, timeout: float, *, available: bool = False) -> Any:
        self.asked.append(request)
        return self.answer


class ParentCompileTests(APITestCase):
    """
    A compile-only program on a server that compiles for its workers is run
    by the server itself: a seat of the pool is held, its worker runs nothing.
    """

    def run_compile(self, answer: tuple[Any, bytes | None], program: Any = COMPILE) -> Any:
        assert isinstance(answer[0], CompileDone)
        self.worker = FakeWorker(result=JobResult("outcome", outcome=Outcome(status="COMPLETED")))
        self.make(seat_with(self.worker))
        self.compiler = _Compiler(answer)
        self.api.parent_compiles = ParentCompiles(
            self.compiler, self.reactor, lambda f, *a: maybeDeferred(f, *a)
        )
        self.events = EventLoggingObserver.createWithCleanup(self, self.api.log.observer)
        content_type, body = multipart_body(program, [])
        return self.post(body, content_type)

    def event(self, name: str) -> dict[str, Any]:
        [found] = [e for e in self.events if e.get("kcoral_event") == name]
        return found

    def test_compiled_without_a_worker(self) -> None:
        """The image comes back; the worker ran nothing; the seat was held and given back."""
        response, content = self.run_compile((CompileDone(key="ab" * 32), b"\x7fELF image"))
        self.assertEqual(response.code, 200)
        body, parts = decode_response(response.headers.getRawHeaders("content-type")[0], content)
        self.assertEqual(body["status"], "COMPLETED")
        self.assertEqual(decode_results(body["results"], parts), {"image": b"\x7fELF image"})
        self.assertEqual(self.worker.jobs, [])
        self.assertEqual(self.pool.released, [])
        self.assertEqual(len(self.pool.given_back), 1)
        routed = self.event("request_routed")
        self.assertEqual(
            (routed["route"], routed["worker_id"], routed["seat"]),
            ("parent_compile", None, "cpu/w0"),
        )
        finished = self.event("request_finished")
        self.assertEqual((finished["finish_reason"], finished["worker_id"]), ("completed", None))
        self.assertEqual(len(self.compiler.asked), 1)

    def test_compile_error(self) -> None:
        """The parent's compile error is the program's, at its instruction."""
        response, content = self.run_compile((CompileDone(kind="compile", error="bad"), None))
        body = json.loads(content)
        self.assertEqual(body["status"], "FAILED")
        self.assertEqual(
            {k: body["error"][k] for k in ("kind", "message", "instruction_index")},
            {"kind": "compile", "message": "bad", "instruction_index": 2},
        )
        self.assertEqual(self.event("request_finished")["error_kind"], "compile")

    def test_needs_a_worker(self) -> None:
        """A backend the server cannot run: the program goes to a worker after all."""
        response, content = self.run_compile((CompileDone(kind="unavailable", error="x"), None))
        self.assertEqual(json.loads(content)["status"], "COMPLETED")
        self.assertEqual(len(self.worker.jobs), 1)
        self.assertEqual(len(self.pool.given_back), 1)
        self.event("request_rerouted")

    def test_other_programs_go_to_workers(self) -> None:
        """A program that does anything else runs on a worker."""
        self.run_compile((CompileDone(key="ab" * 32), b"image"), PROGRAM)
        self.assertEqual(self.compiler.asked, [])
        self.assertEqual(len(self.worker.jobs), 1)
        self.assertEqual(self.pool.given_back, [])
