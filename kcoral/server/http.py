# -*- test-case-name: tests.unit.test_http -*-
"""
The HTTP boundary: everything between the socket and the Klein resource.

  - L{LimitedRequest} refuses a body over C{site.max_request_bytes} while it
    arrives (never buffered), and turns any non-JSON error page (Klein's
    404/405 HTML, Twisted's 500 page) into the protocol's ERROR body.
  - L{KcoralChannel} answers what Twisted's parser rejects (bad
    C{Content-Length}, bad chunking, HTTP/0.9, too many or too large
    headers) with the same JSON body and the right status instead of a bare
    400 or a closed connection, and enforces header and body deadlines that
    trickling bytes cannot extend (slowloris).
  - L{KcoralSite} caps the number of open connections (503 past the cap).

Every refusal, wherever it is made (here, in the token guard, or by the API
when a body is too large or no worker can be had), is logged once as a
C{request_refused} event by L{log_refusal}, with one of the L{REFUSALS}
reasons: C{/metrics} counts them by status and reason and C{/status} shows
the last ones.

Twisted's own form parsing is turned off (the program's multipart body is
parsed by L{kcoral.wire.multipart} in a thread).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IDelayedCall, IReactorFromThreads
from twisted.internet.protocol import Protocol, connectionDone
from twisted.logger import Logger, LogLevel
from twisted.python.failure import Failure
from twisted.web.http import HTTPChannel
from twisted.web.server import Request, Site

from kcoral.wire.errors import REQUEST_KIND_HEADERS, choose_request_id, error_body, status_error
from kcoral.wire.jsontext import json_dumps
from kcoral.wire.multipart import StreamedBody

#: Seconds a client has to send a complete request head, counted from the
#: connection (or the previous response) and never reset by trickled bytes.
DEFAULT_HEADER_TIMEOUT = 30.0

#: Seconds a client has to send a request body, counted from its head.
DEFAULT_BODY_TIMEOUT = 300.0

#: Bytes a connection reads per reactor wakeup, and sends per write.
TRANSPORT_READ_BYTES = 256 * 1024
TRANSPORT_SEND_BYTES = 1 << 20

#: Bytes of a streamed body that may wait for their blob's hash (on a
#: thread, L{kcoral.wire.blobsink}) before the connection stops reading; it
#: reads again once they are down to the second figure, several of the hash
#: thread's pieces, so the hash never waits for the socket.  Most of them
#: are already in the blob's memfd (its own memory); the chunks not yet
#: written are a few.
BACKLOG_PAUSE_BYTES = 32 << 20
BACKLOG_RESUME_BYTES = 16 << 20

#: Open connections served at once; more are answered 503 and closed.
DEFAULT_MAX_CONNECTIONS = 4096

#: Why a request was refused (the C{reason} of C{request_refused}), with the
#: HTTP status it was answered with.
REFUSALS: dict[str, int] = {
    "malformed": 400,
    "unauthorized": 401,
    "head_timeout": 408,
    "body_timeout": 408,
    "body_too_large": 413,
    "uri_too_long": 414,
    "header_too_large": 431,
    "too_many_headers": 431,
    "connection_cap": 503,
    "bytes_in_flight": 503,
    "busy": 503,
}

#: The longest C{path} a refusal event carries.
REFUSAL_PATH_LIMIT = 200

_refusal_log = Logger(namespace="kcoral.server.refusals")


def log_refusal(
    reason: str, *, client: str | None, request_id: str | None, path: bytes | None = None
) -> None:
    """
    Log the C{request_refused} event of a refusal: C{status} and C{reason}
    (one of L{REFUSALS}), the C{client}'s address, the C{request_id} of the
    answer (its C{X-Request-ID}) and the C{path} asked for when it was read.
    A server refusing service (503) or a request without a valid token (401)
    is a warning; a client's own fault is information.
    """
    status = REFUSALS[reason]
    _refusal_log.emit(
        LogLevel.warn if status in (401, 503) else LogLevel.info,
        "refused a request from {client}: {status} {reason}",
        kcoral_event="request_refused",
        status=status,
        reason=reason,
        client=client,
        request_id=request_id,
        path=None if path is None else path[:REFUSAL_PATH_LIMIT].decode("latin-1"),
    )


def peer_host(transport: Any) -> str | None:
    """The client's IP address on C{transport} (C{None} for a UNIX socket)."""
    peer = getattr(transport, "getPeer", None)
    host = getattr(peer(), "host", None) if peer is not None else None
    return host if isinstance(host, str) else None


