# -*- test-case-name: tests.unit.test_gateway_api -*-
"""
The gateway's HTTP API.

Client-facing, the KCoral protocol unchanged: C{POST /execute},
C{GET /health}, C{/status}, C{/status.json}, C{/metrics}.  A request is
parsed and its blobs resolved exactly as a node does it (the same site,
multipart parser and blob store, L{kcoral.server.http}, L{kcoral.server.cache}),
so the gateway answers CACHE_MISS itself for the whole pool.  An admitted
request becomes a job on the work queue (L{kcoral.gateway.dispatch}) and
its answer is the node's response, relayed unchanged.

Node-facing, behind each job's own token (L{PoolGuard}):
C{GET /_pool/jobs/<job>/blobs/<sha256>} serves a blob of the job and
C{POST /_pool/jobs/<job>/result} takes the node's response
(L{kcoral.gateway.jobs.result_headers}) and answers once the client has it.
"""

from __future__ import annotations

import functools
import hmac
import io
import os
import secrets
import uuid
from collections.abc import Callable, Mapping
from typing import IO, Any

import attrs
from klein import Klein
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from twisted.internet.defer import CancelledError, Deferred, fail
from twisted.internet.defer import TimeoutError as WaitTimedOut
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource
from werkzeug.exceptions import HTTPException

from kcoral.gateway.dispatch import Dispatcher, Outcome, PendingJob
from kcoral.gateway.jobs import (
    NATS_RESULT_BYTES,
    POOL_PREFIX,
    RESULT_JOB_HEADER,
    RESULT_TOKEN_HEADER,
    BlobRef,
    JobMessage,
    ResultHead,
    SchemaError,
    parse_result_headers,
    program_gpus,
    result_reply,
    valid_id,
)
from kcoral.gateway.pool import PoolView
from kcoral.gateway.relay import STREAM_RESULT_BYTES, ResultRelay
from kcoral.server.http.app import BlobResolver
from kcoral.server.http.component import IKcoralRequest, client_identity
from kcoral.server.http.pipeline import RequestPipeline
from kcoral.server.http.pipeline import header as _header
from kcoral.server.http.pipeline import iso_utc as _iso_utc
from kcoral.server.http.pipeline import response_request_id as _response_request_id
from kcoral.server.http.request import LimitedRequest
from kcoral.server.http.site import KcoralSite
from kcoral.server.http.streaming import BodyProducer, DirectSocket
from kcoral.server.workers.pool import PoolBusy
from kcoral.wire.errors import choose_request_id, error_body
from kcoral.wire.jsontext import json_dumps
from kcoral.wire.multipart import RequestTooLarge, check_tensor_lengths
from kcoral.wire.program import ValidationError
from kcoral.wire.render import RequestError, render_cache_miss

__all__ = ["GatewayAPI", "GatewayRequest", "PoolGuard"]

#: The header a client names its preferred node with (protocol §2.2).
NODE_HEADER = b"x-kcoral-node"
#: Relayed bodies up to this size are written in one piece.
INLINE_RELAY_BYTES = 1 << 20

#: Statuses of the gateway's own refusals (the reference router's kinds).
GATEWAY_KINDS = {"busy": (503, "busy"), "node_lost": (502, "server_transport")}


def _pool_job(path: bytes) -> str | None:
    """The job id of a node-facing path, or C{None}."""
    prefix = POOL_PREFIX.encode()
    if not path.startswith(prefix):
        return None
    job = path[len(prefix) :].split(b"/", 1)[0].decode("ascii", "replace")
    return job if valid_id(job) else None


