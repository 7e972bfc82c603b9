# -*- test-case-name: tests.unit.test_app -*-
"""
The HTTP API: C{GET /health}, C{POST /execute}, C{GET /metrics}, C{GET /status}.

L{KcoralAPI} holds a class-level C{Klein()} and receives everything it needs
(config, pool, leases, blob store, thread pool, clock) in its constructor.
Handlers never block: body parsing, hashing and program records run in the
thread pool, programs run in worker processes.
"""

from __future__ import annotations

import functools
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import attrs
from klein import Klein
from twisted.internet.defer import CancelledError, Deferred, fail
from twisted.internet.interfaces import IReactorFromThreads, IReactorTime
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource
from werkzeug.exceptions import HTTPException

from kcoral.config import ServerConfig
from kcoral.ipc.shared import SharedBuffer
from kcoral.server.cache import Resolution
from kcoral.server.http.component import IKcoralRequest, client_identity
from kcoral.server.http.pipeline import (
    INLINE_PARSE_BYTES,
    Parsed,
    RequestPipeline,
)
from kcoral.server.http.pipeline import header as _header
from kcoral.server.http.pipeline import iso_utc as _iso_utc
from kcoral.server.http.pipeline import response_request_id as _response_request_id
from kcoral.server.http.streaming import BodyProducer, DirectSocket, body_length, shared_bytes
from kcoral.server.leases.lease import PURPOSES, Leases
from kcoral.server.observe.health import merge_health
from kcoral.server.workers.compileonly import PARENT_COMPILE, ParentCompiles, is_compile_only
from kcoral.server.workers.job import Job, JobResult
from kcoral.server.workers.pool import (
    STOPPING_MESSAGE,
    BudgetSpent,
    PoolBusy,
    PoolStopping,
    WorkerPool,
    WorkerStartFailed,
)
from kcoral.server.workers.reactor import shielded
from kcoral.server.workers.seat import hold_seat_only
from kcoral.wire.errors import (
    BUSY_MESSAGE,
    REQUEST_KIND_HEADERS,
    REQUEST_TOO_LARGE_MESSAGE,
    TIMEOUT_MESSAGE,
    choose_request_id,
)
from kcoral.wire.jsontext import json_dumps
from kcoral.wire.multipart import (
    RequestTooLarge,
    check_tensor_lengths,
)
from kcoral.wire.program import (
    BUILTIN_NAMES,
    Upload,
    ValidationError,
    clamp_options,
    parse_program,
)
from kcoral.wire.render import (
    FIELD_LIMIT,
    Body,
    Placement,
    Rendered,
    RequestError,
    render_cache_miss,
    render_result,
)

if TYPE_CHECKING:
    from kcoral.server.observe.metrics import Metrics


__all__ = ["Answer", "BlobResolver", "FetchMissing", "KcoralAPI", "RequestError"]

#: Gets the blobs, by digest, that the caches lack for an in-process
#: request (L{KcoralAPI.execute_program}); raises a L{RequestError} when it
#: cannot.
FetchMissing = Callable[[list[str]], Awaitable[Mapping[str, bytes | SharedBuffer]]]


@attrs.frozen
class Answer:
    """
    What C{/execute} answers a program run in process
    (L{KcoralAPI.execute_program}): the status, content type, headers
    beyond those two, and body (chunks: large parts are the worker's
    sealed buffers, to be streamed as they are).
    """

    status: int
    content_type: str
    body: Body
    headers: Mapping[str, str] = attrs.field(factory=dict)
    #: Logs the request's C{request_finished} event, when the caller asked
    #: to log it itself (C{execute_program}'s C{finish_later}): once the
    #: answer is on its way; C{None}: logged already.
    finish: Callable[[], None] | None = attrs.field(default=None, eq=False)

    @property
    def length(self) -> int:
        """The body's length in bytes."""
        return len(self.body) if isinstance(self.body, bytes) else body_length(self.body)


class NotAdmitted(Exception):
    """An in-process request its gate kept out of the seat line (L{KcoralAPI.execute_program})."""


def _program_only(data: bytes) -> Parsed:
    """A request of a program's JSON and no blob parts, validated (any thread)."""
    program = parse_program(data, builtin_names=BUILTIN_NAMES)
    return Parsed(program, data, {}, len(data))


class BlobResolver(Protocol):
    """Finds a request's blobs (L{kcoral.server.cache.BlobStore}, or a fake)."""

    def resolve(
        self,
        program_blobs: Mapping[str, frozenset[str]],
        supplied: Mapping[str, bytes | SharedBuffer],
    ) -> Awaitable[Resolution]:
        """Cache the supplied blobs and look up the rest."""