_REASONS = {
    400: b"Bad Request",
    401: b"Unauthorized",
    404: b"Not Found",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    413: b"Content Too Large",
    414: b"URI Too Long",
    431: b"Request Header Fields Too Large",
    500: b"Internal Server Error",
    503: b"Service Unavailable",
}


def error_json(status: int, request_id: str, message: str | None = None) -> tuple[str, bytes]:
    """The kind and the encoded ERROR body (protocol §9.2) for C{status}."""
    kind, default = status_error(status)
    return kind, json_dumps(error_body(request_id, kind, message or default))


def raw_error_response(status: int, message: str | None = None, request_id: str = "") -> bytes:
    """
    A complete HTTP/1.1 error response with a JSON ERROR body, for the
    moments before a L{Request} can answer (the request head is broken, the
    client is too slow, the server is full).  The connection always closes.
    """
    request_id = request_id or choose_request_id(None)
    kind, body = error_json(status, request_id, message)
    lines = [
        b"HTTP/1.1 %d %s" % (status, _REASONS.get(status, b"Error")),
        b"Content-Type: application/json",
        b"Content-Length: %d" % (len(body),),
        b"X-Request-ID: " + request_id.encode("ascii"),
        b"Connection: close",
    ]
    for name, value in REQUEST_KIND_HEADERS.get(kind, {}).items():
        lines.append(name.encode("ascii") + b": " + value.encode("ascii"))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