class PoolGuard(Resource):
    """
    A leaf resource in front of the API: node-facing paths need the bearer
    token of the job they name, every other path the client tokens (when
    the gateway has any, as L{kcoral.server.http.auth.TokenGuard}).  The
    site asks L{refuses} as soon as a head is in, so no body of a refused
    request is read.
    """

    isLeaf = True

    def __init__(self, inner: IResource, dispatcher: Dispatcher, clients: Any = None) -> None:
        super().__init__()
        self._inner = inner
        self._dispatcher = dispatcher
        #: The client token guard, or C{None}: clients need no token.
        self.clients = clients

    def job_token_ok(self, path: bytes, authorization: bytes | None) -> bool:
        job = _pool_job(path)
        pending = None if job is None else self._dispatcher.jobs.get(job)
        if pending is None or authorization is None:
            return False
        expected = b"Bearer " + pending.message.token.encode("ascii")
        return hmac.compare_digest(authorization, expected)

    def refuses(self, path: bytes, authorization: bytes | None) -> bool:
        if path.startswith(b"/_pool/"):
            return not self.job_token_ok(path, authorization)
        return self.clients is not None and bool(self.clients.refuses(path, authorization))

    def render(self, request: IRequest) -> Any:
        path = request.path
        if path.startswith(b"/_pool/"):
            # A relayed result's head passed L{refuses} before its job was
            # settled (and forgotten) by the relay's start.
            relayed = isinstance(IKcoralRequest(request).body_parser, ResultRelay)
            if not relayed and not self.job_token_ok(path, request.getHeader(b"authorization")):
                return _refuse(request, 401, "unauthorized", "a valid job token is required")
            return self._inner.render(request)
        if self.clients is not None:
            return self.clients.render(request)
        return self._inner.render(request)


def _refuse(request: IRequest, status: int, kind: str, message: str) -> bytes:
    request_id = choose_request_id(request.requestHeaders.getRawHeaders(b"x-request-id"))
    request.setResponseCode(status)
    request.setHeader(b"Content-Type", b"application/json")
    request.setHeader(b"X-Request-ID", request_id.encode("ascii"))
    return json_dumps(error_body(request_id, kind, message))


class GatewayRequest(LimitedRequest):
    """
    A L{LimitedRequest} whose node-facing result posts may be as large as a
    response, and count only against the gateway's bytes in flight, not
    against their address's share (C{--max-bytes-per-client}): a node's
    results are bounded by its jobs, and a node may share an address with
    clients.
    """

    def _head_path(self) -> bytes:
        """The path of the request line (Twisted sets C{path} only once the body is in)."""
        path = getattr(self.channel, "_path", None) or b""
        return bytes(path).split(b"?", 1)[0]

    def _node_route(self) -> bool:
        return self._head_path().startswith(b"/_pool/")

    def _limit(self) -> int | None:
        if self._node_route():
            return getattr(self._site(), "max_result_bytes", None)
        return super()._limit()

    def _counted_peer(self) -> str | None:
        return None if self._node_route() else super()._counted_peer()

    _declared: int | None = None

    def gotLength(self, length: int | None) -> None:
        self._declared = length
        super().gotLength(length)

    def _stream_body(self) -> bool:
        """
        A client's multipart body streams into the parser, as on a node; a
        node's large result post streams into its client's response
        (L{kcoral.gateway.relay}), when the site relays one.
        """
        if not self._node_route():
            return super()._stream_body()
        site = self._site()
        make = getattr(site, "relay_result", None)
        relay = None if make is None else make(self, self._head_path(), self._declared)
        if relay is None:
            return False
        self.kcoral.body_parser = relay
        self.content = io.BytesIO()
        return True

    def _reserve(self, size: int, force: bool = False) -> bool:
        # A relayed result's bytes pass through to the client, held nowhere.
        if isinstance(self.kcoral.body_parser, ResultRelay):
            return True
        return super()._reserve(size, force)


