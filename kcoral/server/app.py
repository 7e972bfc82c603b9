# -*- test-case-name: tests.unit.test_app -*-
"""
The HTTP API: C{GET /health}, C{POST /execute}, C{GET /metrics}, C{GET /status}.

L{KcoralAPI} holds a class-level C{Klein()} and receives everything it needs
(config, pool, leases, blob store, thread pool, clock) in its constructor.
Handlers never block: body parsing, hashing and program records run in the
thread pool, programs run in worker processes.
"""

from __future__ import annotations

import datetime
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any, Union

import attrs
from klein import Klein
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.web.iweb import IRequest

from kcoral.server.lease import LeaseUnavailable
from kcoral.server.logs import event_level_for_finish_reason
from kcoral.server.pool import PoolBusy
from kcoral.server.workerproc import Job, JobResult
from kcoral.wire.channel import Outcome
from kcoral.wire.errors import choose_request_id, error_body, instruction_error
from kcoral.wire.errors import http_status as status_of_kind
from kcoral.wire.jsontext import json_dumps
from kcoral.wire.multipart import (
    RequestBodyParser,
    RequestTooLarge,
    boundary_from_content_type,
    check_blob_references,
    check_tensor_lengths,
    encode_response,
)
from kcoral.wire.program import (
    BUILTIN_NAMES,
    Program,
    Upload,
    ValidationError,
    clamp_options,
    parse_program,
)

#: A response body: bytes, or the chunks of a multipart body.
Body = Union[bytes, list[bytes]]

#: Bodies up to this size are parsed on the reactor thread; larger ones in
#: the I/O thread pool.
INLINE_PARSE_BYTES = 64 * 1024

#: Bytes read from the spooled body per parser feed.
READ_CHUNK = 256 * 1024


class RequestError(Exception):
    """A request-level failure answered with an ERROR body."""

    def __init__(self, kind: str, message: str, finish_reason: str, **fields: Any) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.finish_reason = finish_reason
        self.fields = fields


@attrs.frozen
class Parsed:
    program: Program
    program_bytes: bytes
    blobs: dict[str, bytes]
    request_bytes: int


def _iso_utc(timestamp: float) -> str:
    moment = datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc)
    return moment.isoformat().replace("+00:00", "Z")


def _parse_body(content: Any, content_type: str | None, max_bytes: int) -> Parsed:
    """Thread pool: stream the spooled body through the multipart parser."""
    boundary = boundary_from_content_type(content_type)
    parser = RequestBodyParser(boundary, max_bytes=max_bytes)
    total = 0
    try:
        content.seek(0)
        while True:
            chunk = content.read(READ_CHUNK)
            if not chunk:
                break
            total += len(chunk)
            parser.feed(chunk)
        parsed = parser.close()
    except BaseException:
        _close_parser(parser)
        raise
    blobs = {}
    try:
        program = parse_program(parsed.program, builtin_names=BUILTIN_NAMES)
        check_blob_references(program, parsed.blobs)
        for digest, blob in parsed.blobs.items():
            blobs[digest] = blob.read()
        check_tensor_lengths(program, {d: len(b) for d, b in blobs.items()})
    finally:
        for blob in parsed.blobs.values():
            blob.close()
    return Parsed(program, parsed.program, blobs, total)


def _close_parser(parser: Any) -> None:
    close = getattr(parser, "abort", None)
    if close is not None:
        try:
            close()
        except Exception:
            pass


def _shield(d: Deferred[Any]) -> Deferred[Any]:
    """A copy of C{d} whose cancellation does not reach C{d}."""
    copy: Deferred[Any] = Deferred(lambda _: None)

    def forward(result: Any) -> Any:
        if not copy.called:
            if isinstance(result, BaseException):
                copy.errback(result)
            else:
                copy.callback(result)
        return None

    d.addCallbacks(forward, lambda f: forward(f.value))
    return copy