class LimitedRequest(Request):
    """
    A request that stops buffering its body past C{site.max_request_bytes}
    and whose error responses are always the protocol's JSON ERROR body.

    When a declared C{Content-Length} is over the limit, or the body grows
    over it, C{too_large} is set and the remaining bytes are discarded; the
    resource answers 413 once the (discarded) body has been received.

    C{client_name} is the name of the bearer token the request carried
    (L{kcoral.server.auth}), or C{None} when the server has no tokens: the
    client identity that worker reuse is scoped by.
    """

    too_large = False
    #: The server already holds C{max_bytes_in_flight} of request bodies:
    #: this body is discarded and the request answered 503.
    over_capacity = False
    #: The multipart body parsed as it arrives (L{StreamedBody}), when the
    #: site streams bodies: nothing is spooled, C{content} stays empty.
    body_parser: StreamedBody | None = None
    body_bytes = 0
    client_name: str | None = None
    #: Reactor seconds from the end of the request head to the last body
    #: byte (C{None} until the body is complete): the upload as the server
    #: sees it.
    body_seconds: float | None = None
    _body_started: float | None = None
    _error_body_written = False
    _paused_for_backlog = False
    _refusal_logged = False
    _reserved = 0
    _reserved_at: Any = None

    def _site(self) -> Any:
        return getattr(self.channel, "site", None)

    def _limit(self) -> int | None:
        return getattr(self._site(), "max_request_bytes", None)

    def _reserve(self, size: int, force: bool = False) -> bool:
        """
        Count C{size} more bytes against the site's bytes in flight; with
        C{force}, whatever the cap (bytes that already exist).
        """
        site = self._site()
        reserve = getattr(site, "reserve_bytes", None)
        if reserve is None:
            return True
        if self._reserved_at is None:
            # The channel is gone by the time the request has finished.
            self._reserved_at = site
            self.notifyFinish().addBoth(self._release)
        if force:
            site.bytes_in_flight += size
        elif not reserve(size, self._reserved):
            return False
        self._reserved += size
        return True

    def hold_bytes(self, size: int) -> None:
        """
        Count a response's C{size} bytes of shared result buffers against
        the bytes in flight until the request finishes: while large results
        stream out, new bodies past the cap are answered 503.
        """
        if size:
            self._reserve(size, force=True)

    def _release(self, result: object = None) -> None:
        reserved, self._reserved = self._reserved, 0
        if reserved and self._reserved_at is not None:
            self._reserved_at.bytes_in_flight -= reserved
        parser, self.body_parser = self.body_parser, None
        if parser is not None:
            parser.abort()

    def _skip_body(self) -> None:
        channel = self.channel
        if channel is not None:
            # Answer now instead of waiting for a body that is never read:
            # the channel treats the request as complete once its headers
            # end, and closes the connection after the response so the
            # unread body cannot be taken for the next request.
            channel.length = 0
            channel.persistent = False

    def gotLength(self, length: int | None) -> None:
        limit = self._limit()
        if length is not None and limit is not None and length > limit:
            self.too_large = True
            length = 0
            self._skip_body()
        elif length and not self._reserve(length):
            self.over_capacity = True
            length = 0
            self._skip_body()
        self._body_started = self._now()
        if self.too_large or self.over_capacity or not self._stream_body():
            # Twisted's own content file: a temporary file on disk past 100 kB.
            super().gotLength(length)

    def _now(self) -> float | None:
        reactor = getattr(self._site(), "reactor", None)
        return None if reactor is None else float(reactor.seconds())

    def since_head(self) -> float | None:
        """Reactor seconds since the end of the request head (C{None}: not measured)."""
        started, now = self._body_started, self._now()
        return None if started is None or now is None else now - started

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        started, now = self._body_started, self._now()
        if started is not None and now is not None:
            self.body_seconds = now - started
        super().requestReceived(command, path, version)

    def _stream_body(self) -> bool:
        """
        Parse a multipart body as it arrives, when the site does so (then
        nothing is spooled: C{content} stays empty); whether it does.
        """
        make = getattr(self._site(), "streamed_body", None)
        if make is None:
            return False
        values = self.requestHeaders.getRawHeaders(b"content-type")
        content_type = values[-1].decode("latin-1") if values else None
        parser = make(content_type)
        if parser is None:
            return False
        self.body_parser = parser
        self.content = io.BytesIO()
        return True

    def handleContentChunk(self, data: bytes) -> None:
        if self.too_large or self.over_capacity:
            return
        self.body_bytes += len(data)
        limit = self._limit()
        if limit is not None and self.body_bytes > limit:
            self.too_large = True
            self._drop_body()
            return
        if self.body_bytes > self._reserved and not self._reserve(self.body_bytes - self._reserved):
            # A chunked body (no declared length) grew past what is left.
            self.over_capacity = True
            self._drop_body()
            return
        if self.body_parser is not None:
            self.body_parser.feed(data)
            if self._paused_for_backlog or self.body_parser.backlog() > BACKLOG_PAUSE_BYTES:
                self._check_backlog()
            return
        super().handleContentChunk(data)

    def _check_backlog(self) -> None:
        """
        Stop reading the connection while its body's blob threads are more
        than L{BACKLOG_PAUSE_BYTES} behind, until they are down to
        L{BACKLOG_RESUME_BYTES}: TCP then holds the client back.
        """
        parser = self.body_parser
        backlog = 0 if parser is None else parser.backlog()
        transport: Any = self.transport
        if not self._paused_for_backlog:
            if parser is None or backlog <= BACKLOG_PAUSE_BYTES:
                return
            self._paused_for_backlog = True
            transport.pauseProducing()
        elif parser is None or backlog <= BACKLOG_RESUME_BYTES:
            self._paused_for_backlog = False
            transport.resumeProducing()
            return
        from_threads = IReactorFromThreads(self._site().reactor)
        parser.when_drained(
            BACKLOG_RESUME_BYTES, lambda: from_threads.callFromThread(self._check_backlog)
        )

    def _drop_body(self) -> None:
        parser, self.body_parser = self.body_parser, None
        if parser is not None:
            parser.abort()
        content = getattr(self, "content", None)
        if content is not None:
            try:
                content.seek(0)
                content.truncate()
            except Exception:
                pass

    # -- error bodies -------------------------------------------------------

    def _needs_json_error(self) -> bool:
        if self.startedWriting or self.code < 400:
            return False
        content_type = self.responseHeaders.getRawHeaders(b"content-type") or [b""]
        return not content_type[-1].lower().startswith(b"application/json")

    def _write_json_error(self) -> None:
        """Replace whatever error page was coming with the ERROR body."""
        ids = self.responseHeaders.getRawHeaders(b"x-request-id")
        if ids:
            request_id = ids[0].decode("ascii", "replace")
        else:
            sent = self.requestHeaders.getRawHeaders(b"x-request-id")
            request_id = choose_request_id(None if sent is None else list(sent))
            self.setHeader(b"X-Request-ID", request_id.encode("ascii"))
        kind, body = error_json(self.code, request_id)
        for name, value in REQUEST_KIND_HEADERS.get(kind, {}).items():
            self.setHeader(name.encode("ascii"), value.encode("ascii"))
        self.setHeader(b"Content-Type", b"application/json")
        self.setHeader(b"Content-Length", str(len(body)).encode("ascii"))
        self._error_body_written = True
        super().write(body)

    def write(self, data: bytes) -> None:
        if self._error_body_written:
            return
        if self._needs_json_error():
            self._write_json_error()
            return
        super().write(data)

    def finish(self) -> None:
        if not self._error_body_written and self._needs_json_error() and not self._disconnected:
            self._write_json_error()
        self._log_refusal()
        super().finish()

    def _refusal_reason(self) -> str | None:
        """
        The L{REFUSALS} reason of this response, if it is a refusal made
        above the channel: the token guard's 401, the API's 413, or its 503
        (over C{max_bytes_in_flight}, or no worker: the queue is full, the
        wait ran out, or the server is stopping).
        """
        if self.code == 401:
            return "unauthorized"
        if self.code == 413:
            return "body_too_large"
        if self.code == 503 and self.path != b"/health":
            # (/health's 503 is a stopping server's answer, not a refusal.)
            return "bytes_in_flight" if self.over_capacity else "busy"
        return None

    def _log_refusal(self) -> None:
        reason = self._refusal_reason()
        if reason is None or self._refusal_logged:
            return
        self._refusal_logged = True
        ids = self.responseHeaders.getRawHeaders(b"x-request-id")
        log_refusal(
            reason,
            client=peer_host(self.channel.transport if self.channel else None),
            request_id=ids[0].decode("ascii", "replace") if ids else None,
            path=self.path,
        )