class GatewaySite(KcoralSite):
    """The server's site with L{GatewayRequest}s and a result-size limit."""

    requestFactory = GatewayRequest

    def __init__(self, resource: Any, *, max_result_bytes: int, **kwargs: Any) -> None:
        super().__init__(resource, **kwargs)
        self.max_result_bytes = max_result_bytes
        #: Makes the L{ResultRelay} a node's result post streams into
        #: (L{GatewayAPI.relay_result}), or C{None} for one read whole.
        self.relay_result: Callable[[IRequest, bytes, int | None], ResultRelay | None] | None = None

    def access_log(self, request: Any) -> None:
        """
        The access log, less the node-facing requests that succeed: a
        result post (and a blob fetch) per job is the gateway's own
        traffic, its job's events tell of it, and the line cost about as
        much of the gateway's CPU as the client's own.  A refused one is
        logged.
        """
        path = getattr(request, "path", None) or b""
        if path.startswith(b"/_pool/") and request.code < 400:
            return
        super().access_log(request)


@attrs.frozen(kw_only=True)
class GatewaySettings:
    """What the API needs to know of the gateway's configuration."""

    #: The gateway's base URL as nodes reach it (job messages carry it).
    public_url: str
    queue_size: int
    queue_timeout: float
    preference_window: float
    max_request_bytes: int
    default_timeout: float
    max_timeout: float
    #: This process's place among the gateway's front ends (L{kcoral.gateway.frontends}).
    front_end: int = 0
    front_ends: int = 1
    #: The key of this process's result subjects on NATS (jobs carry it,
    #: L{kcoral.gateway.jobs.results_subject}); C{None}: results come over
    #: HTTP only.
    results_key: str | None = None


#: How long a request waits for a just-started gateway process to read the
#: nodes' presence (a few milliseconds once NATS answers) before an empty
#: pool means "no node": a front end listens before it reaches NATS.
POOL_READING_SECONDS = 5.0


