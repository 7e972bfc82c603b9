# -*- test-case-name: tests.unit.test_http -*-
"""
L{KcoralChannel}: the connection of a L{kcoral.server.http.site.KcoralSite}.

It answers what Twisted's parser rejects (bad C{Content-Length}, bad
chunking, HTTP/0.9, too many or too large headers) with the protocol's JSON
ERROR body and the right status instead of a bare 400 or a closed
connection, and enforces header and body deadlines that trickling bytes
cannot extend (slowloris); a body that stops arriving for
C{body_stall_timeout} is cut off (408).  A request that needs a token and
carries none valid is refused (401) as soon as its head is in, before any of
its body is read or counted.  When the server closes a connection whose
client may still be sending (a refused body), it closes its own side first
and reads and discards for a while (a lingering close), so the client reads
the answer instead of a reset.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.protocols.policies import ProtocolWrapper
from twisted.python.failure import Failure
from twisted.web.http import HTTPChannel

from kcoral.server.http.component import IKcoralRequest
from kcoral.server.http.refusals import REFUSALS, log_refusal, peer_host, raw_error_response
from kcoral.server.http.request import LimitedRequest
from kcoral.wire.errors import choose_request_id

if TYPE_CHECKING:
    from kcoral.server.http.site import KcoralSite

#: Seconds a client has to send a complete request head, counted from the
#: connection (or the previous response) and never reset by trickled bytes.
DEFAULT_HEADER_TIMEOUT = 30.0

#: Seconds a client has to send a request body, counted from its head.
DEFAULT_BODY_TIMEOUT = 300.0

#: Bytes a connection reads per reactor wakeup, and sends per write.
TRANSPORT_READ_BYTES = 256 * 1024
TRANSPORT_SEND_BYTES = 1 << 20

#: Seconds a new connection has to send its first request head (later heads
#: on a kept-alive connection get the header timeout).
DEFAULT_FIRST_HEADER_TIMEOUT = 10.0

#: Seconds a request body may go without a single byte arriving before it
#: is cut off (408) and its bytes in flight are released.
DEFAULT_BODY_STALL_TIMEOUT = 30.0

#: A lingering close reads and discards for at most this many seconds in
#: all, and stops after this many seconds without a byte.
LINGER_SECONDS = 10.0
LINGER_QUIET_SECONDS = 2.0

_http_log = Logger(namespace="kcoral.server.http")


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
    site: KcoralSite

    _refused = False
    _deadline: IDelayedCall | None = None
    _partial_head = False
    _counted = False
    #: Closing must linger: the client may still be sending a body that
    #: was not read (C{LimitedRequest._skip_body}, a refusal mid-body).
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
            if isinstance(request, LimitedRequest):
                request.release()
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
        timeout = self.site.header_timeout
        if self.fresh:
            first = self.site.first_header_timeout
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
        stall = self.site.body_stall_timeout
        if stall and stall > 0:
            self._last_bytes_at = self._now()
            self._stall_timer = self.callLater(stall, partial(self._check_stall, stall))

    def _check_stall(self, stall: float) -> None:
        self._stall_timer = None
        idle = self._now() - self._last_bytes_at
        requests = self.requests
        paused = (
            bool(requests)
            and isinstance(requests[-1], LimitedRequest)
            and requests[-1].paused_for_backlog
        )
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
        return float(self.site.reactor.seconds())

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
        self.client_host = peer_host(transport)
        self.site.connection_opened(self)
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
            self._start_deadline(self.site.body_timeout, self._body_expired)
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
        if self.requests and IKcoralRequest(self.requests[-1]).unauthorized:
            return
        super()._send100Continue()

    def checkPersistence(self, request: Any, version: bytes) -> bool:
        if self.site.draining:
            # The server is stopping: this answer is the connection's last,
            # so nothing is sent on it that the exiting process would drop.
            request.responseHeaders.setRawHeaders(b"connection", [b"close"])
            return False
        return bool(super().checkPersistence(request, version))