class KcoralChannel(HTTPChannel):
    """
    An L{HTTPChannel} whose refusals are JSON ERROR bodies and whose request
    head and body must arrive within fixed deadlines.

    Twisted's idle timeout is reset by every byte, so one byte every few
    seconds holds a connection forever; these deadlines are not.  An idle
    keep-alive connection whose deadline passes before any byte of a next
    request is simply closed.
    """

    #: Set by L{Site.buildProtocol}.
    site: Any

    _refused = False
    _deadline: IDelayedCall | None = None
    _partial_head = False
    _counted = False
    #: The path of the request whose body is being read (Twisted forgets
    #: it once the head is in), for the body deadline's refusal event.
    _body_path: bytes | None = None

    def _site_setting(self, name: str, default: float) -> float:
        value = getattr(getattr(self, "site", None), name, default)
        return default if value is None else value

    # -- refusals -----------------------------------------------------------

    def refuse(self, reason: str, message: str | None = None) -> None:
        """
        Answer the status of C{reason} (one of L{REFUSALS}) with an ERROR
        body once, log the refusal, and close.
        """
        if self._refused or self.transport is None:
            return
        self._refused = True
        self._cancel_deadline()
        request_id = choose_request_id(None)
        self.transport.write(raw_error_response(REFUSALS[reason], message, request_id))
        log_refusal(
            reason,
            client=peer_host(self.transport),
            request_id=request_id,
            path=getattr(self, "_path", None) or self._body_path,
        )
        self.loseConnection()

    def _respondToBadRequestAndDisconnect(self) -> None:
        # Bad Content-Length or Transfer-Encoding, bad chunking, a request
        # line without three parts (HTTP/0.9), a malformed header line.
        self.refuse("malformed")

    def lineLengthExceeded(self, line: bytes) -> None:
        if getattr(self, "_HTTPChannel__first_line", 0):
            self.refuse("uri_too_long")
        else:
            self.refuse("header_too_large")

    def lineReceived(self, line: bytes) -> None:
        if self._receivedHeaderSize + len(line) > self.totalHeadersSize:
            self.refuse("header_too_large")
            return
        super().lineReceived(line)

    def headerReceived(self, line: bytes) -> bool:
        if self._receivedHeaderCount >= self.maxHeaders:
            self.refuse("too_many_headers")
            return False
        return bool(super().headerReceived(line))

    # -- deadlines ----------------------------------------------------------

    def _start_deadline(self, seconds: float, expired: Any) -> None:
        self._cancel_deadline()
        if seconds and seconds > 0:
            self._deadline = self.callLater(seconds, expired)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None and self._deadline.active():
            self._deadline.cancel()
        self._deadline = None

    def _await_head(self) -> None:
        self._partial_head = False
        self._start_deadline(
            self._site_setting("header_timeout", DEFAULT_HEADER_TIMEOUT), self._head_expired
        )

    def _head_expired(self) -> None:
        self._deadline = None
        if self._partial_head:
            self.refuse("head_timeout")
        else:
            self.loseConnection()

    def _body_expired(self) -> None:
        self._deadline = None
        self.refuse("body_timeout")

    def connectionMade(self) -> None:
        super().connectionMade()
        transport: Any = self.transport
        if transport is not None:
            # Tensors come and go in MiBs: fewer, larger reads and sends
            # (Twisted's defaults, 64 KiB and 128 KiB, mean a reactor
            # iteration per 64 KiB of a 64 MiB upload).
            transport.bufferSize = TRANSPORT_READ_BYTES
            transport.SEND_LIMIT = TRANSPORT_SEND_BYTES
        site = getattr(self, "site", None)
        if site is not None and hasattr(site, "open_connections"):
            site.open_connections += 1
            self._counted = True
        self._await_head()

    def dataReceived(self, data: bytes) -> None:
        if self._refused:
            return
        if data and not self._handlingRequest:
            self._partial_head = True
        super().dataReceived(data)

    def allHeadersReceived(self) -> None:
        self._body_path = getattr(self, "_path", None)
        super().allHeadersReceived()
        if self._refused:
            return
        if self.length == 0:
            self._cancel_deadline()
        else:
            self._start_deadline(
                self._site_setting("body_timeout", DEFAULT_BODY_TIMEOUT), self._body_expired
            )

    def allContentReceived(self) -> None:
        self._cancel_deadline()
        self._partial_head = False
        self._body_path = None
        super().allContentReceived()

    def requestDone(self, request: Any) -> None:
        super().requestDone(request)
        if self.persistent and not self._refused and not self.requests:
            self._await_head()
            # Bytes of a pipelined request already replayed count as a head.
            self._partial_head = bool(getattr(self, "_buffer", b"")) or self._partial_head

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._cancel_deadline()
        if self._counted:
            self._counted = False
            self.site.open_connections -= 1
        super().connectionLost(reason)

    def checkPersistence(self, request: Any, version: bytes) -> bool:
        if getattr(getattr(self, "site", None), "draining", False):
            # The server is stopping: this answer is the connection's last,
            # so nothing is sent on it that the exiting process would drop.
            request.responseHeaders.setRawHeaders(b"connection", [b"close"])
            return False
        return bool(super().checkPersistence(request, version))