@attrs.define(eq=False)
class GatewayAPI(RequestPipeline):
    """The routes, bound to one gateway's state."""

    settings: GatewaySettings
    dispatcher: Dispatcher
    pool: PoolView
    queue: Any
    blobs: BlobResolver
    _threadpool: Any
    _reactor: IReactorTime
    instance_id: str = attrs.field(factory=lambda: str(uuid.uuid4()))
    started_at: float = 0.0
    in_flight: int = 0
    requests: dict[str, int] = attrs.field(factory=dict)

    app = Klein()
    log = Logger()

    def resource(self) -> IResource:
        return self.app.resource()

    # -- /health, /status, /metrics -------------------------------------------

    def health(self) -> dict[str, Any]:
        now = self._reactor.seconds()
        summary = self.pool.summary(now)
        nodes = self.pool.node_list(now)
        classes = {n["compat"] for n in nodes}
        one = None
        if len(classes) == 1:
            state = self.pool.nodes[nodes[0]["node"]].presence
            one = (dict(state.target), dict(state.versions))
        connected = bool(self.queue.connected)
        ok = connected and summary["seats"] > 0
        return {
            "status": "ok" if ok else "unavailable",
            "instance_id": self.instance_id,
            "started_at": _iso_utc(self.started_at),
            "gpu_count": None,
            "load": {
                "request_capacity": summary["seats"],
                "requests_in_progress": self.dispatcher.running(),
                "requests_waiting": self.dispatcher.waiting(),
            },
            "target": one[0] if one else {},
            "versions": one[1] if one else {},
            "uptime_seconds": round(max(0.0, now - self.started_at), 3),
            "active_requests": self.dispatcher.running(),
            "queue_length": self.dispatcher.waiting(),
            "gateway": {
                "nats": "connected" if connected else "disconnected",
                "queue_depth": getattr(self.queue, "depth", None),
                "queue_size": self.settings.queue_size,
                "pool": summary,
                "compat_classes": sorted(classes),
                "nodes": nodes,
                "front_end": {
                    "index": self.settings.front_end,
                    "count": self.settings.front_ends,
                    "pid": os.getpid(),
                    "public_url": self.settings.public_url,
                },
                "outcomes": dict(sorted(self.dispatcher.counts.items())),
                "requests": dict(sorted(self.requests.items())),
            },
        }

    @app.route("/health", methods=["GET"])
    def _health(self, request: IRequest) -> bytes:
        return self.health_answer(request)

    @app.route("/status.json", methods=["GET"])
    def _status_json(self, request: IRequest) -> bytes:
        request.setHeader(b"Content-Type", b"application/json")
        return json_dumps(self.health())

    @app.route("/status", methods=["GET"])
    def _status(self, request: IRequest) -> bytes:
        request.setHeader(b"Content-Type", b"text/html; charset=utf-8")
        return status_page(self.health())

    @app.route("/metrics", methods=["GET"])
    def _metrics(self, request: IRequest) -> bytes:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_GatewayCollector(self))  # type: ignore[arg-type]
        request.setHeader(b"Content-Type", b"text/plain; version=0.0.4; charset=utf-8")
        return generate_latest(registry)

    # -- /execute ---------------------------------------------------------------

    @app.route("/execute", methods=["POST"])
    async def _execute(self, request: IRequest) -> bytes:
        request_id = choose_request_id(request.requestHeaders.getRawHeaders(b"x-request-id"))
        request.setHeader(b"X-Request-ID", request_id.encode())
        self.in_flight += 1
        try:
            try:
                return await self._handle(request, request_id)
            except CancelledError:
                self._finished(request_id, 499, "client_disconnected")
                raise
        finally:
            self.in_flight -= 1

    async def _handle(self, request: IRequest, request_id: str) -> bytes:
        started = self._reactor.seconds()
        parsed = await self._parse(request)
        program = parsed.program
        kinds = {d: program.blob_kinds(d) for d in program.referenced_blobs()}
        resolution = await self.blobs.resolve(kinds, parsed.blobs)
        release = resolution.pin.release
        try:
            if resolution.missing:
                rendered = render_cache_miss(request_id, list(resolution.missing))
                self._finished(request_id, 200, rendered.finish_reason, **rendered.fields)
                request.setHeader(b"Content-Type", rendered.content_type.encode())
                assert isinstance(rendered.body, bytes)
                return rendered.body
            check_tensor_lengths(program, {d: len(b) for d, b in resolution.found.items()})
            now = self._reactor.seconds()
            gpus = program_gpus(program.options.gpu_count)
            prefer = _preferred(request)
            compat = self.pool.choose(gpus, now, prefer)
            if compat is None and not self.pool.loaded:
                # A front end that has just started (or has not reached NATS
                # yet) does not know the pool: wait a little for the presence
                # bucket's contents before saying "no node".
                await self._pool_known(min(POOL_READING_SECONDS, self.settings.queue_timeout))
                now = self._reactor.seconds()
                compat = self.pool.choose(gpus, now, prefer)
            if compat is None:
                raise RequestError("busy", "no node in the pool can run this program", "no_node")
            settings = self.settings
            timeout = program.options.timeout_seconds or settings.default_timeout
            message = JobMessage(
                job=uuid.uuid4().hex,
                request_id=request_id,
                program=parsed.program_bytes.decode("utf-8"),
                blobs=tuple(BlobRef(sha256=d, size=len(b)) for d, b in resolution.found.items()),
                options={},
                deadline=now + settings.queue_timeout,
                token=secrets.token_urlsafe(32),
                gateway=settings.public_url,
                prefer=prefer,
                prefer_until=now + settings.preference_window if prefer else 0.0,
                client=client_identity(request),
                results=settings.results_key,
            )
            pending = PendingJob(
                message=message,
                compat=compat,
                gpus=gpus,
                timeout_seconds=min(float(timeout), settings.max_timeout),
                release=release,
                blobs=resolution.found,
            )
            release = _nothing  # the job holds the pin now
        finally:
            release()
        outcome = await self.dispatcher.submit(pending)
        return await self._answer(request, request_id, pending, outcome, started)

    async def _answer(
        self,
        request: IRequest,
        request_id: str,
        pending: PendingJob,
        outcome: Outcome,
        started: float,
    ) -> bytes:
        elapsed_ms = round((self._reactor.seconds() - started) * 1000.0, 3)
        if outcome.error is not None:
            status, kind = GATEWAY_KINDS[outcome.error]
            self._finished(
                request_id,
                status,
                outcome.finish_reason,
                job=pending.job,
                node=outcome.node,
                elapsed_ms=elapsed_ms,
            )
            request.setResponseCode(status)
            request.setHeader(b"Content-Type", b"application/json")
            if status == 503:
                request.setHeader(b"Retry-After", b"1")
            if outcome.node is not None:
                request.setHeader(b"X-KCoral-Node", outcome.node.encode("ascii"))
            return json_dumps(error_body(request_id, kind, outcome.message))
        head, body, delivered = outcome.head, outcome.body, outcome.delivered
        assert head is not None and body is not None and delivered is not None
        try:
            request.setResponseCode(head.status)
            request.setHeader(b"Content-Type", head.content_type.encode("latin-1"))
            if head.retry_after is not None:
                request.setHeader(b"Retry-After", head.retry_after.encode("ascii"))
            if outcome.node is not None:
                request.setHeader(b"X-KCoral-Node", outcome.node.encode("ascii"))
            request.setHeader(b"Content-Length", str(outcome.body_length).encode())
            finished = functools.partial(
                self._finished,
                request_id,
                head.status,
                "relayed",
                job=pending.job,
                node=outcome.node,
                response_bytes=outcome.body_length,
                elapsed_ms=elapsed_ms,
            )
            if isinstance(body, ResultRelay):
                finished()
                # Written as the node's post arrives (L{kcoral.gateway.relay}).
                delivered.callback(await body.attach(request))
                return b""
            spooled = _SpooledFile.of(body, outcome.body_length)
            if spooled is None or outcome.body_length <= INLINE_RELAY_BYTES:
                data = body.read()
                # Its request_finished is logged once the response is
                # written: the event's formatting and writing would
                # otherwise come before the client's bytes.
                self._deliver_after(request, delivered, finished)
                return data
            finished()
            # Sent with sendfile from the spooled body where the socket allows
            # (plain TCP), else in slices: as a node sends a result of its own.
            producer = BodyProducer(request, [spooled], direct=DirectSocket.of(request))
            try:
                await producer.start()
            except CancelledError:
                producer.stop()
                raise
            delivered.callback(producer.written == outcome.body_length)
            return b""
        except BaseException:
            if not delivered.called:
                delivered.callback(False)
            raise
        finally:
            body.close()

    def _deliver_after(
        self, request: IRequest, delivered: Deferred[bool], log_end: Callable[[], None]
    ) -> None:
        """
        Once the client's response is written, fire C{delivered} (the node's
        result post is answered), then log the request's end (C{log_end}).
        The client's bytes have left by then (C{KcoralSite.log}).  The
        node's answer goes in this same turn: a NATS result's reply as soon
        as the result's handler gets back (the response is written inside
        it), and it leaves at once (C{natsbridge.write_now}).  Put off to a
        later turn, the answer went out after the client's next request had
        been read and published, and reached the node with that next job,
        whose path then waited while the node logged the previous job's end.
        """

        def written(result: object) -> None:
            _fire(delivered, not isinstance(result, Failure))
            log_end()

        finished: Deferred[None] = request.notifyFinish()  # type: ignore[attr-defined]
        finished.addBoth(written)

    def max_request_bytes(self) -> int:
        return self.settings.max_request_bytes

    # -- node-facing ------------------------------------------------------------

    @app.route("/_pool/jobs/<job>/blobs/<digest>", methods=["GET"])
    async def _blob(self, request: IRequest, job: str, digest: str) -> bytes:
        pending = self.dispatcher.jobs.get(job)
        data = None if pending is None else pending.blobs.get(digest)
        if pending is None or data is None:
            return _refuse(request, 404, "not_found", "no such blob of a waiting job")
        request.setHeader(b"Content-Type", b"application/octet-stream")
        request.setHeader(b"Content-Length", str(len(data)).encode())
        pending.transfers += 1
        try:
            if isinstance(data, bytes):
                return data
            producer = BodyProducer(request, [data], direct=DirectSocket.of(request))
            try:
                await producer.start()
            except CancelledError:
                producer.stop()
                raise
            return b""
        finally:
            pending.transfers -= 1
            # A node busy moving a large blob may be late with its presence.
            self.pool.touch(pending.node, self._reactor.seconds())
            self.log.info(
                "job {job}: blob {digest} sent",
                kcoral_event="job_blob_sent",
                job=job,
                digest=digest,
                bytes=len(data),
            )

    @app.route("/_pool/jobs/<job>/result", methods=["POST"])
    async def _result(self, request: IRequest, job: str) -> bytes:
        state = IKcoralRequest(request)
        if state.too_large:
            return _refuse(request, 413, "request_too_large", "result exceeds the size limit")
        if state.over_capacity:
            request.setHeader(b"Retry-After", b"1")
            return _refuse(request, 503, "busy", "gateway saturated; post the result again")
        try:
            head = parse_result_headers(lambda name: _header(request, name.lower().encode("ascii")))
        except SchemaError as e:
            return _refuse(request, 400, "parse", str(e))
        if isinstance(state.body_parser, ResultRelay):
            # Settled when its head came in, relayed as it arrived.
            delivered: Deferred[bool] | None = state.body_parser.delivered
        else:
            delivered = self._take_result(request, job, head, state.body_bytes or 0)
        if delivered is None:
            return _refuse(request, 410, "not_found", "the job is no longer waiting for a result")
        # The node waits until the client has the body; if the node leaves
        # meanwhile, the relay goes on (the body is detached from its request).
        shielded: Deferred[bool] = Deferred(lambda _: None)
        delivered.addBoth(lambda r: shielded.callback(r) if not shielded.called else None)
        ok = await shielded
        request.setHeader(b"Content-Type", b"application/json")
        return json_dumps({"delivered": bool(ok)})

    def relay_result(
        self, request: IRequest, path: bytes, length: int | None
    ) -> ResultRelay | None:
        """
        The relay a result post's body streams into, settling its job now
        (L{GatewaySite.relay_result}): for a large result (a declared
        length over L{STREAM_RESULT_BYTES}) with valid result headers, of a
        job that waits for one; else C{None} (read whole, then answered).
        """
        job = _pool_job(path)
        if job is None or length is None or length <= STREAM_RESULT_BYTES:
            return None
        if path != f"{POOL_PREFIX}{job}/result".encode("ascii"):
            return None
        try:
            head = parse_result_headers(lambda name: _header(request, name.lower().encode("ascii")))
        except SchemaError:
            return None
        if job not in self.dispatcher.jobs:
            return None
        relay = ResultRelay(length, job)
        delivered = self._take_result(request, job, head, length, relay)
        if delivered is None:
            return None
        relay.delivered = delivered
        return relay

    def _take_result(
        self,
        request: IRequest,
        job: str,
        head: ResultHead,
        length: int,
        relay: ResultRelay | None = None,
    ) -> Deferred[bool] | None:
        """Hand a posted result to its job; C{None} when the job waits for none."""
        pending = self.dispatcher.jobs.get(job)
        if pending is not None:
            self.pool.touch(head.node or pending.node, self._reactor.seconds())
        if relay is not None:
            return self.dispatcher.result(job, head, relay, length)
        content = request.content
        if content is None:
            body: IO[bytes] = io.BytesIO(b"")
        else:
            content.seek(0, os.SEEK_END)
            length = content.tell()
            content.seek(0)
            body = _detached(content, length)
        delivered = self.dispatcher.result(job, head, body, length)
        if delivered is None:
            body.close()
        return delivered

    # -- results over NATS ------------------------------------------------------

    def result_message(
        self, node: str, headers: Mapping[str, str], payload: bytes
    ) -> Deferred[bytes]:
        """
        A node's small result sent over NATS (L{kcoral.gateway.natsqueue}),
        taken as its post would be (the job's token, the result headers,
        a job that still waits), with C{node}, the subject's node id that
        nats-server authenticated, as the node that ran it.  Fires with the
        reply (L{kcoral.gateway.jobs.result_reply}) once the client has
        the answer, or at once when it is refused.
        """
        job = headers.get(RESULT_JOB_HEADER)
        pending = None if job is None else self.dispatcher.jobs.get(job)
        token = headers.get(RESULT_TOKEN_HEADER)
        if (
            job is None
            or pending is None
            or token is None
            or not hmac.compare_digest(token.encode("utf-8"), pending.message.token.encode("ascii"))
        ):
            return self._result_refused(node, job, 401, "a valid job token is required")
        if len(payload) > NATS_RESULT_BYTES:
            return self._result_refused(node, job, 413, "result too large for NATS; post it")
        try:
            head = parse_result_headers(headers.get)
        except SchemaError as e:
            return self._result_refused(node, job, 400, str(e))
        head = attrs.evolve(head, node=node)
        self.pool.touch(node, self._reactor.seconds())
        delivered = self.dispatcher.result(job, head, io.BytesIO(payload), len(payload))
        if delivered is None:
            return self._result_refused(node, job, 410, "the job is no longer waiting for a result")
        replied: Deferred[bytes] = Deferred()
        delivered.addBoth(lambda ok: replied.callback(result_reply(200, delivered=ok is True)))
        return replied

    def _result_refused(
        self, node: str, job: str | None, status: int, reason: str
    ) -> Deferred[bytes]:
        self.log.warn(
            "node {node}: result of job {job} over NATS refused ({status}): {reason}",
            kcoral_event="job_result_refused",
            node=node,
            job=job,
            status=status,
            reason=reason,
            via="nats",
        )
        d: Deferred[bytes] = Deferred()
        d.callback(result_reply(status, error=reason))
        return d

    # -- errors and events ------------------------------------------------------

    @app.handle_errors(Exception)
    def _failed(self, request: IRequest, failure: Failure) -> bytes | Deferred[bytes]:
        if failure.check(HTTPException, CancelledError):
            return fail(failure)
        request_id = _response_request_id(request)
        error = failure.value
        if isinstance(error, RequestError):
            pass
        elif isinstance(error, RequestTooLarge):
            error = RequestError(
                "request_too_large",
                "request body exceeds the configured size limit",
                "rejected",
            )
        elif isinstance(error, ValidationError):
            error = RequestError("parse", error.message, "rejected", error_kind="invalid_request")
        elif isinstance(error, PoolBusy):
            error = RequestError("busy", "server saturated", "no_worker")
        else:
            self.log.failure(
                "unhandled error in request {request_id}", failure, request_id=request_id
            )
            error = RequestError("engine", "internal server error", "server_error")
        return self.error_answer(request, request_id, error)

    async def _pool_known(self, seconds: float) -> None:
        """
        Wait until the pool view holds the presence bucket's contents, or
        C{seconds} pass (then the caller decides on what it knows).
        """
        waiting = self.pool.when_loaded()
        waiting.addTimeout(seconds, self._reactor)
        try:
            await waiting
        except WaitTimedOut:
            pass

    def _finished(self, request_id: str, http_status: int, reason: str, **fields: Any) -> None:
        self.requests[reason] = self.requests.get(reason, 0) + 1
        super()._finished(request_id, http_status, reason, **fields)


