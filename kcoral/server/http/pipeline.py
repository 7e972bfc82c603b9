# -*- test-case-name: tests.unit.test_app -*-
"""
What every KCoral HTTP API does alike: the server's
(L{kcoral.server.http.app.KcoralAPI}) and the gateway's
(L{kcoral.gateway.api.GatewayAPI}).

L{RequestPipeline} is their shared base: the C{/health} answer (503 when
not C{ok}), the C{/execute} body parse (streamed and hashed as it arrived,
or spooled and parsed, small bodies on the reactor thread and large ones
in the thread pool), the C{request_finished} event, and an error's
protocol ERROR answer.  Each API keeps its own Klein routes, which call
these.
"""

from __future__ import annotations

import datetime
import uuid
from typing import IO, Any

import attrs
from twisted.internet.interfaces import IReactorFromThreads, IReactorTime
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.threadpool import ThreadPool
from twisted.web.iweb import IRequest

from kcoral.ipc.shared import SharedBuffer
from kcoral.ipc.uploads import BlobStore, StreamedBody
from kcoral.server.http.component import IKcoralRequest
from kcoral.server.observe.logs import event_level_for_finish_reason
from kcoral.server.workers.pool import PoolBusy
from kcoral.wire.errors import REQUEST_KIND_HEADERS
from kcoral.wire.jsontext import json_dumps
from kcoral.wire.multipart import (
    ParsedRequest,
    RequestBodyParser,
    RequestTooLarge,
    boundary_from_content_type,
    check_blob_references,
    check_tensor_lengths,
)
from kcoral.wire.program import BUILTIN_NAMES, Program, parse_program
from kcoral.wire.render import RequestError

__all__ = [
    "INLINE_PARSE_BYTES",
    "Parsed",
    "RequestPipeline",
    "header",
    "iso_utc",
    "response_request_id",
]

#: Bodies up to this size are parsed on the reactor thread; larger ones in
#: the I/O thread pool.
INLINE_PARSE_BYTES = 64 * 1024

#: Bytes read from the spooled body per parser feed.
READ_CHUNK = 256 * 1024


@attrs.frozen
class Parsed:
    program: Program
    program_bytes: bytes
    #: Supplied blobs by digest: bytes when small, else the sealed shared
    #: buffer the body streamed into (it goes to the cache and the worker
    #: as it is).
    blobs: dict[str, bytes | SharedBuffer]
    request_bytes: int


def iso_utc(timestamp: float) -> str:
    moment = datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc)
    return moment.isoformat().replace("+00:00", "Z")


def parse_body(content: IO[bytes], content_type: str | None, max_bytes: int) -> Parsed:
    """Thread pool: stream the spooled body through the multipart parser."""
    boundary = boundary_from_content_type(content_type)
    parser = RequestBodyParser(boundary, max_bytes=max_bytes, new_blob=BlobStore())
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
    return finish_parse(parsed, total)


def finish_parse(parsed: ParsedRequest, total: int) -> Parsed:
    """Validate a parsed body's program and blobs (any thread)."""
    blobs: dict[str, bytes | SharedBuffer] = {}
    try:
        program = parse_program(parsed.program, builtin_names=BUILTIN_NAMES)
        check_blob_references(program, parsed.blobs)
        for digest, blob in parsed.blobs.items():
            blobs[digest] = blob.shared if blob.shared is not None else blob.read()
        check_tensor_lengths(program, {d: len(b) for d, b in blobs.items()})
    finally:
        for blob in parsed.blobs.values():
            blob.close()
    return Parsed(program, parsed.program, blobs, total)


def streamed_result(streamed: StreamedBody) -> ParsedRequest:
    """A streamed body's parts (any thread); no memfd to be had is the server being busy."""
    try:
        return streamed.result()
    except OSError as e:
        raise PoolBusy(f"server cannot hold the request body: {e}") from None


def settle_streamed(streamed: StreamedBody) -> Parsed:
    """Thread pool: wait for a streamed body's blob threads, then validate it."""
    return finish_parse(streamed_result(streamed), streamed.received)