@attrs.define(eq=False)
class KcoralAPI(RequestPipeline):
    """The routes, bound to one server's state."""

    config: ServerConfig
    pool: WorkerPool
    leases: Leases
    blobs: BlobResolver
    _threadpool: ThreadPool
    _reactor: IReactorTime
    instance_id: str = attrs.field(factory=lambda: str(uuid.uuid4()))
    started_at: float = 0.0
    save_program: Callable[[str, bytes], Deferred[str | None]] | None = None
    metrics: Metrics | None = None
    status_snapshot: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    status_page: bytes | None = None
    #: This process's index among the server's front ends
    #: (L{kcoral.server.topology}; C{0}: the first, or the only one).
    front_end: int = 0
    #: With several front ends: the other front ends' last health reports,
    #: by index (L{kcoral.server.frontends}); C{None} in a lone server.
    peer_health: Callable[[], dict[int, dict[str, Any]]] | None = None
    sandbox_name: str = "none"
    #: Runs compile-only programs in this process, without a worker
    #: (L{kcoral.server.workers.compileonly}), where the server compiles
    #: for its workers anyway (a CPU server under bubblewrap with a compile
    #: cache); C{None}: every program goes to a worker.
    parent_compiles: ParentCompiles | None = None
    in_flight: int = 0
    #: The server is stopping (its lame duck, L{kcoral.server.service}):
    #: /health answers 503 C{stopping} while every request is still served.
    stopping: bool = False
    _idle_waiters: list[Deferred[None]] = attrs.field(factory=list)
    _draining: bool = False

    app = Klein()
    log = Logger()

    def resource(self) -> IResource:
        """The Twisted resource to serve."""
        return self.app.resource()

    # -- /health ------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """
        The /health body: the 0.1.1 fields plus the documented ones; with
        several front ends, for the whole server (this process's figures
        with the others' last reports,
        L{kcoral.server.observe.health.merge_health}).
        """
        own = self.local_health()
        if self.peer_health is None:
            return own
        peers = self.peer_health()
        merged = merge_health(own, peers, self.front_end)
        if any(h.get("status") == "stopping" for h in peers.values()):
            # The first front end is in its lame duck: every front end says so.
            merged["status"] = "stopping"
        return merged

    def local_health(self) -> dict[str, Any]:
        """This process's own /health figures (its seats, spares and queue)."""
        now = self._reactor.seconds()
        pool = self.pool
        gpus = sorted(set(self.config.gpus)) if self.config.device == "gpu" else []
        return {
            "status": "stopping" if self.stopping else "ok",
            "instance_id": self.instance_id,
            "started_at": _iso_utc(self.started_at),
            "gpu_count": len(gpus),
            "load": {
                "request_capacity": pool.capacity,
                "requests_in_progress": pool.active,
                "requests_waiting": pool.queue_length,
            },
            "target": dict(pool.target),
            "versions": dict(pool.versions),
            "uptime_seconds": round(max(0.0, now - self.started_at), 3),
            "active_requests": pool.active,
            "queue_length": pool.queue_length,
            "gpus": [
                {
                    "gpu_id": gpu,
                    "lease_depth": self.leases.depth(gpu),
                    "holder": _holder_name(self.leases.holder_of(gpu)),
                    # Context creations/teardowns holding it now (never
                    # beside a holder).
                    "maintenance": len(self.leases.maintainers_of(gpu)),
                    # Hardware work queues of each worker's context
                    # (--cuda-connections): streams beyond them share one.
                    "work_queues": self.config.work_queues,
                    "spares_ready": sum(
                        1
                        for spare in pool.spare_status(now)
                        if spare["gpu_id"] == gpu and spare["state"] == "ready"
                    ),
                }
                for gpu in gpus
            ],
            "workers": pool.worker_status(now),
            # Warm workers that refill seats; they take no request themselves,
            # so they are not in request_capacity.
            "spares": pool.spare_status(now),
            "sandbox": self.sandbox_name,
            "worker_start": pool.worker_start,
            "templates": {t.name: t.state for t in pool.templates.values()},
            # This process's place among the server's front ends (--front-ends):
            # its load, workers and spares above are its own share.
            "front_end": {"index": self.front_end, "of": self.config.front_ends},
        }

    @app.route("/health", methods=["GET"])
    def _health(self, request: IRequest) -> bytes:
        # A stopping server answers 503: load balancers take it out of rotation.
        return self.health_answer(request)

    @app.route("/metrics", methods=["GET"])
    def _metrics(self, request: IRequest) -> bytes:
        if self.metrics is None:
            request.setResponseCode(404)
            return b""
        peers = None
        if self.peer_health is not None:
            from kcoral.server.observe.metrics import METRICS_REPORT_KEY, unpack_families

            own = self.front_end
            peers = {
                index: unpack_families(health[METRICS_REPORT_KEY])
                for index, health in self.peer_health().items()
                if index != own and METRICS_REPORT_KEY in health
            }
        body, headers = self.metrics.expose(
            peers,
            self.front_end,
            accept=_header(request, b"accept"),
            accept_encoding=_header(request, b"accept-encoding"),
        )
        for name, value in headers.items():
            request.setHeader(name.encode(), value.encode())
        return body

    @app.route("/status", methods=["GET"])
    def _status(self, request: IRequest) -> bytes:
        request.setHeader(b"Content-Type", b"text/html; charset=utf-8")
        return self.status_page or b"<!doctype html><title>kcoral status</title>"

    @app.route("/status.json", methods=["GET"])
    def _status_json(self, request: IRequest) -> bytes:
        request.setHeader(b"Content-Type", b"application/json")
        health = self.health()
        body = self.status_snapshot(health) if self.status_snapshot else health
        return json_dumps(body)

    # -- /execute -----------------------------------------------------------

    @app.route("/execute", methods=["POST"])
    async def _execute(self, request: IRequest) -> bytes:
        request_id = choose_request_id(request.requestHeaders.getRawHeaders(b"x-request-id"))
        request.setHeader(b"X-Request-ID", request_id.encode())
        self._enter()
        try:
            d = Deferred.fromCoroutine(self._handle(request, request_id))
            if self.config.finish_abandoned:
                # The operator wants abandoned programs run to the end.
                rendered = await shielded(d, lambda f: self._orphaned(request_id, f))
            else:
                # Klein cancels this handler when the client disconnects: the
                # cancellation reaches the queue (the request leaves the
                # line) or the running program (its worker is replaced).
                try:
                    rendered = await d
                except CancelledError:
                    self._finished(request_id, 499, "abandoned")
                    raise
        finally:
            self._leave()
        request.setResponseCode(rendered.status)
        request.setHeader(b"Content-Type", rendered.content_type.encode())
        body = rendered.body
        if isinstance(body, list):
            # A multipart body: write its chunks as they are (binary parts
            # can be hundreds of MiB; joining them would copy them again).
            request.setHeader(b"Content-Length", str(body_length(body)).encode())
            if all(isinstance(chunk, bytes) for chunk in body):
                for chunk in body:
                    request.write(chunk)
                return b""
            # Large parts are the worker's sealed buffers: stream them a
            # slice at a time, counted as bytes in flight meanwhile.
            IKcoralRequest(request).hold_bytes(shared_bytes(body))
            producer = BodyProducer(request, body, direct=DirectSocket.of(request))
            total, shared = body_length(body), shared_bytes(body)
            del rendered, body
            started = self._reactor.seconds()
            try:
                await producer.start()
            except CancelledError:
                producer.stop()
                raise
            self.log.info(
                "request {request_id}: {written} of {bytes} response bytes streamed",
                kcoral_event="response_streamed",
                request_id=request_id,
                bytes=total,
                shared_bytes=shared,
                written=producer.written,
                sent_directly=producer.sent_directly,
                complete=producer.written == total,
                elapsed_ms=(self._reactor.seconds() - started) * 1000.0,
            )
            return b""
        return body

    @app.handle_errors(Exception)
    def _failed(self, request: IRequest, failure: Failure) -> bytes | Deferred[bytes]:
        """
        The one place a failed request becomes an ERROR body: domain errors
        map to their request error kind (protocol §9.2), anything else is
        logged and answered as an internal C{engine} error.
        """
        if failure.check(HTTPException, CancelledError):
            # Routing errors (404, 405) keep Klein's answers.
            return fail(failure)
        request_id = _response_request_id(request)
        return self.error_answer(request, request_id, self._request_error(request_id, failure))

    def _orphaned(self, request_id: str, failure: Failure) -> None:
        """A request whose client left failed: log how it finished anyway."""
        if failure.check(CancelledError):
            return
        error = self._request_error(request_id, failure)
        self._finished(request_id, error.status, error.finish_reason, **error.fields)

    def _request_error(self, request_id: str, failure: Failure) -> RequestError:
        """The request error kind, message and log fields of C{failure}."""
        error = failure.value
        if isinstance(error, RequestError):
            return error
        if isinstance(error, RequestTooLarge):
            return _too_large()
        if isinstance(error, ValidationError):
            return _invalid(error)
        if isinstance(error, PoolStopping):
            return RequestError("busy", STOPPING_MESSAGE, "no_worker", queue_ms=error.queue_ms)
        if isinstance(error, PoolBusy):
            return RequestError("busy", BUSY_MESSAGE, "no_worker", queue_ms=error.queue_ms)
        if isinstance(error, WorkerStartFailed):
            return RequestError(
                "engine", "worker crashed", "crashed", error_message=str(error)[:FIELD_LIMIT]
            )
        if isinstance(error, BudgetSpent):
            return RequestError("timeout", TIMEOUT_MESSAGE, "timeout")
        self.log.failure("unhandled error in request {request_id}", failure, request_id=request_id)
        return RequestError(
            "engine",
            "internal server error",
            "server_error",
            error_kind="unhandled",
            error_message=f"{type(error).__name__}: {error}"[:FIELD_LIMIT],
        )

    def _enter(self) -> None:
        self.in_flight += 1

    def _leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            waiters, self._idle_waiters = self._idle_waiters, []
            for waiter in waiters:
                waiter.callback(None)

    def wait_idle(self) -> Deferred[None]:
        """Fires once no /execute request is in flight (graceful shutdown)."""
        d: Deferred[None] = Deferred()
        if self.in_flight == 0:
            d.callback(None)
        else:
            self._idle_waiters.append(d)
        return d

    async def _handle(self, request: IRequest, request_id: str) -> Rendered:
        state = IKcoralRequest(request)
        self.log.info(
            "request {request_id} received",
            kcoral_event="request_received",
            request_id=request_id,
            client=state.peer,
            client_name=state.client_name,
            content_length=_header(request, b"content-length"),
            body_ms=_ms(state.body_seconds),
        )
        rendered = await self._admit_and_run(request, request_id)
        self._finished(request_id, rendered.status, rendered.finish_reason, **rendered.fields)
        return rendered

    async def execute_program(
        self,
        request_id: str,
        program: bytes,
        client: str | None,
        *,
        fetch: FetchMissing | None = None,
        admitted: Callable[[], None] | None = None,
        gate: Callable[[], Deferred[bool]] | None = None,
        via: str = "in_process",
        finish_later: bool = False,
    ) -> Answer:
        """
        Run C{program} (a program's JSON) as C{/execute} runs a request
        once its body is parsed, without HTTP: the same validation, blob
        caches, size and time limits, seat line, worker, rendering, request
        events (so metrics and logs) and saved program.  Blobs the caches
        lack come from C{fetch} and are cached as uploaded ones; a
        L{RequestError} it raises is the answer.  Never fails: every
        failure is the answer C{/execute} would give.

        @param client: the request's client for the reuse scope.
        @param admitted: called once the request goes to the seat line.
        @param gate: asked before the request goes to the seat line: C{False}
            ends it there, unrun, with C{finish_reason} C{claim_lost} (a
            pool job whose claim another node won, or the gateway's cancel:
            its checks ran while the claim was on its way).
        @param via: the C{request_received} event's C{via} field.
        @param finish_later: the C{request_finished} event of an answered
            program is left to the caller (L{Answer.finish}), to log once
            the answer is on its way rather than in front of it.
        """
        self._enter()
        try:
            self.log.info(
                "request {request_id} received",
                kcoral_event="request_received",
                request_id=request_id,
                client=client,
                client_name=None,
                content_length=len(program),
                body_ms=None,
                via=via,
            )
            try:
                if len(program) > self.config.max_request_bytes:
                    raise RequestTooLarge()
                if len(program) <= INLINE_PARSE_BYTES:
                    parsed = _program_only(program)
                else:
                    parsed = await deferToThreadPool(
                        IReactorFromThreads(self._reactor), self._threadpool, _program_only, program
                    )
                rendered = await self._admit(
                    request_id, parsed, client, None, fetch, admitted, gate
                )
            except NotAdmitted:
                self._finished(request_id, 409, "claim_lost")
                return Answer(409, "application/json", b"")
            except Exception:
                error = self._request_error(request_id, Failure())
                self._finished(request_id, error.status, error.finish_reason, **error.fields)
                return Answer(
                    error.status,
                    "application/json",
                    error.body(request_id),
                    REQUEST_KIND_HEADERS.get(error.kind, {}),
                )
            finish = functools.partial(
                self._finished,
                request_id,
                rendered.status,
                rendered.finish_reason,
                **rendered.fields,
            )
            if not finish_later:
                finish()
            return Answer(
                rendered.status,
                rendered.content_type,
                rendered.body,
                finish=finish if finish_later else None,
            )
        finally:
            self._leave()

    def max_request_bytes(self) -> int:
        return self.config.max_request_bytes

    async def _admit_and_run(self, request: IRequest, request_id: str) -> Rendered:
        parsed = await self._parse(request)
        # The upload as the server sees it, until its blobs were hashed and sealed.
        body_ready = IKcoralRequest(request).since_head()
        return await self._admit(request_id, parsed, client_identity(request), body_ready)

    async def _admit(
        self,
        request_id: str,
        parsed: Parsed,
        client: str | None,
        body_ready: float | None,
        fetch: FetchMissing | None = None,
        admitted: Callable[[], None] | None = None,
        gate: Callable[[], Deferred[bool]] | None = None,
    ) -> Rendered:
        """
        A parsed request from its blob lookup to its rendered answer.

        @param fetch: gets the blobs the caches lack (an in-process job's
            blobs, L{execute_program}); without it a miss is a CACHE_MISS.
        @param admitted: called once the request goes to the pool's line.
        @param gate: asked before missing blobs are fetched and before the
            line (L{execute_program}).

        @raise NotAdmitted: the gate said no.
        """
        config = self.config
        program = parsed.program
        kinds: dict[str, frozenset[str]] = {}
        for digest in program.referenced_blobs():
            kinds[digest] = program.blob_kinds(digest)
        resolution = await self.blobs.resolve(kinds, parsed.blobs)
        if resolution.missing and fetch is not None:
            # Blobs are fetched only for a request its gate lets in (a pool
            # job whose claim this node won).
            if gate is not None and not await gate():
                raise NotAdmitted()
            # Fetched blobs are supplied ones: they go to the caches as an
            # upload's would, so the next job finds them there.
            supplied = dict(parsed.blobs)
            supplied.update(await fetch(list(resolution.missing)))
            resolution = await self.blobs.resolve(kinds, supplied)
        try:
            if resolution.missing:
                return render_cache_miss(request_id, list(resolution.missing))
            check_tensor_lengths(program, {d: len(b) for d, b in resolution.found.items()})
            gpu_count = program.options.gpu_count
            if gpu_count is not None:
                capacity = 0 if config.device == "cpu" else len(set(config.gpus))
                if gpu_count > capacity:
                    raise RequestError(
                        "parse",
                        "gpu_count exceeds this GPU server's configured capacity",
                        "invalid_request",
                        error_kind="parse",
                    )
            timeout, output_limit = clamp_options(
                program.options,
                default_timeout=config.default_timeout_seconds,
                max_timeout=config.max_timeout_seconds,
                default_output_limit=config.output_limit_bytes,
                max_output_limit=config.max_output_limit_bytes,
            )
            saved = None
            if self.save_program is not None:
                saved = await self.save_program(request_id, parsed.program_bytes)
            uploads = Counter(i.kind for i in program.instructions if isinstance(i, Upload))
            self.log.info(
                "request {request_id} accepted",
                kcoral_event="request_accepted",
                request_id=request_id,
                request_bytes=parsed.request_bytes,
                timeout_seconds=timeout,
                program=saved,
                instructions=len(program.instructions),
                ops=dict(Counter(i.op for i in program.instructions)),
                uploads=dict(uploads) or None,
                blob_bytes=sum(len(b) for b in resolution.found.values()) or None,
                body_ready_ms=_ms(body_ready),
            )
            job = Job(
                request_id=request_id,
                program_text=parsed.program_bytes.decode("utf-8"),
                program=program,
                blobs=resolution.found,
                timeout_seconds=timeout,
                output_limit=output_limit,
                max_response_bytes=config.max_response_bytes,
            )
            if gate is not None and not await gate():
                raise NotAdmitted()
            if admitted is not None:
                admitted()
            return await self._run(request_id, job, client)
        finally:
            resolution.pin.release()

    async def _run(self, request_id: str, job: Job, client: str | None) -> Rendered:
        """Run C{job} on a seat of the pool and render how it ended."""
        if self.parent_compiles is not None and is_compile_only(job.program):
            ran = await self._compile_in_parent(request_id, job, client, self.parent_compiles)
            if isinstance(ran, Rendered):
                return ran
            # A compile needs a worker after all: the rest of the budget is its.
            job = ran
        gpu_count = job.program.options.gpu_count
        async with self.pool.seat(request_id, gpu_count, client) as use:
            if use.multi_gpu:
                message = "request {request_id} routed to a worker on GPUs {gpu_ids}"
            else:
                message = "request {request_id} routed to {worker_id}"
            self.log.info(
                message,
                kcoral_event="request_routed",
                request_id=request_id,
                worker_id=use.worker_id,
                gpu_id=use.gpu_id,
                gpu_ids=list(use.gpus) if use.multi_gpu else None,
                generation=use.generation,
                pid=use.pid,
                queue_ms=use.queue_ms,
                **({"startup_ms": use.startup_seconds * 1000.0} if use.multi_gpu else {}),
            )
            result = await use.run(job)
            elapsed_ms = (self._reactor.seconds() - use.assigned_at) * 1000.0
            where = use.placement
            return render_result(
                request_id,
                job.program,
                result,
                where,
                timeout_seconds=use.timeout_seconds or job.timeout_seconds,
                queue_ms=use.queue_ms,
                elapsed_ms=elapsed_ms,
                max_response_bytes=self.config.max_response_bytes,
                interferer=lambda error: self._interferer(request_id, where.gpu_id, error, result),
            )

    async def _compile_in_parent(
        self, request_id: str, job: Job, client: str | None, compiles: ParentCompiles
    ) -> Rendered | Job:
        """
        Run a compile-only program in this process, on a seat of the pool
        but not its worker (L{kcoral.server.workers.compileonly}); render
        how it ended, or give back the job, with what is left of its
        budget, when one of its compiles needs a worker.
        """
        async with hold_seat_only(self.pool, self._reactor, client) as held:
            self.log.info(
                "request {request_id} compiled by the server, no worker (seat {seat})",
                kcoral_event="request_routed",
                request_id=request_id,
                worker_id=None,
                gpu_id=None,
                gpu_ids=None,
                generation=None,
                pid=None,
                queue_ms=held.queue_ms,
                route=PARENT_COMPILE,
                seat=held.seat.worker_id,
            )
            result = await compiles.run(job)
            spent = self._reactor.seconds() - held.assigned_at
            if result is None:
                self.log.info(
                    "request {request_id}: a compile needs a worker",
                    kcoral_event="request_rerouted",
                    request_id=request_id,
                    route=PARENT_COMPILE,
                    spent_ms=spent * 1000.0,
                )
                left = max(job.timeout_seconds - spent, 1e-3)
                return attrs.evolve(job, timeout_seconds=left)
            return render_result(
                request_id,
                job.program,
                result,
                Placement(None, None, ()),
                timeout_seconds=job.timeout_seconds,
                queue_ms=held.queue_ms,
                elapsed_ms=spent * 1000.0,
                max_response_bytes=self.config.max_response_bytes,
            )

    def _interferer(
        self, request_id: str, gpu: int | None, error: dict[str, Any], result: JobResult
    ) -> str | None:
        """
        The request that held the GPU while the offending cpu_only run ran,
        when exactly one other request did (protocol §9.1).
        """
        start = result.instruction_started.get(error.get("instruction_index", -1))
        if start is None or gpu is None:
            return None
        labels = self.leases.labels_during(gpu, start, result.ended_at)
        return _single_other_request(labels, request_id)


def _invalid(error: ValidationError) -> RequestError:
    """The 400 for a request that breaks a protocol rule."""
    return RequestError(
        "parse",
        error.message,
        "rejected",
        error_kind="invalid_request",
        error_message=error.message[:FIELD_LIMIT],
    )


def _too_large() -> RequestError:
    """The 413 for a body over C{max_request_bytes}."""
    return RequestError(
        "request_too_large",
        REQUEST_TOO_LARGE_MESSAGE,
        "rejected",
        error_kind="request_too_large",
    )


def _single_other_request(labels: set[str | None], request_id: str) -> str | None:
    """The one other request among lease labels, if exactly one held the GPU."""
    others = {
        label
        for label in labels
        if isinstance(label, str)
        and label != request_id
        and not (":" in label and label.partition(":")[0] in PURPOSES)
    }
    return others.pop() if len(others) == 1 else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def _holder_name(holder: Hashable | None) -> str | None:
    return None if holder is None else getattr(holder, "seat", str(holder))