class _SpooledFile:
    """
    A spooled request body read like a sealed shared buffer
    (L{kcoral.ipc.shared.SharedBuffer}'s C{fileno}, C{len} and C{pread}),
    so L{BodyProducer} relays it, with C{sendfile} where it can.
    """

    def __init__(self, file: IO[bytes], length: int) -> None:
        self._file = file
        self._fd = file.fileno()
        self._length = length

    @classmethod
    def of(cls, file: IO[bytes], length: int) -> Any:
        try:
            return cls(file, length)
        except (AttributeError, OSError, io.UnsupportedOperation):
            return None

    def fileno(self) -> int:
        return self._fd

    def __len__(self) -> int:
        return self._length

    def pread(self, offset: int, size: int) -> bytes:
        return os.pread(self._fd, min(size, self._length - offset), offset)


def _nothing() -> None:
    return None


def _fire(d: Deferred[bool], result: bool) -> None:
    if not d.called:
        d.callback(result)


def _detached(content: IO[bytes], length: int) -> IO[bytes]:
    """
    A file of a request body that outlives the request (Twisted closes a
    request's content when its connection goes).
    """
    try:
        fd = content.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return io.BytesIO(content.read(length))
    copy = os.fdopen(os.dup(fd), "rb")
    copy.seek(0)
    return copy


