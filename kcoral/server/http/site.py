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
    trickling bytes cannot extend (slowloris); a body that stops arriving
    for C{body_stall_timeout} is cut off (408).  A request that needs a
    token and carries none valid is refused (401) as soon as its head is
    in, before any of its body is read or counted.  When the server closes
    a connection whose client may still be sending (a refused body), it
    closes its own side first and reads and discards for a while (a
    lingering close), so the client reads the answer instead of a reset.
  - L{KcoralSite} caps the number of open connections, in all (kept below
    the open-file limit) and per client address.  At a cap, the oldest
    connection that has not sent a whole request head yet (then the oldest
    idle kept-alive one) is closed to make room, so a flood of slow
    connections cannot keep clients that send their requests out; only
    when every connection is in a request is a new one answered 503.  It
    counts request body bytes as they arrive against
    C{max_bytes_in_flight}, and against C{max_bytes_per_client} per client
    address.

Every refusal, wherever it is made (here, in the token guard, or by the API
when a body is too large or no worker can be had), is logged once as a
C{request_refused} event by L{log_refusal}, with one of the L{REFUSALS}
reasons: C{/metrics} counts them by status and reason and C{/status} shows
the last ones.

Twisted's own form parsing is turned off (the program's multipart body is
parsed by L{kcoral.wire.multipart} in a thread).
"""

from __future__ import annotations

import errno
import io
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IDelayedCall, IReactorFromThreads
from twisted.internet.protocol import Protocol, connectionDone
from twisted.logger import Logger, LogLevel
from twisted.protocols.policies import ProtocolWrapper
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
#: thread, L{kcoral.ipc.blobsink}) before the connection stops reading; it
#: reads again once they are down to the second figure, several of the hash
#: thread's pieces, so the hash never waits for the socket.  Most of them
#: are already in the blob's memfd (its own memory); the chunks not yet
#: written are a few.
BACKLOG_PAUSE_BYTES = 32 << 20
BACKLOG_RESUME_BYTES = 16 << 20

#: Open connections served at once; more are answered 503 and closed.
DEFAULT_MAX_CONNECTIONS = 4096

#: Seconds a new connection has to send its first request head (later heads
#: on a kept-alive connection get the header timeout).
DEFAULT_FIRST_HEADER_TIMEOUT = 10.0

#: Open connections one client address may have at once.
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 1024

#: Descriptors kept free of connections below the open-file limit, for the
#: workers' pipes, memfds, logs and cache files: at least the first, or
#: the limit divided by the second.
FD_HEADROOM = 256
FD_HEADROOM_DIVISOR = 4

#: A listening port that runs out of descriptors stops accepting for this
#: long (doubling while it goes on, up to the second figure).
ACCEPT_PAUSE_SECONDS = (0.05, 1.0)

#: Connections still waiting for their first head closed to free descriptors
#: when a port runs out of them.
ACCEPT_RELIEF_CONNECTIONS = 16

#: Seconds between two log events about the same kind of trouble (running
#: out of descriptors, closing connections to make room).
TROUBLE_LOG_INTERVAL = 10.0

#: Seconds a request body may go without a single byte arriving before it
#: is cut off (408) and its bytes in flight are released.
DEFAULT_BODY_STALL_TIMEOUT = 30.0

#: Request body bytes one client address may hold at once.
DEFAULT_MAX_BYTES_PER_CLIENT = 512 << 20

#: A lingering close reads and discards for at most this many seconds in
#: all, and stops after this many seconds without a byte.
LINGER_SECONDS = 10.0
LINGER_QUIET_SECONDS = 2.0

#: Why a request was refused (the C{reason} of C{request_refused}), with the
#: HTTP status it was answered with.
REFUSALS: dict[str, int] = {
    "malformed": 400,
    "unauthorized": 401,
    "head_timeout": 408,
    "body_timeout": 408,
    "body_stalled": 408,
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

    Body bytes count against the site's bytes in flight (and the client
    address's share of them) as they arrive, never as declared: a head
    that declares a large body holds nothing.  A declared length that
    cannot fit beside what is already held is refused at once
    (C{over_capacity}, a 503 before the body is read); a body that grows
    past what is left is dropped, its bytes released, and answered 503.

    C{client_name} is the name of the bearer token the request carried
    (L{kcoral.server.http.auth}), or C{None} when the server has no tokens: the
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
    #: The site has tokens and the head carried no valid one for its path:
    #: the body is not read, the token guard answers 401.
    unauthorized = False
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
    #: Of C{_reserved}, the request body bytes counted against the client
    #: address C{_peer} (response bytes held are not).
    _peer_reserved = 0
    _peer: str | None = None

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
            self._peer = peer_host(self.channel.transport if self.channel else None)
            self.notifyFinish().addBoth(self._release)
        if force:
            site.bytes_in_flight += size
        elif not reserve(size, self._reserved, peer=self._peer, peer_held=self._peer_reserved):
            return False
        elif self._peer is not None:
            self._peer_reserved += size
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
        """Give back every byte this request holds and drop its body parser."""
        reserved, self._reserved = self._reserved, 0
        peer_reserved, self._peer_reserved = self._peer_reserved, 0
        site = self._reserved_at
        if reserved and site is not None:
            release = getattr(site, "release_bytes", None)
            if release is not None:
                release(reserved, self._peer, peer_reserved)
            else:
                site.bytes_in_flight -= reserved
        parser, self.body_parser = self.body_parser, None
        if parser is not None:
            parser.abort()

    def _skip_body(self) -> None:
        channel: Any = self.channel
        if channel is not None:
            # Answer now instead of waiting for a body that is never read:
            # the channel treats the request as complete once its headers
            # end, and closes the connection after the response so the
            # unread body cannot be taken for the next request.
            channel.length = 0
            channel.persistent = False
            channel.linger_on_close = True

    def _head_unauthorized(self) -> bool:
        """The site checks tokens and this head's path needs one it lacks."""
        guard = getattr(self._site(), "guard", None)
        if guard is None:
            return False
        path = getattr(self.channel, "_path", None) or b""
        return bool(guard.refuses(path.split(b"?", 1)[0], self.getHeader(b"authorization")))

    def _admits(self, length: int) -> bool:
        """A declared body of C{length} bytes can fit beside those held now."""
        admits = getattr(self._site(), "admits_bytes", None)
        if admits is None:
            return True
        return bool(admits(length, peer_host(self.channel.transport if self.channel else None)))

    def gotLength(self, length: int | None) -> None:
        limit = self._limit()
        if length != 0 and self._head_unauthorized():
            # No token: nothing of the body is read or counted.
            self.unauthorized = True
            length = 0
            self._skip_body()
        elif length is not None and limit is not None and length > limit:
            self.too_large = True
            length = 0
            self._skip_body()
        elif length and not self._admits(length):
            self.over_capacity = True
            length = 0
            self._skip_body()
        self._body_started = self._now()
        if self.too_large or self.over_capacity or self.unauthorized or not self._stream_body():
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
        if not self._reserve(len(data)):
            # The body grew past what is left of the bytes in flight (or of
            # its client's share): drop it and answer 503 once it is in.
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
        # The bytes received so far are discarded: they no longer count.
        self._release()
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
    #: Closing must linger: the client may still be sending a body that
    #: was not read (L{LimitedRequest._skip_body}, a refusal mid-body).
    linger_on_close = False
    _lingering = False
    _linger_timers: tuple[IDelayedCall, ...] = ()
    _stall_timer: IDelayedCall | None = None
    #: Reactor seconds of the last bytes received.
    _last_bytes_at = 0.0
    #: The client's address, for the per-address connection cap.
    client_host: str | None = None
    #: No request head has been completed on this connection yet.
    fresh = True
    #: The path of the request whose body is being read (Twisted forgets
    #: it once the head is in), for the body deadline's refusal event.
    _body_path: bytes | None = None

    def _site_setting(self, name: str, default: float) -> float:
        value = getattr(getattr(self, "site", None), name, default)
        return default if value is None else value

    # -- refusals -----------------------------------------------------------

    def refuse(self, reason: str, message: str | None = None, *, logged: bool = True) -> None:
        """
        Answer the status of C{reason} (one of L{REFUSALS}) with an ERROR
        body once, log the refusal (unless not C{logged}: a connection closed
        to make room is counted by the site instead), and close.
        """
        if self._refused or self.transport is None:
            return
        self._refused = True
        self._cancel_deadline()
        if self._body_path is not None or reason not in ("head_timeout", "connection_cap"):
            # The client may be sending still: let it read this answer.
            self.linger_on_close = True
        for request in self.requests:
            # Whatever it held is given back now, not when the socket closes.
            release = getattr(request, "_release", None)
            if release is not None:
                release()
        request_id = choose_request_id(None)
        self.transport.write(raw_error_response(REFUSALS[reason], message, request_id))
        if logged:
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
        if self._lingering:
            self._discard(line)
            return
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
        timeout = self._site_setting("header_timeout", DEFAULT_HEADER_TIMEOUT)
        if self.fresh:
            first = self._site_setting("first_header_timeout", DEFAULT_FIRST_HEADER_TIMEOUT)
            if first and first > 0:
                timeout = min(timeout, first) if timeout and timeout > 0 else first
        self._start_deadline(timeout, self._head_expired)

    def evict(self) -> None:
        """
        The server is full and this connection has waited longest for a
        request head: a head begun gets the head deadline's 408 now, an idle
        connection is closed.  The site has already stopped counting it.
        """
        if self._partial_head:
            # One event a while counts these (connections_evicted), not one each.
            self.refuse("head_timeout", "the server is full", logged=False)
        else:
            self._cancel_deadline()
            self.loseConnection()

    def _head_expired(self) -> None:
        self._deadline = None
        if self._partial_head:
            self.refuse("head_timeout")
        else:
            self.loseConnection()

    def _body_expired(self) -> None:
        self._deadline = None
        self.refuse("body_timeout")

    def _watch_body(self) -> None:
        """Cut the body off if no byte of it arrives for C{body_stall_timeout}."""
        self._cancel_stall()
        stall = self._site_setting("body_stall_timeout", DEFAULT_BODY_STALL_TIMEOUT)
        if stall and stall > 0:
            self._last_bytes_at = self._now()
            self._stall_timer = self.callLater(stall, partial(self._check_stall, stall))

    def _check_stall(self, stall: float) -> None:
        self._stall_timer = None
        idle = self._now() - self._last_bytes_at
        requests = self.requests
        paused = bool(requests) and getattr(requests[-1], "_paused_for_backlog", False)
        if paused:
            # The server stopped reading (its hash threads are behind): not
            # the client's doing.
            self._last_bytes_at, idle = self._now(), 0.0
        if idle >= stall:
            self.refuse("body_stalled")
            return
        self._stall_timer = self.callLater(stall - idle, partial(self._check_stall, stall))

    def _cancel_stall(self) -> None:
        if self._stall_timer is not None and self._stall_timer.active():
            self._stall_timer.cancel()
        self._stall_timer = None

    def _now(self) -> float:
        reactor = getattr(getattr(self, "site", None), "reactor", None)
        return 0.0 if reactor is None else float(reactor.seconds())

    # -- lingering close ----------------------------------------------------

    def loseConnection(self) -> None:
        if self.linger_on_close and not self._lingering and self._start_linger():
            return
        super().loseConnection()

    def _start_linger(self) -> bool:
        """
        Close the writing side once the answer is sent, then read and
        discard what the client still sends, until it closes, is quiet for
        L{LINGER_QUIET_SECONDS} or L{LINGER_SECONDS} have passed: closing a
        socket with unread bytes sends a reset, which can destroy the answer
        before the client reads it.  C{False} when the transport cannot
        half-close (TLS): it is closed at once.
        """
        transport: Any = self.transport
        half_close = getattr(transport, "loseWriteConnection", None)
        if (
            half_close is None
            or isinstance(transport, ProtocolWrapper)  # TLS: its attributes are the socket's
            or getattr(transport, "disconnecting", False)
        ):
            return False
        self._lingering = True
        self._cancel_deadline()
        self._cancel_stall()
        producer: Any = self._networkProducer
        producer.unregisterProducer()
        half_close()
        transport.resumeProducing()
        self._linger_timers = (
            self.callLater(LINGER_SECONDS, self._end_linger),
            self.callLater(LINGER_QUIET_SECONDS, self._end_linger),
        )
        return True

    def _end_linger(self) -> None:
        self._cancel_linger()
        if self.transport is not None:
            self.transport.loseConnection()

    def _cancel_linger(self) -> None:
        for timer in self._linger_timers:
            if timer.active():
                timer.cancel()
        self._linger_timers = ()

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
        if site is not None and hasattr(site, "connection_opened"):
            self.client_host = peer_host(transport)
            site.connection_opened(self)
            self._counted = True
        self._await_head()
        self._read_now()

    def _read_now(self) -> None:
        """
        Read what the client already sent, at accept time: a client that
        sends its head at once (the head is usually in the socket by the
        time it is accepted) is then in a request before the next
        connection of the same accept burst could close it to make room.
        """
        transport: Any = self.transport
        read = getattr(transport, "doRead", None)
        if (
            read is None
            or isinstance(transport, ProtocolWrapper)
            or not getattr(transport, "connected", False)
        ):
            return  # TLS (its handshake comes first), in-memory transports
        try:
            read()
        except Exception:
            # Whatever the socket says (an error, an early close) it says
            # again to the reactor's next poll.
            _http_log.failure("reading a new connection failed")

    def _discard(self, data: bytes) -> None:
        """Lingering: drop what arrives, and wait again for the client to be quiet."""
        if data and len(self._linger_timers) == 2 and self._linger_timers[1].active():
            self._linger_timers[1].reset(LINGER_QUIET_SECONDS)

    def rawDataReceived(self, data: bytes) -> None:
        # The rest of a read that began a lingering close (the answer was
        # sent while the bytes after its head were being parsed) is dropped
        # here, or it would be buffered and pause the transport.
        if self._lingering:
            self._discard(data)
            return
        super().rawDataReceived(data)

    def dataReceived(self, data: bytes) -> None:
        if self._lingering:
            self._discard(data)
            return
        if self._refused:
            return
        if self._stall_timer is not None:
            self._last_bytes_at = self._now()
        if data and not self._handlingRequest:
            if self.fresh and not self._partial_head and self._counted:
                self.site.connection_trickling(self)
            self._partial_head = True
        super().dataReceived(data)

    def allHeadersReceived(self) -> None:
        self._body_path = getattr(self, "_path", None)
        self.fresh = False
        if self._counted:
            # In a request: never closed to make room.
            self.site.connection_busy(self)
        super().allHeadersReceived()
        if self._refused:
            return
        if self.length == 0:
            self._cancel_deadline()
        else:
            self._start_deadline(
                self._site_setting("body_timeout", DEFAULT_BODY_TIMEOUT), self._body_expired
            )
            self._watch_body()

    def allContentReceived(self) -> None:
        self._cancel_deadline()
        self._cancel_stall()
        self._partial_head = False
        self._body_path = None
        super().allContentReceived()

    def requestDone(self, request: Any) -> None:
        super().requestDone(request)
        if self.persistent and not self._refused and not self.requests:
            if self._counted:
                self.site.connection_idle(self)
            self._await_head()
            # Bytes of a pipelined request already replayed count as a head.
            self._partial_head = bool(getattr(self, "_buffer", b"")) or self._partial_head

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._cancel_deadline()
        self._cancel_stall()
        self._cancel_linger()
        if self._counted:
            self.site.connection_closed(self)
        super().connectionLost(reason)

    def _send100Continue(self) -> None:
        # A request refused for its token as soon as its head was in gets
        # its 401 without first being invited to send the body.
        if self.requests and getattr(self.requests[-1], "unauthorized", False):
            return
        super()._send100Continue()

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
        max_connections_per_client: int = 0,
        first_header_timeout: float = 0.0,
        max_bytes_in_flight: int = 0,
        max_bytes_per_client: int = 0,
        body_stall_timeout: float = DEFAULT_BODY_STALL_TIMEOUT,
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
        self.max_connections_per_client = max_connections_per_client
        self.first_header_timeout = first_header_timeout
        self.open_connections = 0
        #: Open connections by client address.
        self.client_connections: dict[str, int] = {}
        #: Connections not in a request, oldest first (dicts keep their
        #: order), in all and by client address, in the order they are
        #: closed to make room: new ones that sent part of a head (from
        #: their first byte), new ones that sent nothing yet, and idle
        #: kept-alive ones.
        self._trickling: dict[Any, None] = {}
        self._fresh: dict[Any, None] = {}
        self._idle: dict[Any, None] = {}
        self._trickling_of: dict[str | None, dict[Any, None]] = {}
        self._fresh_of: dict[str | None, dict[Any, None]] = {}
        self._idle_of: dict[str | None, dict[Any, None]] = {}
        #: Connections closed to make room for new ones.
        self.evicted_connections = 0
        self._evictions_logged = TroubleLog()
        #: The server is stopping (L{drain}): every answer closes its connection.
        self.draining = False
        self.refused_connections = 0
        self.max_bytes_in_flight = max_bytes_in_flight
        self.bytes_in_flight = 0
        #: Request body bytes held by each client address (only those
        #: holding some are keys).
        self.max_bytes_per_client = max_bytes_per_client
        self.client_bytes: dict[str, int] = {}
        self.body_stall_timeout = body_stall_timeout
        #: The token guard in front of the resource (L{kcoral.server.http.auth}),
        #: asked about each request head; C{None}: the server has no tokens.
        self.guard: Any = None
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

    def admits_bytes(
        self, size: int, peer: str | None = None, held: int = 0, peer_held: int = 0
    ) -> bool:
        """
        Whether C{size} more bytes of request body fit, for a request that
        already holds C{held} (C{peer_held} of them counted for its client
        address C{peer}): under C{max_bytes_in_flight} and the address's
        C{max_bytes_per_client}.  A request alone (of the server, or of its
        address) always fits, so no body within the size limit is refused
        forever.
        """
        cap = self.max_bytes_in_flight
        if cap and self.bytes_in_flight + size > cap and self.bytes_in_flight > held:
            return False
        per_client = self.max_bytes_per_client
        if per_client and peer is not None:
            have = self.client_bytes.get(peer, 0)
            if have + size > per_client and have > peer_held:
                return False
        return True

    def reserve_bytes(
        self, size: int, held: int, *, peer: str | None = None, peer_held: int = 0
    ) -> bool:
        """
        Take C{size} more bytes of request body in flight (L{admits_bytes});
        C{False} when they do not fit.
        """
        if not self.admits_bytes(size, peer, held, peer_held):
            return False
        self.bytes_in_flight += size
        if peer is not None:
            self.client_bytes[peer] = self.client_bytes.get(peer, 0) + size
        return True

    def release_bytes(self, size: int, peer: str | None = None, peer_size: int = 0) -> None:
        """Give back C{size} bytes in flight, C{peer_size} of them C{peer}'s."""
        self.bytes_in_flight -= size
        if peer is not None and peer_size:
            left = self.client_bytes.get(peer, 0) - peer_size
            if left > 0:
                self.client_bytes[peer] = left
            else:
                self.client_bytes.pop(peer, None)

    # -- connections ----------------------------------------------------------

    def fit_to_fd_limit(self, limit: int | None) -> int:
        """
        Keep C{max_connections} below the open-file C{limit} (the soft one),
        leaving L{FD_HEADROOM} (or a L{FD_HEADROOM_DIVISOR}th of it) for
        everything else: a flood then meets the connection cap, where the
        server chooses whom to close, rather than C{EMFILE}.  Returns the
        cap (C{0}: none).
        """
        if limit is None or limit <= 0:
            return self.max_connections
        fit = max(1, limit - max(FD_HEADROOM, limit // FD_HEADROOM_DIVISOR))
        if not self.max_connections or self.max_connections > fit:
            self.max_connections = fit
        return self.max_connections

    def connection_opened(self, channel: Any) -> None:
        """Count a new connection; it waits for its first head."""
        self.open_connections += 1
        host = channel.client_host
        if host is not None:
            self.client_connections[host] = self.client_connections.get(host, 0) + 1
        self._fresh[channel] = None
        self._fresh_of.setdefault(host, {})[channel] = None

    def connection_trickling(self, channel: Any) -> None:
        """New C{channel} sent the first bytes of its head, not all of it."""
        self._forget(channel)
        self._trickling[channel] = None
        self._trickling_of.setdefault(channel.client_host, {})[channel] = None

    def waiting(self) -> int:
        """Connections that have sent no whole request head yet."""
        return len(self._trickling) + len(self._fresh)

    def connection_busy(self, channel: Any) -> None:
        """C{channel} has a whole request head: it is in a request."""
        self._forget(channel)

    def connection_idle(self, channel: Any) -> None:
        """C{channel} answered its requests and waits for the next, kept alive."""
        self._forget(channel)
        self._idle[channel] = None
        self._idle_of.setdefault(channel.client_host, {})[channel] = None

    def connection_closed(self, channel: Any) -> None:
        """Stop counting C{channel} (closed, or being closed to make room)."""
        if not channel._counted:
            return
        channel._counted = False
        self._forget(channel)
        self.open_connections -= 1
        host = channel.client_host
        if host is not None:
            left = self.client_connections.get(host, 0) - 1
            if left > 0:
                self.client_connections[host] = left
            else:
                self.client_connections.pop(host, None)

    def _forget(self, channel: Any) -> None:
        host = channel.client_host
        for everyone, of in (
            (self._trickling, self._trickling_of),
            (self._fresh, self._fresh_of),
            (self._idle, self._idle_of),
        ):
            if everyone.pop(channel, 0) is None:
                mine = of.get(host)
                if mine is not None:
                    mine.pop(channel, None)
                    if not mine:
                        del of[host]

    def evict(self, host: str | None = None, *, everyone: bool = False) -> bool:
        """
        Close the connection of client address C{host} (or with
        C{everyone}, of any address) that has waited longest for its first
        request head, one that began sending it first (a trickler: a client
        sends its head at once, and it is read when the connection is
        accepted), else the one idle longest; C{False} when there is none
        to close.
        """
        if everyone:
            pools = (self._trickling, self._fresh, self._idle)
        else:
            pools = (
                self._trickling_of.get(host) or {},
                self._fresh_of.get(host) or {},
                self._idle_of.get(host) or {},
            )
        for pool in pools:
            if pool:
                victim = next(iter(pool))
                self.connection_closed(victim)
                self.evicted_connections += 1
                due = self._evictions_logged.happened(self.reactor)
                if due is not None:
                    _http_log.warn(
                        "closed {count} waiting connection(s) to make room",
                        kcoral_event="connections_evicted",
                        count=due[0],
                        total=due[1],
                        open_connections=self.open_connections,
                    )
                victim.evict()
                return True
        return False

    def buildProtocol(self, addr: Any) -> Any:
        host = getattr(addr, "host", None)
        host = host if isinstance(host, str) else None
        per_client = self.max_connections_per_client
        full = (
            per_client
            and host is not None
            and self.client_connections.get(host, 0) >= per_client
            and not self.evict(host)
        ) or (
            self.max_connections
            and self.open_connections >= self.max_connections
            and not self.evict(everyone=True)
        )
        if full:
            self.refused_connections += 1
            refusal = _Refusal()
            refusal.factory = self
            return refusal
        return super().buildProtocol(addr)


class TroubleLog:
    """
    Counts a recurring kind of trouble so that it is logged at most once per
    L{TROUBLE_LOG_INTERVAL}, with how many times it happened meanwhile: a
    flood costs a few log lines, not one per connection.
    """

    def __init__(self, interval: float = TROUBLE_LOG_INTERVAL) -> None:
        self.interval = interval
        self.count = 0
        self.total = 0
        self._next_at: float | None = None

    def happened(self, clock: Any) -> tuple[int, int] | None:
        """
        Count one; when it is time to log, C{(count, total)}: how many since
        the last log event and since the start.
        """
        self.count += 1
        self.total += 1
        now = float(clock.seconds()) if clock is not None else 0.0
        if self._next_at is not None and now < self._next_at:
            return None
        self._next_at = now + self.interval
        count, self.count = self.count, 0
        return count, self.total


_http_log = Logger(namespace="kcoral.server.http")


class AcceptGuard:
    """
    Stands in for a listening port's socket (C{port.socket}) so that
    running out of descriptors (C{EMFILE} and friends) neither spins the
    accept loop nor floods the log: the port stops accepting for
    L{ACCEPT_PAUSE_SECONDS} (doubling while it goes on), the oldest
    connections still waiting for their first head are closed to free
    descriptors, and one C{accept_failed} event a L{TROUBLE_LOG_INTERVAL}
    says how often it happened.  Twisted's accept loop then sees
    C{EAGAIN}, as if no one were waiting.
    """

    _EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

    def __init__(self, port: Any, site: KcoralSite, reactor: Any) -> None:
        self._port = port
        self._socket = port.socket
        self._site = site
        self._reactor = reactor
        self._pause = ACCEPT_PAUSE_SECONDS[0]
        self._resume: IDelayedCall | None = None
        self.failures = TroubleLog()

    @classmethod
    def install(cls, port: Any, site: KcoralSite, reactor: Any) -> AcceptGuard | None:
        """Guard C{port}'s socket, where it has one (a TCP or UNIX port)."""
        sock = getattr(port, "socket", None)
        if sock is None or not hasattr(sock, "accept") or isinstance(sock, AcceptGuard):
            return None
        guard = cls(port, site, reactor)
        port.socket = guard
        return guard

    def accept(self) -> Any:
        try:
            accepted = self._socket.accept()
        except OSError as e:
            if e.errno not in self._EXHAUSTED:
                raise
            self._exhausted(e.errno)
            raise BlockingIOError(errno.EAGAIN, "accepting paused") from None
        self._pause = ACCEPT_PAUSE_SECONDS[0]
        return accepted

    def _exhausted(self, code: int) -> None:
        for _ in range(ACCEPT_RELIEF_CONNECTIONS):
            if not self._site.waiting() or not self._site.evict(everyone=True):
                break
        due = self.failures.happened(self._reactor)
        if due is not None:
            _http_log.warn(
                "cannot accept connections ({error}): paused {pause_s} s",
                kcoral_event="accept_failed",
                error=errno.errorcode.get(code, str(code)),
                count=due[0],
                total=due[1],
                pause_s=self._pause,
                open_connections=self._site.open_connections,
            )
        if self._resume is None or not self._resume.active():
            self._port.stopReading()
            self._resume = self._reactor.callLater(self._pause, self._resume_accepting)
            self._pause = min(self._pause * 2, ACCEPT_PAUSE_SECONDS[1])

    def _resume_accepting(self) -> None:
        self._resume = None
        if getattr(self._port, "connected", False):
            self._port.startReading()

    def stop(self) -> None:
        """Cancel a pending resumption (the port stops listening)."""
        if self._resume is not None and self._resume.active():
            self._resume.cancel()
        self._resume = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._socket, name)


def make_site(resource: Any, config: Any, tokens: Any = None, **kwargs: Any) -> KcoralSite:
    """
    The site serving C{resource} under C{config}'s HTTP limits, behind a
    L{kcoral.server.http.auth.TokenGuard} when C{tokens} is given.
    """
    guard = None
    if tokens is not None:
        from kcoral.server.http.auth import TokenGuard

        resource = guard = TokenGuard(resource, tokens, public_metrics=config.public_metrics)
    site = KcoralSite(
        resource,
        max_request_bytes=config.max_request_bytes,
        header_timeout=config.header_timeout_seconds,
        body_timeout=config.body_timeout_seconds,
        max_connections=config.max_connections,
        max_connections_per_client=config.max_connections_per_client,
        first_header_timeout=config.first_header_timeout_seconds,
        max_bytes_in_flight=config.max_bytes_in_flight,
        max_bytes_per_client=config.max_bytes_per_client,
        body_stall_timeout=config.body_stall_seconds,
        **kwargs,
    )
    site.guard = guard
    return site


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