def _close_parser(parser: RequestBodyParser) -> None:
    close = getattr(parser, "abort", None)
    if close is not None:
        try:
            close()
        except Exception:
            pass


def header(request: IRequest, name: bytes) -> str | None:
    """A request header as text, or C{None}."""
    value = request.getHeader(name)
    if value is None:
        return None
    return value.decode("latin-1") if isinstance(value, bytes) else str(value)


def response_request_id(request: IRequest) -> str:
    """The C{X-Request-ID} this response carries; a fresh one if none yet."""
    values = request.responseHeaders.getRawHeaders(b"X-Request-ID")
    if values:
        return values[0].decode("ascii")
    request_id = str(uuid.uuid4())
    request.setHeader(b"X-Request-ID", request_id.encode())
    return request_id


class RequestPipeline:
    """
    The shared base of the KCoral HTTP APIs.  A subclass has C{_reactor}
    (a clock that also runs threads' results), C{_threadpool}, C{log}, and
    says what its C{health} is and how large a request body may be.
    """

    _reactor: IReactorTime
    _threadpool: ThreadPool
    log: Logger

    def health(self) -> dict[str, Any]:
        raise NotImplementedError

    def max_request_bytes(self) -> int:
        raise NotImplementedError

    def health_answer(self, request: IRequest) -> bytes:
        """C{GET /health}: the health as JSON, 503 unless its status is C{ok}."""
        request.setHeader(b"Content-Type", b"application/json")
        request.setHeader(b"X-Request-ID", str(uuid.uuid4()).encode())
        health = self.health()
        if health["status"] != "ok":
            # A stopping server, a pool without seats: balancers look elsewhere.
            request.setResponseCode(503)
        return json_dumps(health)

    async def _parse(self, request: IRequest) -> Parsed:
        """The request's program and blobs, parsed in the thread pool when large."""
        state = IKcoralRequest(request)
        if state.too_large:
            raise RequestTooLarge()
        if state.over_capacity:
            # Too many request bytes already in flight (--max-bytes-in-flight).
            raise PoolBusy("server saturated")
        threads = IReactorFromThreads(self._reactor)
        streamed = state.body_parser
        if isinstance(streamed, StreamedBody):
            # The body was parsed and hashed as it arrived (kcoral.server.http.request).
            if streamed.settling:
                # A large blob's threads may still be on its last bytes:
                # wait for them on a pool thread, not the reactor.
                settled: Parsed = await deferToThreadPool(
                    threads, self._threadpool, settle_streamed, streamed
                )
                return settled
            parsed_body = streamed_result(streamed)
            if len(parsed_body.program) <= INLINE_PARSE_BYTES:
                return finish_parse(parsed_body, streamed.received)
            finished: Parsed = await deferToThreadPool(
                threads, self._threadpool, finish_parse, parsed_body, streamed.received
            )
            return finished
        arguments = (request.content, header(request, b"content-type"), self.max_request_bytes())
        if state.body_bytes is not None and state.body_bytes <= INLINE_PARSE_BYTES:
            # A small body parses and hashes in well under a millisecond:
            # cheaper here than a round trip through the thread pool.
            return parse_body(*arguments)
        parsed: Parsed = await deferToThreadPool(threads, self._threadpool, parse_body, *arguments)
        return parsed

    def _finished(self, request_id: str, http_status: int, reason: str, **fields: Any) -> None:
        """The C{request_finished} event."""
        self.log.emit(
            event_level_for_finish_reason(reason),
            "request {request_id} finished: {finish_reason} ({http_status})",
            kcoral_event="request_finished",
            request_id=request_id,
            http_status=http_status,
            finish_reason=reason,
            **fields,
        )

    def error_answer(self, request: IRequest, request_id: str, error: RequestError) -> bytes:
        """A request error's ERROR body (protocol §9.2), its status and headers, logged."""
        self._finished(request_id, error.status, error.finish_reason, **error.fields)
        request.setResponseCode(error.status)
        request.setHeader(b"Content-Type", b"application/json")
        for name, value in REQUEST_KIND_HEADERS.get(error.kind, {}).items():
            request.setHeader(name.encode(), value.encode())
        return error.body(request_id)