class _Refusal(Protocol):
    """Answers 503 and closes: the server already has too many connections."""

    def connectionMade(self) -> None:
        assert self.transport is not None
        request_id = choose_request_id(None)
        self.transport.write(raw_error_response(503, "too many open connections", request_id))
        log_refusal("connection_cap", client=peer_host(self.transport), request_id=request_id)
        self.transport.loseConnection()


class KcoralSite(Site):
    """
    A L{Site} of L{KcoralChannel}s and L{LimitedRequest}s, with form parsing
    disabled and at most C{max_connections} connections at once.
    """

    protocol = KcoralChannel  # type: ignore[assignment]
    requestFactory = LimitedRequest

    def __init__(
        self,
        resource: Any,
        *,
        max_request_bytes: int,
        header_timeout: float = DEFAULT_HEADER_TIMEOUT,
        body_timeout: float = DEFAULT_BODY_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_bytes_in_flight: int = 0,
        stream_bodies: bool = True,
        **kwargs: Any,
    ) -> None:
        try:
            super().__init__(resource, parsePOSTFormSubmission=False, **kwargs)
        except TypeError:  # older Twisted: the request ignores form bodies anyway
            super().__init__(resource, **kwargs)
        self.max_request_bytes = max_request_bytes
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.max_connections = max_connections
        self.open_connections = 0
        #: The server is stopping (L{drain}): every answer closes its connection.
        self.draining = False
        self.refused_connections = 0
        self.max_bytes_in_flight = max_bytes_in_flight
        self.bytes_in_flight = 0
        self.displayTracebacks = False
        #: Makes the L{StreamedBody} a multipart request body streams into,
        #: or C{None}: bodies are spooled by Twisted and parsed afterwards.
        self.streamed_body: Callable[[str | None], StreamedBody | None] | None = (
            partial(StreamedBody.for_content_type, max_bytes=max_request_bytes)
            if stream_bodies
            else None
        )

    def drain(self) -> None:
        """
        The server stopped listening: from now on every answer, a 503 for a
        program that arrives on a kept-alive connection included, closes its
        connection (C{Connection: close}).  A proxy then opens a new
        connection for its next request, which is refused and goes to
        another node, instead of sending it on a connection the exiting
        process would drop unanswered.
        """
        self.draining = True

    def reserve_bytes(self, size: int, held: int) -> bool:
        """
        Take C{size} more bytes of request body in flight for a request that
        already holds C{held}; C{False} when that would pass the cap.  A
        request alone is always let in, so no body within the size limit is
        refused forever.
        """
        cap = self.max_bytes_in_flight
        if cap and self.bytes_in_flight + size > cap and self.bytes_in_flight > held:
            return False
        self.bytes_in_flight += size
        return True

    def buildProtocol(self, addr: Any) -> Any:
        if self.max_connections and self.open_connections >= self.max_connections:
            self.refused_connections += 1
            refusal = _Refusal()
            refusal.factory = self
            return refusal
        return super().buildProtocol(addr)


