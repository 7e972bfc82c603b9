"""
Tests for L{kcoral.server.http.site} (with its channel, request, refusals
and accept guard): every refusal of the HTTP layer is the protocol's JSON
ERROR body with the right status, and request heads and
bodies have deadlines that trickling cannot extend.  In memory: a
L{StringTransport} and a L{Clock}, no sockets.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import resource
import threading
from typing import Any

from klein import Klein
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IReactorFromThreads
from twisted.internet.protocol import Factory
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import capturedLogs
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.python.failure import Failure
from twisted.trial.unittest import SkipTest, SynchronousTestCase
from twisted.web.iweb import IRequest
from zope.interface import implementer

from kcoral.ipc import shared
from kcoral.server.http.accept import (
    ACCEPT_PAUSE_SECONDS,
    TROUBLE_LOG_INTERVAL,
    AcceptGuard,
    raise_fd_limit,
)
from kcoral.server.http.auth import TokenGuard, parse_tokens
from kcoral.server.http.channel import LINGER_SECONDS
from kcoral.server.http.component import IKcoralRequest
from kcoral.server.http.refusals import REFUSALS, raw_error_response
from kcoral.server.http.request import BACKLOG_PAUSE_BYTES
from kcoral.server.http.site import KcoralSite
from kcoral.testing.live_server import multipart_body
from kcoral.wire.program import ValidationError

from .test_blobsink import hold_hashing


class _Routes:
    app = Klein()

    @app.route("/hello", methods=["GET"])
    def hello(self, request: IRequest) -> bytes:
        request.setHeader(b"Content-Type", b"application/json")
        return b'{"ok": true}'

    @app.route("/boom", methods=["GET"])
    def boom(self, request: IRequest) -> bytes:
        raise RuntimeError("a bug")

    held: list[Deferred[bytes]] = []

    @app.route("/hold", methods=["POST"])
    def hold(self, request: IRequest) -> Deferred[bytes]:
        d: Deferred[bytes] = Deferred()
        _Routes.held.append(d)
        return d

    @app.route("/flag", methods=["POST"])
    def flag(self, request: IRequest) -> bytes:
        request.setHeader(b"Content-Type", b"application/json")
        over = IKcoralRequest(request).over_capacity
        return json.dumps({"over": over, "read": len(request.content.read())}).encode()

    @app.route("/answer/<int:code>", methods=["GET", "POST"])
    def answer(self, request: IRequest, code: int) -> bytes:
        # What the API does for its own refusals (413, 503): a status, the
        # request's id, a JSON body.
        request.setResponseCode(code)
        request.setHeader(b"Content-Type", b"application/json")
        request.setHeader(b"X-Request-ID", b"answer-%d" % (code,))
        return b"{}"

    @app.route("/result", methods=["POST"])
    def result(self, request: IRequest) -> Deferred[bytes]:
        # What the API does while it streams large result parts.
        IKcoralRequest(request).hold_bytes(1200)
        d: Deferred[bytes] = Deferred()
        _Routes.held.append(d)
        return d

    @app.route("/parts", methods=["POST"])
    def parts(self, request: IRequest) -> bytes:
        request.setHeader(b"Content-Type", b"application/json")
        state = IKcoralRequest(request)
        streamed = state.body_parser
        assert streamed is not None
        try:
            parsed = streamed.result()
        except ValidationError as e:
            return json.dumps({"error": e.message, "received": streamed.received}).encode()
        blobs = {
            digest: "shared" if blob.shared is not None else "bytes"
            for digest, blob in parsed.blobs.items()
        }
        return json.dumps(
            {
                "program": parsed.program.decode(),
                "blobs": blobs,
                "spooled": len(request.content.read()),
                "content": type(request.content).__name__,
                "body_seconds": state.body_seconds,
            }
        ).encode()

    @app.route("/upload", methods=["POST"])
    def upload(self, request: IRequest) -> bytes:
        request.setHeader(b"Content-Type", b"application/json")
        return b'{"read": %d}' % len(request.content.read())


def parse_responses(data: bytes) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    """Split raw HTTP/1.1 responses (Content-Length or chunked bodies)."""
    responses = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ")[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        if headers.get(b"transfer-encoding") == b"chunked":
            body = b""
            while True:
                size_line, _, rest = rest.partition(b"\r\n")
                size = int(size_line, 16)
                body, rest = body + rest[:size], rest[size + 2 :]
                if size == 0:
                    break
            responses.append((status, headers, body))
            data = rest
            continue
        length = int(headers.get(b"content-length", b"0"))
        responses.append((status, headers, rest[:length]))
        data = rest[length:]
    return responses


@implementer(IReactorFromThreads)
class _ThreadsClock(Clock):
    """A clock that runs calls from other threads when the test says so."""

    def __init__(self) -> None:
        super().__init__()
        self.from_threads: list[Any] = []
        self.called = threading.Event()

    def callFromThread(self, callable: Any, *args: object, **kwargs: object) -> None:
        self.from_threads.append((callable, args, kwargs))
        self.called.set()

    def run_calls(self) -> None:
        calls, self.from_threads = self.from_threads, []
        self.called.clear()
        for f, args, kwargs in calls:
            f(*args, **kwargs)


class Harness:
    def __init__(
        self, resource: Any = None, max_request_bytes: int = 1024, **site_options: Any
    ) -> None:
        self.clock = Clock()
        self.site = KcoralSite(
            resource if resource is not None else _Routes().app.resource(),
            max_request_bytes=max_request_bytes,
            reactor=self.clock,
            **site_options,
        )

    def connect(self) -> tuple[Any, StringTransport]:
        channel = self.site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 40000))
        transport = StringTransport(peerAddress=IPv4Address("TCP", "127.0.0.1", 40000))
        channel.makeConnection(transport)
        return channel, transport

    def exchange(self, data: bytes) -> tuple[int, dict[bytes, bytes], bytes, StringTransport]:
        channel, transport = self.connect()
        channel.dataReceived(data)
        responses = parse_responses(transport.value())
        assert len(responses) == 1, transport.value()
        return (*responses[0], transport)


def assert_error(
    case: SynchronousTestCase, status: int, headers: dict[bytes, bytes], body: bytes, kind: str
) -> dict[str, Any]:
    case.assertEqual(headers[b"content-type"], b"application/json")
    document = json.loads(body)
    case.assertEqual(set(document), {"status", "request_id", "error"})
    case.assertEqual(document["status"], "ERROR")
    case.assertEqual(set(document["error"]), {"kind", "message"})
    case.assertEqual(document["error"]["kind"], kind)
    case.assertEqual(headers[b"x-request-id"].decode(), document["request_id"])
    return document


class JsonErrorTests(SynchronousTestCase):
    """Klein's and Twisted's own error answers become ERROR bodies."""

    def test_ok_untouched(self) -> None:
        """A successful response passes through unchanged."""
        status, headers, body, _ = Harness().exchange(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual((status, body), (200, b'{"ok": true}'))

    def test_not_found(self) -> None:
        """An unknown path is a JSON 404, not Klein's HTML page."""
        status, headers, body, _ = Harness().exchange(b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual(status, 404)
        assert_error(self, status, headers, body, "not_found")

    def test_method_not_allowed(self) -> None:
        """A wrong method is a JSON 405 that keeps the Allow header."""
        status, headers, body, _ = Harness().exchange(b"DELETE /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual(status, 405)
        assert_error(self, status, headers, body, "method_not_allowed")
        self.assertIn(b"GET", headers[b"allow"])

    def test_unhandled_exception(self) -> None:
        """A bug in a handler is a JSON 500 engine error, with no traceback."""
        status, headers, body, _ = Harness().exchange(b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual(status, 500)
        document = assert_error(self, status, headers, body, "engine")
        self.assertNotIn("a bug", json.dumps(document))
        self.flushLoggedErrors(RuntimeError)

    def test_client_request_id_kept(self) -> None:
        """A valid X-Request-ID sent by the client names the error body."""
        rid = "6d1f0b9e-5a4c-4f1e-9b7a-2c3d4e5f6a7b"
        status, headers, body, _ = Harness().exchange(
            b"GET /nope HTTP/1.1\r\nHost: x\r\nX-Request-ID: " + rid.encode() + b"\r\n\r\n"
        )
        self.assertEqual(json.loads(body)["request_id"], rid)

    def test_bad_content_length(self) -> None:
        """A non-numeric Content-Length is a JSON 400 and the connection closes."""
        status, headers, body, transport = Harness().exchange(
            b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n"
        )
        self.assertEqual(status, 400)
        assert_error(self, status, headers, body, "parse")
        self.assertTrue(transport.disconnecting)

    def test_bad_chunking(self) -> None:
        """A malformed chunk size is a JSON 400."""
        status, headers, body, _ = Harness().exchange(
            b"POST /upload HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"
        )
        self.assertEqual(status, 400)
        assert_error(self, status, headers, body, "parse")

    def test_http09(self) -> None:
        """A request line without a version (HTTP/0.9) is a JSON 400."""
        status, headers, body, _ = Harness().exchange(b"GET /hello\r\n\r\n")
        self.assertEqual(status, 400)
        assert_error(self, status, headers, body, "parse")

    def test_too_many_headers(self) -> None:
        """More headers than allowed is a JSON 431."""
        headers_block = b"".join(b"X-H%d: v\r\n" % i for i in range(600))
        status, headers, body, _ = Harness().exchange(
            b"GET /hello HTTP/1.1\r\nHost: x\r\n" + headers_block + b"\r\n"
        )
        self.assertEqual(status, 431)
        assert_error(self, status, headers, body, "header_too_large")

    def test_huge_header(self) -> None:
        """A 200 KB header is a JSON 431, not a silently closed connection."""
        status, headers, body, transport = Harness().exchange(
            b"GET /hello HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n"
        )
        self.assertEqual(status, 431)
        assert_error(self, status, headers, body, "header_too_large")
        self.assertTrue(transport.disconnecting)

    def test_headers_over_total(self) -> None:
        """Headers that are each short but together too large are a JSON 431."""
        headers_block = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 1000) for i in range(20))
        status, headers, body, _ = Harness().exchange(
            b"GET /hello HTTP/1.1\r\nHost: x\r\n" + headers_block + b"\r\n"
        )
        self.assertEqual(status, 431)

    def test_long_request_line(self) -> None:
        """A request line longer than a line may be is a JSON 414."""
        status, headers, body, _ = Harness().exchange(
            b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        self.assertEqual(status, 414)
        assert_error(self, status, headers, body, "uri_too_long")

    def test_raw_busy_has_retry_after(self) -> None:
        """The raw 503 carries Retry-After like every busy answer."""
        ((status, headers, body),) = parse_responses(raw_error_response(503))
        self.assertEqual(status, 503)
        self.assertEqual(headers[b"retry-after"], b"1")
        assert_error(self, status, headers, body, "busy")


class DeadlineTests(SynchronousTestCase):
    """Request heads and bodies must arrive in time, however they trickle."""

    def test_trickled_head_times_out(self) -> None:
        """One byte every few seconds does not extend the head deadline: 408."""
        harness = Harness(header_timeout=10)
        channel, transport = harness.connect()
        for byte in b"GET /hello HTTP/1.1\r\nHost":
            channel.dataReceived(bytes([byte]))
            harness.clock.advance(0.5)
            if transport.disconnecting:
                break
        self.assertTrue(transport.disconnecting)
        ((status, headers, body),) = parse_responses(transport.value())
        self.assertEqual(status, 408)
        assert_error(self, status, headers, body, "request_timeout")

    def test_idle_connection_closed_quietly(self) -> None:
        """A connection that never sends a byte is closed without a response."""
        harness = Harness(header_timeout=10)
        channel, transport = harness.connect()
        harness.clock.advance(10)
        self.assertTrue(transport.disconnecting)
        self.assertEqual(transport.value(), b"")

    def test_trickled_body_times_out(self) -> None:
        """A body that arrives too slowly is answered 408."""
        harness = Harness(header_timeout=10, body_timeout=20)
        channel, transport = harness.connect()
        channel.dataReceived(b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
        for _ in range(30):
            channel.dataReceived(b"a")
            harness.clock.advance(1)
        ((status, headers, body),) = parse_responses(transport.value())
        self.assertEqual(status, 408)
        self.assertTrue(transport.disconnecting)

    def test_keep_alive_gets_new_deadline(self) -> None:
        """After a response, the next request has a fresh head deadline."""
        harness = Harness(header_timeout=10)
        channel, transport = harness.connect()
        harness.clock.advance(9)
        channel.dataReceived(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        harness.clock.advance(9)
        channel.dataReceived(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual([r[0] for r in parse_responses(transport.value())], [200, 200])
        self.assertFalse(transport.disconnecting)
        channel.connectionLost(None)
        self.assertEqual(harness.clock.getDelayedCalls(), [])


class DrainTests(SynchronousTestCase):
    """A stopping server's answers close their connections."""

    def test_answers_close_the_connection_once_draining(self) -> None:
        harness = Harness(header_timeout=10)
        channel, transport = harness.connect()
        channel.dataReceived(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        ((status, headers, _),) = parse_responses(transport.value())
        self.assertEqual(status, 200)
        self.assertNotEqual(headers.get(b"connection"), b"close")
        self.assertFalse(transport.disconnecting)
        harness.site.drain()
        transport.clear()
        channel.dataReceived(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        ((status, headers, _),) = parse_responses(transport.value())
        self.assertEqual(status, 200)
        self.assertEqual(headers.get(b"connection"), b"close")
        self.assertTrue(transport.disconnecting)


#: A request head whose body is still to come: its connection is in a request.
IN_REQUEST = b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n"


class ConnectionCapTests(SynchronousTestCase):
    """
    At the connection cap, the connection waiting longest for a request head
    makes room; when every connection is in a request, new ones get a 503.
    """

    def connect_from(self, harness: Harness, host: str) -> tuple[Any, StringTransport]:
        address = IPv4Address("TCP", host, 40000)
        channel = harness.site.buildProtocol(address)
        transport = StringTransport(peerAddress=address)
        channel.makeConnection(transport)
        return channel, transport

    def test_cap(self) -> None:
        """The connection over the cap is refused cleanly; a freed slot is reused."""
        harness = Harness(max_connections=2)
        first, _ = harness.connect()
        first.dataReceived(IN_REQUEST)
        second, _ = harness.connect()
        second.dataReceived(IN_REQUEST)
        refused, transport = harness.connect()
        ((status, headers, body),) = parse_responses(transport.value())
        self.assertEqual(status, 503)
        assert_error(self, status, headers, body, "busy")
        self.assertTrue(transport.disconnecting)
        self.assertEqual(harness.site.refused_connections, 1)
        first.connectionLost(None)
        self.assertEqual(harness.site.open_connections, 1)
        _, transport = harness.connect()
        self.assertEqual(transport.value(), b"")

    def test_waiting_connections_make_room(self) -> None:
        """
        At the cap, the oldest connection without a whole head is closed for
        the new one: one that began a head gets the head deadline's 408, an
        idle one is closed silently; connections in a request are kept.
        """
        harness = Harness(max_connections=3)
        busy, busy_transport = harness.connect()
        busy.dataReceived(IN_REQUEST)
        trickling, trickling_transport = harness.connect()
        trickling.dataReceived(b"GET /hello HTT")
        silent, silent_transport = harness.connect()
        with capturedLogs() as events:
            _, transport = harness.connect()
        self.assertEqual(transport.value(), b"")
        ((status, headers, body),) = parse_responses(trickling_transport.value())
        assert_error(self, status, headers, body, "request_timeout")
        self.assertTrue(trickling_transport.disconnecting)
        self.assertEqual(refusals(events), [])
        self.assertEqual(
            [e["count"] for e in events if e.get("kcoral_event") == "connections_evicted"], [1]
        )
        self.assertFalse(silent_transport.disconnecting)
        harness.connect()
        self.assertTrue(silent_transport.disconnecting)
        self.assertEqual(silent_transport.value(), b"")
        self.assertFalse(busy_transport.disconnecting)
        self.assertEqual((harness.site.open_connections, harness.site.evicted_connections), (3, 2))

    def test_tricklers_before_silent(self) -> None:
        """
        A connection that began a head and did not finish it goes before an
        older one that has sent nothing yet (whose head may be on its way).
        """
        harness = Harness(max_connections=2)
        _, silent_transport = harness.connect()
        trickling, trickling_transport = harness.connect()
        trickling.dataReceived(b"GET /hel")
        harness.connect()
        self.assertTrue(trickling_transport.disconnecting)
        self.assertFalse(silent_transport.disconnecting)

    def test_fresh_before_idle(self) -> None:
        """
        A kept-alive connection that completed a request is closed only after
        every connection that never sent a head.
        """
        harness = Harness(max_connections=2)
        kept, kept_transport = harness.connect()
        kept.dataReceived(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual(parse_responses(kept_transport.value())[0][0], 200)
        _, fresh_transport = harness.connect()
        newest, newest_transport = harness.connect()
        self.assertTrue(fresh_transport.disconnecting)
        self.assertFalse(kept_transport.disconnecting)
        newest.dataReceived(IN_REQUEST)
        harness.connect()
        self.assertTrue(kept_transport.disconnecting)
        self.assertFalse(newest_transport.disconnecting)

    def test_per_client_cap(self) -> None:
        """
        One address at its cap makes room among its own connections, never
        another address's; with all of its own in requests it is refused.
        """
        harness = Harness(max_connections=100, max_connections_per_client=2)
        _, other_transport = self.connect_from(harness, "127.0.0.9")
        first, first_transport = self.connect_from(harness, "127.0.0.2")
        self.connect_from(harness, "127.0.0.2")
        self.connect_from(harness, "127.0.0.2")
        self.assertTrue(first_transport.disconnecting)
        self.assertFalse(other_transport.disconnecting)
        self.assertEqual(harness.site.client_connections, {"127.0.0.9": 1, "127.0.0.2": 2})
        for channel in list(harness.site._fresh_of["127.0.0.2"]):
            channel.dataReceived(IN_REQUEST)
        _, transport = self.connect_from(harness, "127.0.0.2")
        self.assertEqual(parse_responses(transport.value())[0][0], 503)
        _, transport = self.connect_from(harness, "127.0.0.3")
        self.assertEqual(transport.value(), b"")

    def test_first_head_deadline(self) -> None:
        """
        A new connection has C{first_header_timeout} for its first head; a
        kept-alive one has the header timeout for its next.
        """
        harness = Harness(header_timeout=30.0, first_header_timeout=5.0)
        channel, transport = harness.connect()
        channel.dataReceived(b"GET /hel")
        harness.clock.advance(5)
        self.assertEqual(parse_responses(transport.value())[0][0], 408)
        channel, transport = harness.connect()
        channel.dataReceived(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        channel.dataReceived(b"GET /hel")
        harness.clock.advance(5)
        self.assertEqual(len(parse_responses(transport.value())), 1)
        harness.clock.advance(25)
        self.assertEqual(parse_responses(transport.value())[-1][0], 408)

    def test_fit_to_fd_limit(self) -> None:
        """The cap is kept a headroom below the open-file limit."""
        harness = Harness(max_connections=4096)
        self.assertEqual(harness.site.fit_to_fd_limit(1024), 768)
        self.assertEqual(harness.site.fit_to_fd_limit(1 << 20), 768)
        harness = Harness(max_connections=4096)
        self.assertEqual(harness.site.fit_to_fd_limit(1 << 20), 4096)
        harness = Harness(max_connections=0)
        self.assertEqual(harness.site.fit_to_fd_limit(300), 44)
        self.assertEqual(harness.site.fit_to_fd_limit(None), 44)


class _ListeningSocket:
    """A listening socket whose accept() fails with C{error} while it is set."""

    def __init__(self) -> None:
        self.error: int | None = None
        self.accepted = 0

    def accept(self) -> tuple[Any, Any]:
        if self.error is not None:
            raise OSError(self.error, os.strerror(self.error))
        self.accepted += 1
        return object(), ("127.0.0.1", 1)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", 8000)


class _Port:
    connected = True

    def __init__(self) -> None:
        self.socket = _ListeningSocket()
        self.reading = True

    def stopReading(self) -> None:
        self.reading = False

    def startReading(self) -> None:
        self.reading = True


class AcceptGuardTests(SynchronousTestCase):
    """
    Running out of descriptors pauses accepting, frees the oldest waiting
    connections and logs once per interval, instead of spinning and logging
    each failure.
    """

    def test_emfile_pauses(self) -> None:
        """
        EMFILE: the accept loop sees EAGAIN, the port stops reading and
        resumes after a pause that doubles while it goes on; waiting
        connections are closed; one event per interval counts the failures.
        """
        harness = Harness()
        waiting = [harness.connect()[1] for _ in range(3)]
        port = _Port()
        real = port.socket
        guard = AcceptGuard.install(port, harness.site, harness.clock)
        assert guard is not None
        self.assertIs(port.socket, guard)
        self.assertEqual(guard.getsockname(), ("127.0.0.1", 8000))
        real.error = errno.EMFILE
        with capturedLogs() as events:
            for _ in range(50):
                with self.assertRaises(BlockingIOError):
                    guard.accept()
            self.assertFalse(port.reading)
            self.assertTrue(all(t.disconnecting for t in waiting))
            harness.clock.advance(ACCEPT_PAUSE_SECONDS[0])
            self.assertTrue(port.reading)
            with self.assertRaises(BlockingIOError):
                guard.accept()
            harness.clock.advance(ACCEPT_PAUSE_SECONDS[0])
            self.assertFalse(port.reading)
            harness.clock.advance(ACCEPT_PAUSE_SECONDS[0])
            self.assertTrue(port.reading)
            harness.clock.advance(TROUBLE_LOG_INTERVAL)
            with self.assertRaises(BlockingIOError):
                guard.accept()
        failed = [e for e in events if e.get("kcoral_event") == "accept_failed"]
        self.assertEqual(
            [(e["count"], e["error"]) for e in failed], [(1, "EMFILE"), (51, "EMFILE")]
        )
        real.error = None
        harness.clock.advance(1)
        self.assertEqual(guard.accept()[1], ("127.0.0.1", 1))
        with self.assertRaises(BlockingIOError):
            real.error = errno.ENFILE
            guard.accept()
        guard.stop()
        self.assertTrue(port.reading is False and guard._resume is None)

    def test_other_errors_pass(self) -> None:
        """Errors other than running out of resources reach Twisted as they are."""
        port = _Port()
        port.socket.error = errno.EPERM
        guard = AcceptGuard.install(port, Harness().site, Clock())
        assert guard is not None
        with self.assertRaises(OSError) as caught:
            guard.accept()
        self.assertEqual(caught.exception.errno, errno.EPERM)


class BytesInFlightTests(SynchronousTestCase):
    """Request bodies held at once are capped (--max-bytes-in-flight)."""

    def test_cap(self) -> None:
        """
        A body that would pass the cap is not read and the request is flagged
        (the API answers 503); bytes are returned when a request finishes or
        its client leaves.
        """
        _Routes.held.clear()
        harness = Harness(max_bytes_in_flight=1500)
        first, first_transport = harness.connect()
        first.dataReceived(
            b"POST /hold HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"a" * 1000
        )
        self.assertEqual(harness.site.bytes_in_flight, 1000)
        status, _, body, transport = harness.exchange(
            b"POST /flag HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"b" * 1000
        )
        self.assertEqual(json.loads(body), {"over": True, "read": 0})
        self.assertTrue(transport.disconnecting)
        status, _, body, _ = harness.exchange(
            b"POST /flag HTTP/1.1\r\nHost: x\r\nContent-Length: 400\r\n\r\n" + b"c" * 400
        )
        self.assertEqual(json.loads(body), {"over": False, "read": 400})
        self.assertEqual(harness.site.bytes_in_flight, 1000)
        _Routes.held[0].callback(b"{}")
        self.assertEqual(harness.site.bytes_in_flight, 0)

    def test_client_leaving_returns_bytes(self) -> None:
        """A client that disconnects while its request is held gives its bytes back."""
        _Routes.held.clear()
        harness = Harness(max_bytes_in_flight=1500)
        channel, _ = harness.connect()
        channel.dataReceived(
            b"POST /hold HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n" + b"a" * 10
        )
        self.assertEqual(harness.site.bytes_in_flight, 10)
        channel.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(harness.site.bytes_in_flight, 0)

    def test_held_results_count(self) -> None:
        """
        Shared result bytes being streamed count against the cap until their
        response finishes: a body past it meanwhile is not read.
        """
        _Routes.held.clear()
        harness = Harness(max_bytes_in_flight=1500)
        first, _ = harness.connect()
        first.dataReceived(b"POST /result HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        self.assertEqual(harness.site.bytes_in_flight, 1200)
        _, _, body, _ = harness.exchange(
            b"POST /flag HTTP/1.1\r\nHost: x\r\nContent-Length: 400\r\n\r\n" + b"c" * 400
        )
        self.assertEqual(json.loads(body), {"over": True, "read": 0})
        _Routes.held[0].callback(b"{}")
        self.assertEqual(harness.site.bytes_in_flight, 0)


class HeldBodyTests(SynchronousTestCase):
    """
    A body's bytes count as they arrive, per client address too, a head
    without a valid token is refused before its body, and a body that stops
    arriving is cut off (issue 32).
    """

    def connect_from(self, harness: Harness, host: str) -> tuple[Any, StringTransport]:
        address = IPv4Address("TCP", host, 40000)
        channel = harness.site.buildProtocol(address)
        transport = StringTransport(peerAddress=address)
        channel.makeConnection(transport)
        return channel, transport

    def test_declared_length_holds_nothing(self) -> None:
        """A head declaring a body holds no bytes; the bytes count as they arrive."""
        harness = Harness(max_request_bytes=10_000, max_bytes_in_flight=1500)
        channel, _ = harness.connect()
        channel.dataReceived(b"POST /hold HTTP/1.1\r\nHost: x\r\nContent-Length: 1400\r\n\r\n")
        self.assertEqual(harness.site.bytes_in_flight, 0)
        channel.dataReceived(b"a" * 300)
        self.assertEqual(harness.site.bytes_in_flight, 300)
        self.assertEqual(harness.site.client_bytes, {"127.0.0.1": 300})
        channel.connectionLost(Failure(ConnectionDone()))
        self.assertEqual((harness.site.bytes_in_flight, harness.site.client_bytes), (0, {}))

    def test_heads_only_leave_room(self) -> None:
        """
        Eight heads declaring bodies that fill the cap and sending nothing
        more do not keep a ninth request out.
        """
        _Routes.held.clear()
        harness = Harness(max_request_bytes=10_000, max_bytes_in_flight=1500)
        for n in range(8):
            channel, _ = self.connect_from(harness, f"127.0.0.{n + 2}")
            channel.dataReceived(b"POST /hold HTTP/1.1\r\nHost: x\r\nContent-Length: 1500\r\n\r\n")
        _, _, body, _ = harness.exchange(
            b"POST /flag HTTP/1.1\r\nHost: x\r\nContent-Length: 400\r\n\r\n" + b"c" * 400
        )
        self.assertEqual(json.loads(body), {"over": False, "read": 400})

    def test_body_growing_past_cap_is_dropped(self) -> None:
        """A body that grows past what is left is dropped and its bytes given back."""
        harness = Harness(max_request_bytes=10_000, max_bytes_in_flight=1500)
        first, first_transport = self.connect_from(harness, "127.0.0.2")
        first.dataReceived(b"POST /flag HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        second, transport = harness.connect()
        second.dataReceived(b"POST /flag HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        second.dataReceived(b"b" * 900)
        first.dataReceived(b"a" * 400)
        self.assertEqual(harness.site.bytes_in_flight, 1300)
        first.dataReceived(b"a" * 600)
        (response,) = parse_responses(first_transport.value())
        self.assertEqual(json.loads(response[2]), {"over": True, "read": 0})
        self.assertEqual(harness.site.bytes_in_flight, 900)
        second.dataReceived(b"b" * 100)
        (response,) = parse_responses(transport.value())
        self.assertEqual(json.loads(response[2]), {"over": False, "read": 1000})

    def test_per_client_cap(self) -> None:
        """
        One address holds at most C{max_bytes_per_client}: its next body is
        refused while another address's fits.
        """
        _Routes.held.clear()
        harness = Harness(
            max_request_bytes=10_000, max_bytes_in_flight=100_000, max_bytes_per_client=1500
        )
        first, _ = self.connect_from(harness, "127.0.0.2")
        first.dataReceived(
            b"POST /hold HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"a" * 1000
        )
        second, transport = self.connect_from(harness, "127.0.0.2")
        second.dataReceived(
            b"POST /flag HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"b" * 1000
        )
        (response,) = parse_responses(transport.value())
        self.assertEqual(json.loads(response[2]), {"over": True, "read": 0})
        _, _, body, _ = harness.exchange(
            b"POST /flag HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"c" * 1000
        )
        self.assertEqual(json.loads(body), {"over": False, "read": 1000})
        self.assertEqual(harness.site.client_bytes, {"127.0.0.2": 1000})

    def test_stalled_body_cut_off(self) -> None:
        """
        A body without a byte for C{body_stall_timeout} gets a 408
        (C{body_stalled}) and its bytes are released; bytes that keep
        arriving keep it alive.
        """
        harness = Harness(max_request_bytes=10_000, body_stall_timeout=5.0, body_timeout=300.0)
        channel, transport = harness.connect()
        channel.dataReceived(b"POST /hold HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        for _ in range(4):
            harness.clock.advance(4)
            channel.dataReceived(b"a" * 100)
        self.assertEqual(transport.value(), b"")
        self.assertEqual(harness.site.bytes_in_flight, 400)
        with capturedLogs() as events:
            harness.clock.advance(5)
        (response,) = parse_responses(transport.value())
        assert_error(self, response[0], response[1], response[2], "request_timeout")
        self.assertEqual(response[0], 408)
        self.assertEqual(refusals(events), [(408, "body_stalled")])
        self.assertEqual(harness.site.bytes_in_flight, 0)

    def guarded(self, **options: Any) -> Harness:
        tokens = parse_tokens("tester token-0123456789abcdef\n")
        harness = Harness(max_request_bytes=10_000, **options)
        guard = TokenGuard(harness.site.resource, tokens)
        harness.site.resource = guard
        harness.site.guard = guard
        return harness

    def test_no_token_refused_at_head(self) -> None:
        """
        A head without a valid token is answered 401 at once: none of its
        body is read or counted, and the connection closes after it.
        """
        harness = self.guarded(max_bytes_in_flight=1500)
        channel, transport = harness.connect()
        with capturedLogs() as events:
            channel.dataReceived(
                b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 9000\r\n\r\n"
            )
        (response,) = parse_responses(transport.value())
        assert_error(self, response[0], response[1], response[2], "unauthorized")
        self.assertEqual(response[0], 401)
        self.assertEqual(refusals(events), [(401, "unauthorized")])
        self.assertTrue(transport.disconnecting)
        channel.dataReceived(b"a" * 9000)
        self.assertEqual(harness.site.bytes_in_flight, 0)

    def test_no_token_no_continue(self) -> None:
        """A head asking C{Expect: 100-continue} without a token gets its 401, no 100."""
        harness = self.guarded()
        channel, transport = harness.connect()
        channel.dataReceived(
            b"POST /upload HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
            b"Content-Length: 9000\r\n\r\n"
        )
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 401 "), transport.value()[:40])

    def test_token_admitted(self) -> None:
        """With the token, the body is read as before."""
        harness = self.guarded()
        status, _, body, _ = harness.exchange(
            b"POST /upload HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer token-0123456789abcdef"
            b"\r\nContent-Length: 5\r\n\r\nhello"
        )
        self.assertEqual((status, json.loads(body)), (200, {"read": 5}))


class _HalfClosingTransport(StringTransport):
    """A L{StringTransport} that can close its writing side, as TCP can."""

    write_closed = False

    def loseWriteConnection(self) -> None:
        self.write_closed = True


class LingeringCloseTests(SynchronousTestCase):
    """
    A refused body's connection closes its writing side and reads and
    discards for a while before closing, so the client reads the answer
    rather than a reset (issue 32).
    """

    def connect(self, harness: Harness) -> tuple[Any, _HalfClosingTransport]:
        address = IPv4Address("TCP", "127.0.0.1", 40000)
        channel = harness.site.buildProtocol(address)
        transport = _HalfClosingTransport(peerAddress=address)
        channel.makeConnection(transport)
        return channel, transport

    def test_too_large_lingers(self) -> None:
        """
        A 413 half-closes; the body's bytes are discarded; the connection
        closes once the client is quiet.
        """
        harness = Harness(max_request_bytes=1024)
        channel, transport = self.connect(harness)
        channel.dataReceived(
            b"POST /answer/413 HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n"
        )
        (response,) = parse_responses(transport.value())
        self.assertEqual(response[0], 413)
        self.assertTrue(transport.write_closed)
        self.assertFalse(transport.disconnecting)
        for _ in range(5):
            harness.clock.advance(1)
            channel.dataReceived(b"a" * 1000)
        self.assertFalse(transport.disconnecting)
        self.assertEqual(len(parse_responses(transport.value())), 1)
        harness.clock.advance(2)
        self.assertTrue(transport.disconnecting)
        self.assertEqual(harness.clock.getDelayedCalls(), [])

    def test_body_in_the_same_read(self) -> None:
        """
        Body bytes that arrive with the head (answered at once) are dropped
        without pausing the transport: the client can finish sending.
        """
        harness = Harness(max_request_bytes=1024)
        channel, transport = self.connect(harness)
        channel.dataReceived(
            b"POST /answer/413 HTTP/1.1\r\nHost: x\r\nContent-Length: 900000\r\n\r\n"
            + b"a" * 300_000
        )
        self.assertEqual(parse_responses(transport.value())[0][0], 413)
        self.assertTrue(transport.write_closed)
        self.assertEqual(transport.producerState, "producing")
        channel.dataReceived(b"a" * 600_000)
        self.assertEqual(transport.producerState, "producing")
        self.assertFalse(transport.disconnecting)

    def test_linger_bounded(self) -> None:
        """A client that keeps sending is closed after L{LINGER_SECONDS} all the same."""
        harness = Harness(max_request_bytes=1024)
        channel, transport = self.connect(harness)
        channel.dataReceived(
            b"POST /answer/413 HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n"
        )
        for _ in range(int(LINGER_SECONDS)):
            channel.dataReceived(b"a")
            harness.clock.advance(1)
        self.assertTrue(transport.disconnecting)

    def test_tls_closes_at_once(self) -> None:
        """
        A TLS connection (a protocol wrapper, whose attributes are its
        socket's) cannot half-close under TLS: it is closed at once.
        """
        harness = Harness(max_request_bytes=1024)
        address = IPv4Address("TCP", "127.0.0.1", 40000)
        channel = harness.site.buildProtocol(address)
        socket = _HalfClosingTransport(peerAddress=address)
        ProtocolWrapper(WrappingFactory(Factory()), channel).makeConnection(socket)
        channel.dataReceived(
            b"POST /answer/413 HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n"
        )
        self.assertEqual(parse_responses(socket.value())[0][0], 413)
        self.assertFalse(socket.write_closed)
        self.assertTrue(socket.disconnecting)

    def test_answered_request_closes_at_once(self) -> None:
        """A connection whose request was read whole closes without lingering."""
        harness = Harness()
        channel, transport = self.connect(harness)
        channel.dataReceived(b"GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        self.assertTrue(transport.disconnecting)
        self.assertFalse(transport.write_closed)


class StreamedBodyTests(SynchronousTestCase):
    """A multipart body is parsed as it arrives; large blobs land in sealed buffers."""

    def setUp(self) -> None:
        if not shared.available():
            raise SkipTest("no sealed memfds here")

    def test_parsed_while_arriving(self) -> None:
        small, large = b"s" * 100, os.urandom(200_000)
        content_type, body = multipart_body({"instructions": []}, [small, large])
        harness = Harness(max_request_bytes=1 << 20)
        channel, transport = harness.connect()
        head = (
            b"POST /parts HTTP/1.1\r\nHost: x\r\nContent-Type: "
            + content_type.encode()
            + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        channel.dataReceived(head)
        for offset in range(0, len(body), 65536):
            harness.clock.advance(0.01)
            channel.dataReceived(body[offset : offset + 65536])
        ((status, _, answer),) = parse_responses(transport.value())
        self.assertEqual(status, 200)
        document = json.loads(answer)
        self.assertEqual(document["program"], '{"instructions":[]}')
        self.assertEqual(
            document["blobs"],
            {
                hashlib.sha256(small).hexdigest(): "bytes",
                hashlib.sha256(large).hexdigest(): "shared",
            },
        )
        # Nothing spooled (no temporary file either: Twisted makes one for
        # bodies over 100 kB); the upload took the four 10 ms steps of the clock.
        self.assertEqual((document["spooled"], document["content"]), (0, "BytesIO"))
        self.assertAlmostEqual(document["body_seconds"], 0.04)

    def test_reading_stops_while_the_blob_threads_are_behind(self) -> None:
        """
        Past L{BACKLOG_PAUSE_BYTES} not yet written and hashed, the
        connection stops reading; once the threads are down to
        L{BACKLOG_RESUME_BYTES} a call from their thread resumes it.
        """
        gate = hold_hashing(self.patch)
        large = os.urandom(BACKLOG_PAUSE_BYTES + (8 << 20))
        content_type, body = multipart_body({"instructions": []}, [large])
        reactor = _ThreadsClock()
        harness = Harness(max_request_bytes=1 << 30)
        harness.site.reactor = reactor
        channel, transport = harness.connect()
        channel.dataReceived(
            b"POST /parts HTTP/1.1\r\nHost: x\r\nContent-Type: "
            + content_type.encode()
            + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        offset = 0
        while transport.producerState == "producing" and offset < len(body):
            channel.dataReceived(body[offset : offset + (1 << 20)])
            offset += 1 << 20
        self.assertEqual(transport.producerState, "paused")
        self.assertGreater(offset, BACKLOG_PAUSE_BYTES)
        self.assertLess(offset, len(body))
        gate.set()
        self.assertTrue(reactor.called.wait(10))
        reactor.run_calls()
        self.assertEqual(transport.producerState, "producing")
        channel.dataReceived(body[offset:])
        ((status, _, answer),) = parse_responses(transport.value())
        self.assertEqual(status, 200)
        self.assertEqual(json.loads(answer)["blobs"], {hashlib.sha256(large).hexdigest(): "shared"})

    def test_bad_body_reported_at_the_end(self) -> None:
        """A malformed body is read to its end and its error kept for the API."""
        content_type, body = multipart_body({"instructions": []}, [b"x" * 100])
        body = body.replace(b"Content-Type: application/octet-stream", b"Content-Type: text/x")
        harness = Harness(max_request_bytes=1 << 20)
        status, _, answer, _ = harness.exchange(
            b"POST /parts HTTP/1.1\r\nHost: x\r\nContent-Type: "
            + content_type.encode()
            + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
            + body
        )
        self.assertEqual(status, 200)
        self.assertEqual(
            json.loads(answer),
            {
                "error": f"blob part {hashlib.sha256(b'x' * 100).hexdigest()} "
                "must use application/octet-stream",
                "received": len(body),
            },
        )


def refusals(events: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """The (status, reason) of each C{request_refused} event."""
    return [
        (e["status"], e["reason"]) for e in events if e.get("kcoral_event") == "request_refused"
    ]


class RefusalEventTests(SynchronousTestCase):
    """
    Every refusal logs one C{request_refused} event whose status is the one
    answered and whose C{request_id} is the answer's C{X-Request-ID}.
    """

    def refused(
        self, data: bytes, status: int, reason: str, harness: Harness | None = None
    ) -> dict[str, Any]:
        with capturedLogs() as events:
            got, headers, _, _ = (harness or Harness()).exchange(data)
        self.assertEqual(got, status)
        self.assertEqual(refusals(events), [(status, reason)])
        (event,) = [e for e in events if e.get("kcoral_event") == "request_refused"]
        self.assertEqual(event["request_id"], headers[b"x-request-id"].decode())
        self.assertEqual(event["client"], "127.0.0.1")
        self.assertEqual(REFUSALS[reason], status)
        return event

    def test_malformed(self) -> None:
        """A bad Content-Length, bad chunking and HTTP/0.9 are refusals of reason malformed."""
        for data in (
            b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n",
            b"POST /upload HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            b"GET /hello\r\n\r\n",
        ):
            self.refused(data, 400, "malformed")

    def test_headers(self) -> None:
        """431 for a huge header, headers over the total, or too many; 414 for a long line."""
        self.refused(
            b"GET /hello HTTP/1.1\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n",
            431,
            "header_too_large",
        )
        block = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 1000) for i in range(20))
        event = self.refused(b"GET /hello HTTP/1.1\r\n" + block + b"\r\n", 431, "header_too_large")
        self.assertEqual(event["path"], "/hello")
        block = b"".join(b"X-H%d: v\r\n" % i for i in range(600))
        self.refused(b"GET /hello HTTP/1.1\r\n" + block + b"\r\n", 431, "too_many_headers")
        event = self.refused(b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\n\r\n", 414, "uri_too_long")
        self.assertIsNone(event["path"])

    def test_deadlines(self) -> None:
        """A late head and a late body are refusals of their own reasons; an idle close is not."""
        harness = Harness(header_timeout=10, body_timeout=20)
        with capturedLogs() as events:
            channel, _ = harness.connect()
            channel.dataReceived(b"GET /hel")
            harness.clock.advance(10)
            channel, _ = harness.connect()
            channel.dataReceived(b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\n")
            harness.clock.advance(20)
            harness.connect()
            harness.clock.advance(10)
        self.assertEqual(refusals(events), [(408, "head_timeout"), (408, "body_timeout")])
        body_event = [e for e in events if e.get("reason") == "body_timeout"][0]
        self.assertEqual(body_event["path"], "/upload")

    def test_connection_cap(self) -> None:
        """A connection past the cap is a 503 connection_cap refusal."""
        harness = Harness(max_connections=1)
        channel, _ = harness.connect()
        channel.dataReceived(IN_REQUEST)
        with capturedLogs() as events:
            _, transport = harness.connect()
        ((status, headers, _),) = parse_responses(transport.value())
        self.assertEqual(refusals(events), [(503, "connection_cap")])
        self.assertEqual(events[-1]["request_id"], headers[b"x-request-id"].decode())

    def test_unauthorized(self) -> None:
        """The token guard's 401 is an unauthorized refusal with the path asked for."""
        tokens = parse_tokens("alice alice-0123456789abcdef\n")
        harness = Harness(TokenGuard(_Routes().app.resource(), tokens))
        event = self.refused(
            b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n", 401, "unauthorized", harness
        )
        self.assertEqual(event["path"], "/hello")
        with capturedLogs() as events:
            status, *_ = harness.exchange(
                b"GET /hello HTTP/1.1\r\nHost: x\r\n"
                b"Authorization: Bearer alice-0123456789abcdef\r\n\r\n"
            )
        self.assertEqual((status, refusals(events)), (200, []))

    def test_api_refusals(self) -> None:
        """The API's 413 and 503 answers are refusals; its other answers are not."""
        self.refused(b"GET /answer/413 HTTP/1.1\r\nHost: x\r\n\r\n", 413, "body_too_large")
        self.refused(b"GET /answer/503 HTTP/1.1\r\nHost: x\r\n\r\n", 503, "busy")
        for code in (200, 400, 404, 500, 504):
            with capturedLogs() as events:
                Harness().exchange(b"GET /answer/%d HTTP/1.1\r\nHost: x\r\n\r\n" % (code,))
            self.assertEqual(refusals(events), [])

    def test_bytes_in_flight(self) -> None:
        """A 503 for a body over the bytes in flight is a bytes_in_flight refusal."""
        _Routes.held.clear()
        harness = Harness(max_bytes_in_flight=1500)
        channel, _ = harness.connect()
        channel.dataReceived(
            b"POST /hold HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"a" * 1000
        )
        self.refused(
            b"POST /answer/503 HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n",
            503,
            "bytes_in_flight",
            harness,
        )
        _Routes.held[0].callback(b"{}")


class FdLimitTests(SynchronousTestCase):
    """L{raise_fd_limit} lifts the soft limit on open files to the hard limit."""

    def test_raised_to_hard(self) -> None:
        """A soft limit of 256 (below the hard one) is raised to the hard limit."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        self.addCleanup(resource.setrlimit, resource.RLIMIT_NOFILE, (soft, hard))
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        old, new = raise_fd_limit() or (None, None)
        target = hard if hard != resource.RLIM_INFINITY else 1 << 20
        self.assertEqual((old, new), (256, target))
        self.assertEqual(resource.getrlimit(resource.RLIMIT_NOFILE), (target, hard))

    def test_already_at_hard(self) -> None:
        """At the hard limit already: nothing changes, old and new are equal."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        self.addCleanup(resource.setrlimit, resource.RLIMIT_NOFILE, (soft, hard))
        if hard == resource.RLIM_INFINITY:
            raise SkipTest("no finite hard limit to sit at")
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        self.assertEqual(raise_fd_limit(), (hard, hard))