@attrs.define(eq=False)
class KcoralAPI:
    """The routes, bound to one server's state."""

    config: Any
    pool: Any
    leases: Any
    blobs: Any
    _threadpool: Any
    _reactor: Any
    instance_id: str = attrs.field(factory=lambda: str(uuid.uuid4()))
    started_at: float = 0.0
    save_program: Callable[[str, bytes], Deferred[str | None]] | None = None
    metrics: Any = None
    status_snapshot: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    status_page: bytes | None = None
    sandbox_name: str = "none"
    in_flight: int = 0
    _idle_waiters: list[Deferred[None]] = attrs.field(factory=list)
    _draining: bool = False

    app = Klein()
    log = Logger()

    def resource(self) -> Any:
        """The Twisted resource to serve."""
        return self.app.resource()

    # -- /health ------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """The /health body: the 0.1.1 fields plus the documented ones."""
        now = self._reactor.seconds()
        pool = self.pool
        gpus = sorted(set(self.config.gpus)) if self.config.device == "gpu" else []
        return {
            "status": "ok",
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
                }
                for gpu in gpus
            ],
            "workers": pool.worker_status(now),
            "sandbox": self.sandbox_name,
        }

    @app.route("/health", methods=["GET"])
    def _health(self, request: IRequest) -> bytes:
        request.setHeader(b"Content-Type", b"application/json")
        request.setHeader(b"X-Request-ID", str(uuid.uuid4()).encode())
        return json_dumps(self.health())

    @app.route("/metrics", methods=["GET"])
    def _metrics(self, request: IRequest) -> bytes:
        if self.metrics is None:
            request.setResponseCode(404)
            return b""
        body, content_type = self.metrics.render()
        request.setHeader(b"Content-Type", content_type.encode())
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
        self.in_flight += 1
        try:
            d = Deferred.fromCoroutine(self._handle(request, request_id))
            status, content_type, body = await _shield(d)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                waiters, self._idle_waiters = self._idle_waiters, []
                for waiter in waiters:
                    waiter.callback(None)
        request.setResponseCode(status)
        request.setHeader(b"Content-Type", content_type.encode())
        if status == 503:
            request.setHeader(b"Retry-After", b"1")
        if isinstance(body, list):
            # A multipart body: write its chunks as they are (binary parts
            # can be hundreds of MiB; joining them would copy them again).
            request.setHeader(b"Content-Length", str(sum(len(c) for c in body)).encode())
            for chunk in body:
                request.write(chunk)
            return b""
        return body

    def wait_idle(self) -> Deferred[None]:
        """Fires once no /execute request is in flight (graceful shutdown)."""
        d: Deferred[None] = Deferred()
        if self.in_flight == 0:
            d.callback(None)
        else:
            self._idle_waiters.append(d)
        return d

    def _finished(self, request_id: str, http_status: int, reason: str, **fields: Any) -> None:
        self.log.emit(
            event_level_for_finish_reason(reason),
            "request {request_id} finished: {finish_reason} ({http_status})",
            kcoral_event="request_finished",
            request_id=request_id,
            http_status=http_status,
            finish_reason=reason,
            **fields,
        )

    def _error(self, request_id: str, error: RequestError) -> tuple[int, str, bytes]:
        status = status_of_kind(error.kind)
        self._finished(request_id, status, error.finish_reason, **error.fields)
        return (
            status,
            "application/json",
            json_dumps(error_body(request_id, error.kind, error.message)),
        )

    async def _handle(self, request: IRequest, request_id: str) -> tuple[int, str, Body]:
        client = request.getClientAddress()
        self.log.info(
            "request {request_id} received",
            kcoral_event="request_received",
            request_id=request_id,
            client=getattr(client, "host", None),
            client_name=getattr(request, "client_name", None),
            content_length=_header(request, b"content-length"),
        )
        try:
            return await self._admit_and_run(request, request_id)
        except RequestError as error:
            return self._error(request_id, error)
        except CancelledError:
            raise
        except Exception as e:
            self.log.failure("unhandled error in request {request_id}", request_id=request_id)
            return self._error(
                request_id,
                RequestError(
                    "engine",
                    "internal server error",
                    "server_error",
                    error_kind="unhandled",
                    error_message=f"{type(e).__name__}: {e}"[:2048],
                ),
            )

    async def _admit_and_run(self, request: IRequest, request_id: str) -> tuple[int, str, Body]:
        config = self.config
        if getattr(request, "too_large", False):
            raise _too_large()
        try:
            arguments = (
                request.content,
                _header(request, b"content-type"),
                config.max_request_bytes,
            )
            if getattr(request, "body_bytes", INLINE_PARSE_BYTES + 1) <= INLINE_PARSE_BYTES:
                # A small body parses and hashes in well under a millisecond:
                # cheaper here than a round trip through the thread pool.
                parsed: Parsed = _parse_body(*arguments)
            else:
                parsed = await deferToThreadPool(
                    self._reactor, self._threadpool, _parse_body, *arguments
                )
        except RequestTooLarge:
            raise _too_large() from None
        except ValidationError as e:
            raise _invalid(e) from None
        program = parsed.program

        kinds: dict[str, frozenset[str]] = {}
        for digest in program.referenced_blobs():
            kinds[digest] = program.blob_kinds(digest)
        resolution = await self.blobs.resolve(kinds, parsed.blobs)
        try:
            if resolution.missing:
                self._finished(
                    request_id,
                    200,
                    "cache_miss",
                    status="CACHE_MISS",
                    missing=len(resolution.missing),
                )
                body = {
                    "status": "CACHE_MISS",
                    "request_id": request_id,
                    "missing_blobs": list(resolution.missing),
                }
                return 200, "application/json", json_dumps(body)
            try:
                check_tensor_lengths(program, {d: len(b) for d, b in resolution.found.items()})
            except ValidationError as e:
                raise _invalid(e) from None
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
            if program.options.gpu_count is not None:
                return await self._run_multi_gpu(request_id, job, program.options.gpu_count)
            return await self._run(request_id, job, _client_identity(request))
        finally:
            resolution.pin.release()

    async def _run(
        self, request_id: str, job: Job, client: str | None = None
    ) -> tuple[int, str, Body]:
        queued = self._reactor.seconds()
        try:
            seat = await self.pool.acquire(self.config.worker_wait_timeout_seconds, client)
        except PoolBusy:
            queue_ms = (self._reactor.seconds() - queued) * 1000.0
            raise RequestError("busy", "server saturated", "no_worker", queue_ms=queue_ms) from None
        assigned = self._reactor.seconds()
        queue_ms = (assigned - queued) * 1000.0
        worker = seat.worker
        self.log.info(
            "request {request_id} routed to {worker_id}",
            kcoral_event="request_routed",
            request_id=request_id,
            worker_id=seat.worker_id,
            gpu_id=seat.gpu_id,
            gpu_ids=None,
            generation=seat.generation,
            pid=worker.pid,
            queue_ms=queue_ms,
        )
        job = attrs.evolve(
            job,
            workspace=self.pool.sandbox.worker_path(seat.work_dir),
            reserved=self.pool.sandbox.reserved,
        )
        retire: str | None = None
        try:
            result: JobResult = await worker.run(job)
            elapsed_ms = (self._reactor.seconds() - assigned) * 1000.0
            retire = self._retire_reason(seat, result)
            answer = self._respond(request_id, seat, job, result, queue_ms, elapsed_ms)
            if not await self._workspace_out_of_reach(seat, worker, retire):
                retire = "sandbox_cleanup"
            return answer
        finally:
            self.pool.release(
                seat, retire=retire if retire is not None else self._fallback_retire(seat)
            )

    async def _run_multi_gpu(self, request_id: str, job: Job, count: int) -> tuple[int, str, Body]:
        """
        Run a program that asked for C{count} GPUs (protocol §6.5): take a
        seat, pick the C{count} least busy GPUs, start a one-request worker
        that sees exactly those, then run the program.

        No lease is held while the worker starts: like any new worker it
        takes its GPUs' lease only to create its context, and the program
        takes all of them (all or nothing, ascending) only while its
        instructions use the GPUs, so single-GPU requests are not held up
        by a process start and imports.
        """
        queued = self._reactor.seconds()
        try:
            seat = await self.pool.acquire(self.config.worker_wait_timeout_seconds)
        except PoolBusy:
            queue_ms = (self._reactor.seconds() - queued) * 1000.0
            raise RequestError("busy", "server saturated", "no_worker", queue_ms=queue_ms) from None
        assigned = self._reactor.seconds()
        queue_ms = (assigned - queued) * 1000.0
        try:
            try:
                gpus = self.leases.least_busy(count)
            except LeaseUnavailable:
                raise RequestError(
                    "busy", "server saturated", "no_worker", queue_ms=queue_ms
                ) from None
            starting = self._reactor.seconds()
            try:
                worker, work_dir = await self.pool.start_transient(seat, gpus)
            except Exception as e:
                raise RequestError(
                    "engine", "worker crashed", "crashed", error_message=str(e)[:2048]
                ) from None
            startup = self._reactor.seconds() - starting
            self.log.info(
                "request {request_id} routed to a worker on GPUs {gpu_ids}",
                kcoral_event="request_routed",
                request_id=request_id,
                worker_id=seat.worker_id,
                gpu_id=gpus[0],
                gpu_ids=list(gpus),
                generation=0,
                pid=worker.pid,
                queue_ms=queue_ms,
                startup_ms=startup * 1000.0,
            )
            try:
                # Starting the worker counts against the budget (§6.5).
                remaining = job.timeout_seconds - startup
                if remaining <= 0:
                    raise RequestError("timeout", "execution timed out", "timeout")
                job = attrs.evolve(
                    job,
                    workspace=self.pool.sandbox.worker_path(work_dir),
                    reserved=self.pool.sandbox.reserved,
                    timeout_seconds=remaining,
                )
                result: JobResult = await worker.run(job)
                elapsed_ms = (self._reactor.seconds() - assigned) * 1000.0
                return self._respond(request_id, seat, job, result, queue_ms, elapsed_ms, gpus=gpus)
            finally:
                self.pool.remove_transient(worker, work_dir).addErrback(
                    lambda f: self.log.failure("removing a multi-GPU worker failed", f)
                )
        finally:
            self.pool.release(seat)

    async def _workspace_out_of_reach(self, seat: Any, worker: Any, retire: str | None) -> bool:
        """
        Without a sandbox nothing hides one request's workspace from the
        next, so empty it before the answer goes out rather than after
        (issue 17, item 5).  A retiring worker is stopped first, so nothing
        writes into the workspace once it is empty.  Returns C{False} when
        the workspace could not be emptied (the worker must then retire).
        """
        if getattr(self.pool.sandbox, "name", None) != "none" or seat.work_dir is None:
            return True
        if retire is not None and retire != "request_limit" and worker.alive:
            await worker.kill()
        try:
            await deferToThreadPool(
                self._reactor, self._threadpool, self.pool.sandbox.clear_workspace, seat.work_dir
            )
        except Exception as e:
            self.log.warn(
                "could not empty the workspace of {worker_id}: {error}",
                worker_id=seat.worker_id,
                error=str(e),
            )
            return False
        return True

    def _fallback_retire(self, seat: Any) -> str | None:
        worker = seat.worker
        return None if worker is not None and worker.alive and worker._job is None else "crashed"

    def _retire_reason(self, seat: Any, result: JobResult) -> str | None:
        if result.ending == "timeout":
            return "timeout"
        if result.ending == "invalid":
            return "channel_violation"
        if result.ending != "outcome":
            return "crashed"
        assert result.outcome is not None
        reason = result.outcome.retire
        if reason:
            return reason
        limit = self.config.max_requests_per_worker
        if limit and seat.served + 1 >= limit:
            return "request_limit"
        return None

    def _interferer(
        self, request_id: str, gpu: int, error: dict[str, Any], result: JobResult
    ) -> str | None:
        """
        The request that held the GPU while the offending cpu_only run ran,
        when exactly one other request did (protocol §9.1).
        """
        start = result.instruction_started.get(error.get("instruction_index", -1))
        if start is None:
            return None
        labels = self.leases.labels_during(gpu, start, result.ended_at)
        return _single_other_request(labels, request_id)

    def _respond(
        self,
        request_id: str,
        seat: Any,
        job: Job,
        result: JobResult,
        queue_ms: float,
        elapsed_ms: float,
        gpus: tuple[int, ...] | None = None,
    ) -> tuple[int, str, Body]:
        place = {"worker_id": seat.worker_id, "gpu_id": seat.gpu_id}
        if result.ending == "timeout":
            raise RequestError(
                "timeout",
                "execution timed out",
                "timeout",
                queue_ms=queue_ms,
                elapsed_ms=elapsed_ms,
                timeout_seconds=job.timeout_seconds,
                output_tail=result.output_tail,
                **place,
            )
        if result.ending == "invalid":
            raise RequestError(
                "engine",
                "invalid worker response" + (f": {result.detail[:512]}" if result.detail else ""),
                "server_error",
                error_kind="invalid_worker_response",
                **place,
            )
        timings = {
            "queue_ms": queue_ms,
            "elapsed_ms": elapsed_ms,
            "lease_wait_ms": result.lease_wait_seconds * 1000.0,
            "lease_held_ms": result.lease_held_seconds * 1000.0,
        }
        if result.ending == "crashed":
            index = result.instruction_index
            if index is None or not 0 <= index < len(job.program.instructions):
                raise RequestError(
                    "engine",
                    "worker crashed",
                    "crashed",
                    exitcode=result.exit_code,
                    queue_ms=queue_ms,
                    elapsed_ms=elapsed_ms,
                    output_tail=result.output_tail,
                    **place,
                )
            instruction = job.program.instructions[index]
            crash_error = instruction_error(
                "runtime",
                "worker exited while executing the instruction",
                index,
                instruction.op,
                instruction.id,
                "",
            )
            # Returns that finished before the crash stay in the results.
            outcome = Outcome(
                status="FAILED", error=crash_error, results=result.results, parts=result.parts
            )
            reason = "crashed"
        else:
            assert result.outcome is not None
            outcome = result.outcome
            reason = "completed" if outcome.status == "COMPLETED" else "program_failed"
        if outcome.oversize is not None:
            raise RequestError(
                "response_too_large",
                "results exceed the configured response-size limit",
                "server_error",
                error_kind="response_too_large",
                response_bytes=outcome.oversize,
                queue_ms=queue_ms,
                elapsed_ms=elapsed_ms,
                lease_held_ms=timings["lease_held_ms"],
                **place,
            )
        parts = list(outcome.parts)
        body: dict[str, Any] = {
            "status": outcome.status,
            "request_id": request_id,
            **timings,
            "stdout": outcome.stdout,
            "stderr": outcome.stderr,
            "stdout_truncated": outcome.stdout_truncated,
            "stderr_truncated": outcome.stderr_truncated,
        }
        if job.program.options.gpu_count is not None:
            # Only for programs that asked for a GPU count (protocol §6.5).
            gpu_ids = list(seat.gpus if gpus is None else gpus)
            body["gpu_ids"] = gpu_ids
            body["gpu_count"] = len(gpu_ids)
        body["results"] = outcome.results
        error = outcome.error
        if (
            isinstance(error, dict)
            and error.get("kind") == "gpu_access"
            and seat.gpu_id is not None
        ):
            error["interfered_request_id"] = self._interferer(
                request_id, seat.gpu_id, error, result
            )
        if body["status"] != "COMPLETED":
            body["error"] = error
        content_type, chunks = encode_response(body, parts)
        size = sum(len(c) for c in chunks)
        if size > self.config.max_response_bytes:
            raise RequestError(
                "response_too_large",
                "results exceed the configured response-size limit",
                "server_error",
                error_kind="response_too_large",
                response_bytes=size,
                queue_ms=queue_ms,
                elapsed_ms=elapsed_ms,
                lease_held_ms=timings["lease_held_ms"],
                **place,
            )
        fields: dict[str, Any] = {
            "status": body["status"],
            "exitcode": result.exit_code if reason == "crashed" else None,
            "output_tail": result.output_tail if reason == "crashed" else None,
            **place,
            **timings,
            "response_bytes": size,
        }
        if error:
            fields.update(
                error_kind=error.get("kind"),
                error_message=str(error.get("message", ""))[:2048],
                instruction_index=error.get("instruction_index"),
                instruction_op=error.get("instruction_op"),
                instruction_id=error.get("instruction_id"),
            )
        self._finished(request_id, 200, reason, **fields)
        if len(chunks) == 1:
            return 200, content_type, chunks[0]
        return 200, content_type, chunks