def make_site(resource: Any, config: Any, tokens: Any = None, **kwargs: Any) -> KcoralSite:
    """
    The site serving C{resource} under C{config}'s HTTP limits, behind a
    L{kcoral.server.auth.TokenGuard} when C{tokens} is given.
    """
    if tokens is not None:
        from kcoral.server.auth import TokenGuard

        resource = TokenGuard(resource, tokens, public_metrics=config.public_metrics)
    return KcoralSite(
        resource,
        max_request_bytes=config.max_request_bytes,
        header_timeout=config.header_timeout_seconds,
        body_timeout=config.body_timeout_seconds,
        max_connections=config.max_connections,
        max_bytes_in_flight=config.max_bytes_in_flight,
        **kwargs,
    )


async def listen_all(reactor: Any, descriptions: Sequence[str], site: Site) -> list[Any]:
    """
    Listen on every endpoint description; if one fails, stop those already
    listening and raise.
    """
    ports: list[Any] = []
    try:
        for description in descriptions:
            ports.append(await serverFromString(reactor, description).listen(site))
    except BaseException:
        for port in ports:
            await port.stopListening()
        raise
    return ports


def port_hosts(ports: Sequence[Any]) -> list[str]:
    """The IP addresses C{ports} are bound to (UNIX sockets have none)."""
    hosts = []
    for port in ports:
        host = getattr(port.getHost(), "host", None)
        if isinstance(host, str):
            hosts.append(host)
    return hosts


def raise_fd_limit() -> tuple[int, int] | None:
    """
    Raise the soft limit on open files to the hard limit (systemd's soft
    default of 1,024 is a few hundred idle connections); returns the
    (old, new) soft limits, or C{None} where the platform has no such limit.
    """
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return (soft, soft)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return (soft, soft)
    return (soft, target)