def _preferred(request: IRequest) -> str | None:
    """The node a client asks for (C{X-KCoral-Node}), when it is a node id."""
    value = _header(request, NODE_HEADER)
    return value if value is not None and valid_id(value) else None


def status_page(health: dict[str, Any]) -> bytes:
    """The C{/status} page: the pool's nodes, seats and queue."""
    from html import escape

    gateway = health["gateway"]
    pool = gateway["pool"]
    rows = "".join(
        "<tr>"
        + "".join(
            f"<td>{escape(str(node[k]))}</td>"
            for k in ("node", "compat", "gpus", "seats", "free", "seen_seconds_ago")
        )
        + "</tr>"
        for node in gateway["nodes"]
    )
    outcomes = "".join(f"<li>{escape(k)}: {v}</li>" for k, v in gateway["requests"].items())
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>kcoral gateway</title></head>
<body><h1>kcoral gateway: {escape(health["status"])}</h1>
<p>NATS {escape(gateway["nats"])}; {pool["nodes"]} nodes, {pool["seats"]} seats
({pool["free_seats"]} free), {pool["gpus"]} GPUs; jobs waiting {health["queue_length"]},
running {health["active_requests"]}; queue depth {gateway["queue_depth"]} of {gateway["queue_size"]}.</p>
<table><tr><th>node</th><th>compat</th><th>GPUs</th><th>seats</th><th>free</th><th>seen (s ago)</th></tr>
{rows}</table>
<h2>Requests</h2><ul>{outcomes}</ul></body></html>
"""
    return page.encode("utf-8")


class _GatewayCollector:
    """The gateway's figures as Prometheus families, read at scrape time."""

    def __init__(self, api: GatewayAPI) -> None:
        self._api = api

    def collect(self) -> Any:
        health = self._api.health()
        gateway = health["gateway"]
        pool = gateway["pool"]
        for name, help_text, value in (
            ("kcoral_gateway_nodes", "Nodes present in the pool.", pool["nodes"]),
            ("kcoral_gateway_seats", "Worker seats of the present nodes.", pool["seats"]),
            ("kcoral_gateway_free_seats", "Free seats the nodes report.", pool["free_seats"]),
            ("kcoral_queue_length", "Jobs waiting for a node's claim.", health["queue_length"]),
            ("kcoral_active_requests", "Jobs claimed and running.", health["active_requests"]),
            ("kcoral_request_capacity", "Seats of the present nodes.", pool["seats"]),
            (
                "kcoral_gateway_nats_connected",
                "1 while the NATS connection is up.",
                1 if gateway["nats"] == "connected" else 0,
            ),
        ):
            family = GaugeMetricFamily(name, help_text)
            family.add_metric([], value)
            yield family
        depth = gateway["queue_depth"]
        if depth is not None:
            family = GaugeMetricFamily("kcoral_gateway_queue_depth", "Messages in the job stream.")
            family.add_metric([], depth)
            yield family
        jobs = CounterMetricFamily(
            "kcoral_gateway_jobs", "Jobs by how they ended.", labels=["outcome"]
        )
        for outcome, count in gateway["outcomes"].items():
            jobs.add_metric([outcome], count)
        yield jobs
        requests = CounterMetricFamily(
            "kcoral_requests", "Requests by finish reason.", labels=["finish_reason"]
        )
        for reason, count in gateway["requests"].items():
            requests.add_metric([reason], count)
        yield requests
