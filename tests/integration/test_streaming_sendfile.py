"""
L{kcoral.server.http.streaming} over real sockets: a shared buffer goes out
with C{sendfile} when the response is a plain C{Content-Length} body on
TCP, through the transport otherwise, and the client gets the same bytes
in order either way (loopback, the real reactor).
"""

from __future__ import annotations

import random
import socket
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SkipTest, TestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Site

from kcoral.ipc import shared
from kcoral.server.http.streaming import BodyProducer, DirectSocket, body_length

#: Past loopback's socket buffers, so the socket fills and drains many times.
SIZE = 24 << 20


class _Body(Resource):
    isLeaf = True

    def __init__(self, chunks: list[Any], length: bool = True) -> None:
        super().__init__()
        self.chunks = chunks
        self.length = length
        self.producers: list[BodyProducer] = []
        self.finished: Deferred[None] = Deferred()

    def render_GET(self, request: Any) -> Any:
        if self.length:
            request.setHeader(b"Content-Length", str(body_length(self.chunks)).encode())
        producer = BodyProducer(request, self.chunks, direct=DirectSocket.of(request))
        self.producers.append(producer)

        def done(_: None) -> None:
            if not request._disconnected:
                request.finish()
            self.finished.callback(None)

        producer.start().addCallback(done)
        return NOT_DONE_YET


def _fetch(port: int, *, read_bytes: int | None = None, chunk_delay: bool = False) -> bytes:
    """A blocking HTTP/1.1 GET that reads the raw response (headers and body)."""
    import time

    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        received = bytearray()
        while read_bytes is None or len(received) < read_bytes:
            data = sock.recv(1 << 16)
            if not data:
                break
            received += data
            if chunk_delay and len(received) < 4 << 20:
                time.sleep(0.001)  # a slow reader first: the server's socket fills
        return bytes(received)


class SendfileTests(TestCase):
    def setUp(self) -> None:
        if not shared.available():
            raise SkipTest("no sealed memfds here")
        self.data = random.Random(3).randbytes(SIZE)

    def _serve(self, resource: _Body) -> int:
        port = reactor.listenTCP(0, Site(resource), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        return port.getHost().port

    @inlineCallbacks
    def test_content_length_body_goes_out_with_sendfile(self) -> Any:
        resource = _Body([b"head-", shared.share(self.data), b"-tail"])
        port = self._serve(resource)
        raw = yield deferToThread(_fetch, port, chunk_delay=True)
        yield resource.finished
        head, _, body = raw.partition(b"\r\n\r\n")
        self.assertIn(b"Content-Length: %d" % (SIZE + 10), head)
        self.assertEqual(body, b"head-" + self.data + b"-tail")
        (producer,) = resource.producers
        self.assertEqual(producer.written, SIZE + 10)
        # Most of the buffer went with sendfile; slices only while the socket was full.
        self.assertGreater(producer.sent_directly, SIZE // 2)

    @inlineCallbacks
    def test_chunked_body_never_uses_sendfile(self) -> Any:
        resource = _Body([b"head-", shared.share(self.data)], length=False)
        port = self._serve(resource)
        raw = yield deferToThread(_fetch, port)
        yield resource.finished
        head, _, body = raw.partition(b"\r\n\r\n")
        self.assertIn(b"Transfer-Encoding: chunked", head)
        (producer,) = resource.producers
        self.assertEqual(producer.sent_directly, 0)
        # De-chunk: the payload is the same bytes.
        payload, rest = bytearray(), body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            payload += rest[:size]
            rest = rest[size + 2 :]
        self.assertEqual(bytes(payload), b"head-" + self.data)

    @inlineCallbacks
    def test_client_leaving_midway_ends_the_body(self) -> Any:
        resource = _Body([b"head-", shared.share(self.data), b"-tail"])
        port = self._serve(resource)
        raw = yield deferToThread(_fetch, port, read_bytes=2 << 20)
        self.assertGreaterEqual(len(raw), 2 << 20)
        yield resource.finished
        (producer,) = resource.producers
        self.assertLess(producer.written, SIZE + 10)


def test_no_direct_socket_without_a_tcp_transport() -> None:
    class Request:
        channel = None

    assert DirectSocket.of(Request()) is None
