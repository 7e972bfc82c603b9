# -*- test-case-name: tests.unit.test_streaming -*-
"""
Writing a response body whose large parts are sealed shared buffers.

A worker's large returned tensor reaches the parent as a memfd
(L{kcoral.ipc.shared.SharedBuffer}).  L{BodyProducer} streams the body's
chunks to the client as the transport asks for them (a pull producer
registered with the request), reading each shared buffer a slice at a time
with C{pread}: the parent never holds more than about one slice of a result
in its own memory, instead of a copy of the whole response.

On a plain TCP connection (no TLS, a C{Content-Length} response) a shared
buffer goes out with C{os.sendfile} instead, from the memfd straight into
the socket, whenever the transport has nothing buffered: no slice is read
into the parent's memory at all.  When the socket is full, one slice goes
through the transport as usual, which waits for the socket to drain and
then asks for more.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from twisted.internet import tcp
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPullProducer, ISSLTransport
from twisted.python.failure import Failure
from twisted.web.http import Request
from zope.interface import implementer

from kcoral.ipc.shared import READ_CHUNK, SharedBuffer

#: A response body's chunks: bytes as they are, shared buffers read in slices.
Chunk = bytes | SharedBuffer

#: The slice that goes through the transport when the socket is full: more
#: than the transport's buffer size, so it pauses until the socket drains.
WAIT_SLICE = 128 * 1024


class DirectSocket:
    """
    The TCP socket under a plain HTTP/1.x response, for C{os.sendfile}.

    Bytes sent here pass the transport's buffer, so they are sent only
    while that buffer is empty (L{ready}), and the response's framing must
    be the body itself (a C{Content-Length}, not chunked).
    """

    def __init__(self, request: Request, transport: tcp.Connection) -> None:
        self._request = request
        self._transport = transport

    @classmethod
    def of(cls, request: object) -> DirectSocket | None:
        """The direct socket of C{request}, or C{None} (TLS, a wrapper, no C{sendfile})."""
        channel = request.channel if isinstance(request, Request) else None
        transport = None if channel is None else channel.transport
        if (
            not hasattr(os, "sendfile")
            or not isinstance(transport, tcp.Connection)
            or ISSLTransport.providedBy(transport)
            or getattr(transport, "TLS", False)
        ):
            return None
        return cls(request, transport)

    def ready(self) -> bool:
        """Whether bytes may go to the socket now, in order with what went before."""
        request, transport = self._request, self._transport
        try:
            return bool(
                request.startedWriting
                and not request.chunked
                and not request.finished
                and not request._disconnected
                and "write" not in vars(request)  # a HEAD response writes nothing
                and transport.connected
                and not transport.disconnecting
                and not transport._tempDataLen
                and transport.offset == len(transport.dataBuffer)
            )
        except AttributeError:  # another Twisted's internals: never guess
            return False

    def send(self, buffer: SharedBuffer, offset: int) -> int:
        """
        Send C{buffer} from C{offset} until the socket is full or it is all
        sent; the bytes sent (0: the socket was full).

        @raise ConnectionError: the client went away.
        @raise OSError: C{sendfile} cannot send this (the caller falls back).
        """
        sent = 0
        fd, end = buffer.fileno(), len(buffer)
        while offset + sent < end:
            try:
                count = os.sendfile(
                    self._transport.fileno(), fd, offset + sent, end - offset - sent
                )
            except BlockingIOError:
                break
            if count == 0:
                raise EOFError("a shared result buffer ended early")
            sent += count
        self._request.sentLength += sent
        return sent


@implementer(IPullProducer)
class BodyProducer:
    """
    Writes C{chunks} to C{request}, one slice per C{resumeProducing}.

    C{done} fires with C{None} once every byte was written, or with a
    failure when reading a buffer failed; L{stop} (the client went away)
    fires it with C{None} and writes nothing more.
    """

    def __init__(
        self,
        request: Any,
        chunks: Sequence[Chunk],
        slice_bytes: int = READ_CHUNK,
        direct: DirectSocket | None = None,
    ):
        self._request = request
        self._chunks = list(chunks)
        self._slice = slice_bytes
        self._index = 0
        self._offset = 0
        self._direct = direct
        self.done: Deferred[None] = Deferred()
        self.written = 0
        #: Of C{written}, the bytes sent with C{sendfile}.
        self.sent_directly = 0

    def start(self) -> Deferred[None]:
        """Register with the request; the transport pulls from here on."""
        self._request.registerProducer(self, False)
        return self.done

    def resumeProducing(self) -> None:
        if self.done.called:
            return
        try:
            data = self._next()
        except ConnectionError:
            self._finish(None)  # the client went away; the transport sees it too
            return
        except Exception:
            self._finish(Failure())
            return
        if data is None:
            self._finish(None)
            return
        self.written += len(data)
        self._request.write(data)

    def _next(self) -> bytes | None:
        while self._index < len(self._chunks):
            chunk = self._chunks[self._index]
            if isinstance(chunk, bytes):
                self._index += 1
                if chunk:
                    return chunk
                continue
            size = self._slice
            if self._offset < len(chunk) and self._direct is not None and self._direct.ready():
                try:
                    sent = self._direct.send(chunk, self._offset)
                except ConnectionError:
                    raise  # the client left (an OSError, but no reason to fall back)
                except OSError:
                    self._direct = None  # sendfile refused this: slices from now on
                    sent = 0
                self._offset += sent
                self.written += sent
                self.sent_directly += sent
                if self._offset >= len(chunk):
                    continue
                # The socket is full: one slice through the transport, which
                # resumes this producer once the socket has drained.
                size = min(size, WAIT_SLICE)
            if self._offset < len(chunk):
                data = chunk.pread(self._offset, size)
                if not data:
                    raise OSError("a shared result buffer ended early")
                self._offset += len(data)
                return data
            self._index += 1
            self._offset = 0
        return None

    def stopProducing(self) -> None:
        self._finish(None)

    def stop(self) -> None:
        """The response will not be completed (the client left)."""
        self._finish(None)

    def _finish(self, result: Failure | None) -> None:
        if self.done.called:
            return
        self._chunks = []
        try:
            self._request.unregisterProducer()
        except Exception:
            pass  # the connection is already gone
        if isinstance(result, Failure):
            self.done.errback(result)
        else:
            self.done.callback(None)


def body_length(chunks: Sequence[Chunk]) -> int:
    """The total length of a body's chunks."""
    return sum(len(chunk) for chunk in chunks)


def shared_bytes(chunks: Sequence[Chunk]) -> int:
    """How many of a body's bytes are in shared buffers."""
    return sum(len(chunk) for chunk in chunks if isinstance(chunk, SharedBuffer))
