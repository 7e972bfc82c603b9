# -*- test-case-name: tests.unit.test_http -*-
"""
L{LimitedRequest}: the request of a L{kcoral.server.http.site.KcoralSite}.

It refuses a body over C{site.max_request_bytes} while it arrives (never
buffered), counts body bytes against the site's bytes in flight as they
arrive, parses a multipart body as it arrives when the site streams bodies
(Twisted's own form parsing is turned off; the program's multipart body is
parsed by L{kcoral.wire.multipart}), and turns any non-JSON error page
(Klein's 404/405 HTML, Twisted's 500 page) into the protocol's ERROR body.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any, cast

from twisted.internet.interfaces import IReactorFromThreads
from twisted.web.server import Request

from kcoral.server.http.component import IKcoralRequest, KcoralRequest
from kcoral.server.http.refusals import error_json, log_refusal, peer_host
from kcoral.wire.errors import REQUEST_KIND_HEADERS, choose_request_id

if TYPE_CHECKING:
    from kcoral.server.http.channel import KcoralChannel
    from kcoral.server.http.site import KcoralSite

#: Bytes of a streamed body that may wait for their blob's hash (on a
#: thread, L{kcoral.ipc.blobsink}) before the connection stops reading; it
#: reads again once they are down to the second figure, several of the hash
#: thread's pieces, so the hash never waits for the socket.  Most of them
#: are already in the blob's memfd (its own memory); the chunks not yet
#: written are a few.
BACKLOG_PAUSE_BYTES = 32 << 20
BACKLOG_RESUME_BYTES = 16 << 20


class LimitedRequest(Request):
    """
    A request that stops buffering its body past C{site.max_request_bytes}
    and whose error responses are always the protocol's JSON ERROR body.

    What it learns of itself is its L{IKcoralRequest} component,
    C{self.kcoral} (C{IKcoralRequest(request)} anywhere else).  When a
    declared C{Content-Length} is over the limit, or the body grows over
    it, C{too_large} is set and the remaining bytes are discarded; the
    resource answers 413 once the (discarded) body has been received.

    Body bytes count against the site's bytes in flight (and the client
    address's share of them) as they arrive, never as declared: a head
    that declares a large body holds nothing.  A declared length that
    cannot fit beside what is already held is refused at once
    (C{over_capacity}, a 503 before the body is read); a body that grows
    past what is left is dropped, its bytes released, and answered 503.
    """

    #: Reading has stopped until the body's blob threads catch up
    #: (L{BACKLOG_PAUSE_BYTES}): the channel's stall deadline waits too.
    paused_for_backlog = False
    _error_body_written = False
    _refusal_logged = False
    _reserved = 0
    #: The site the bytes are reserved at (the channel is gone by the time
    #: the request has finished).
    _reserved_at: KcoralSite | None = None
    #: Of C{_reserved}, the request body bytes counted against the client
    #: address C{_peer} (response bytes held are not).
    _peer_reserved = 0
    #: The client address whose share the body counts against, from the
    #: first reservation on (L{_counted_peer}).
    _peer: str | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kcoral = KcoralRequest(
            peer=peer_host(self.transport), body_bytes=0, hold=self.hold_bytes
        )
        self.setComponent(IKcoralRequest, self.kcoral)

    def _site(self) -> KcoralSite | None:
        """The site that made this request (C{None} once its connection is gone)."""
        channel = cast("KcoralChannel | None", self.channel)
        return None if channel is None else channel.site

    def _limit(self) -> int | None:
        site = self._site()
        return None if site is None else site.max_request_bytes

    def _counted_peer(self) -> str | None:
        """
        The client address whose C{max_bytes_per_client} share this body
        counts against: the client's (C{None}: no share, for a subclass's
        routes that have none).
        """
        return self.kcoral.peer

    def _reserve(self, size: int, force: bool = False) -> bool:
        """
        Count C{size} more bytes against the site's bytes in flight; with
        C{force}, whatever the cap (bytes that already exist).
        """
        site = self._site()
        if site is None:
            return True
        if self._reserved_at is None:
            self._reserved_at = site
            self._peer = self._counted_peer()
            self.notifyFinish().addBoth(self.release)
        if force:
            site.bytes_in_flight += size
        elif not site.reserve_bytes(
            size, self._reserved, peer=self._peer, peer_held=self._peer_reserved
        ):
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

    def release(self, result: object = None) -> None:
        """
        Give back every byte this request holds and drop its body parser:
        when it finishes, or when its channel refuses it.
        """
        reserved, self._reserved = self._reserved, 0
        peer_reserved, self._peer_reserved = self._peer_reserved, 0
        site = self._reserved_at
        if reserved and site is not None:
            site.release_bytes(reserved, self._peer, peer_reserved)
        parser, self.kcoral.body_parser = self.kcoral.body_parser, None
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
        site = self._site()
        guard = None if site is None else site.guard
        if guard is None:
            return False
        path = getattr(self.channel, "_path", None) or b""
        return bool(guard.refuses(path.split(b"?", 1)[0], self.getHeader(b"authorization")))

    def _admits(self, length: int) -> bool:
        """A declared body of C{length} bytes can fit beside those held now."""
        site = self._site()
        return site is None or site.admits_bytes(length, self._counted_peer())

    def gotLength(self, length: int | None) -> None:
        limit = self._limit()
        state = self.kcoral
        if length != 0 and self._head_unauthorized():
            # No token: nothing of the body is read or counted.
            state.unauthorized = True
            length = 0
            self._skip_body()
        elif length is not None and limit is not None and length > limit:
            state.too_large = True
            length = 0
            self._skip_body()
        elif length and not self._admits(length):
            state.over_capacity = True
            length = 0
            self._skip_body()
        site = self._site()
        if site is not None:
            state.clock = site.reactor
            state.head_at = float(site.reactor.seconds())
        if state.too_large or state.over_capacity or state.unauthorized or not self._stream_body():
            # Twisted's own content file: a temporary file on disk past 100 kB.
            super().gotLength(length)

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        self.kcoral.body_seconds = self.kcoral.since_head()
        super().requestReceived(command, path, version)

    def _stream_body(self) -> bool:
        """
        Parse a multipart body as it arrives, when the site does so (then
        nothing is spooled: C{content} stays empty); whether it does.
        """
        site = self._site()
        make = None if site is None else site.streamed_body
        if make is None:
            return False
        values = self.requestHeaders.getRawHeaders(b"content-type")
        content_type = values[-1].decode("latin-1") if values else None
        parser = make(content_type)
        if parser is None:
            return False
        self.kcoral.body_parser = parser
        self.content = io.BytesIO()
        return True

    def handleContentChunk(self, data: bytes) -> None:
        state = self.kcoral
        if state.too_large or state.over_capacity:
            return
        received = state.body_bytes = (state.body_bytes or 0) + len(data)
        limit = self._limit()
        if limit is not None and received > limit:
            state.too_large = True
            self._drop_body()
            return
        if not self._reserve(len(data)):
            # The body grew past what is left of the bytes in flight (or of
            # its client's share): drop it and answer 503 once it is in.
            state.over_capacity = True
            self._drop_body()
            return
        parser = state.body_parser
        if parser is not None:
            parser.feed(data)
            if self.paused_for_backlog or parser.backlog() > BACKLOG_PAUSE_BYTES:
                self._check_backlog()
            return
        super().handleContentChunk(data)

    def _check_backlog(self) -> None:
        """
        Stop reading the connection while its body's blob threads are more
        than L{BACKLOG_PAUSE_BYTES} behind, until they are down to
        L{BACKLOG_RESUME_BYTES}: TCP then holds the client back.
        """
        parser = self.kcoral.body_parser
        backlog = 0 if parser is None else parser.backlog()
        transport: Any = self.transport
        if not self.paused_for_backlog:
            if parser is None or backlog <= BACKLOG_PAUSE_BYTES:
                return
            self.paused_for_backlog = True
            transport.pauseProducing()
        elif parser is None or backlog <= BACKLOG_RESUME_BYTES:
            self.paused_for_backlog = False
            transport.resumeProducing()
            return
        site = self._site()
        if site is None:
            return  # the connection is gone
        from_threads = IReactorFromThreads(site.reactor)
        parser.when_drained(
            BACKLOG_RESUME_BYTES, lambda: from_threads.callFromThread(self._check_backlog)
        )

    def _drop_body(self) -> None:
        # The bytes received so far are discarded: they no longer count.
        self.release()
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
            return "bytes_in_flight" if self.kcoral.over_capacity else "busy"
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