def _client_identity(request: IRequest) -> str | None:
    """
    Who sent C{request}, for the reuse scope: the client name of its bearer
    token when the server has tokens (L{kcoral.server.auth}), else the TCP
    peer's address (C{None} when the transport has none).
    """
    name = getattr(request, "client_name", None)
    if isinstance(name, str):
        return "client:" + name
    host = getattr(request.getClientAddress(), "host", None)
    return host if isinstance(host, str) else None


def _invalid(error: ValidationError) -> RequestError:
    """The 400 for a request that breaks a protocol rule."""
    return RequestError(
        "parse",
        error.message,
        "rejected",
        error_kind="invalid_request",
        error_message=error.message[:2048],
    )


def _too_large() -> RequestError:
    """The 413 for a body over C{max_request_bytes}."""
    return RequestError(
        "request_too_large",
        "request exceeds the configured size limit",
        "rejected",
        error_kind="request_too_large",
    )


def _single_other_request(labels: set[Any], request_id: str) -> str | None:
    """The one other request among lease labels, if exactly one held the GPU."""
    others = {
        label
        for label in labels
        if isinstance(label, str) and label != request_id and not label.startswith("warmup:")
    }
    return others.pop() if len(others) == 1 else None


def _header(request: IRequest, name: bytes) -> str | None:
    value = request.getHeader(name)
    if value is None:
        return None
    return value.decode("latin-1") if isinstance(value, bytes) else str(value)


def _holder_name(holder: Any) -> str | None:
    return None if holder is None else getattr(holder, "seat", str(holder))
