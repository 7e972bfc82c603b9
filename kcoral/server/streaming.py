# -*- test-case-name: tests.unit.test_streaming -*-
"""
Writing a response body whose large parts are sealed shared buffers.

A worker's large returned tensor reaches the parent as a memfd
(L{kcoral.wire.shared.SharedBuffer}).  L{BodyProducer} streams the body's
chunks to the client as the transport asks for them (a pull producer
registered with the request), reading each shared buffer a slice at a time
with C{pread}: the parent never holds more than about one slice of a result
in its own memory, instead of a copy of the whole response.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPullProducer
from twisted.python.failure import Failure
from zope.interface import implementer

from kcoral.wire.shared import READ_CHUNK, SharedBuffer

#: A response body's chunks: bytes as they are, shared buffers read in slices.
Chunk = bytes | SharedBuffer


@implementer(IPullProducer)
class BodyProducer:
    """
    Writes C{chunks} to C{request}, one slice per C{resumeProducing}.

    C{done} fires with C{None} once every byte was written, or with a
    failure when reading a buffer failed; L{stop} (the client went away)
    fires it with C{None} and writes nothing more.
    """

    def __init__(self, request: Any, chunks: Sequence[Chunk], slice_bytes: int = READ_CHUNK):
        self._request = request
        self._chunks = list(chunks)
        self._slice = slice_bytes
        self._index = 0
        self._offset = 0
        self.done: Deferred[None] = Deferred()
        self.written = 0

    def start(self) -> Deferred[None]:
        """Register with the request; the transport pulls from here on."""
        self._request.registerProducer(self, False)
        return self.done

    def resumeProducing(self) -> None:
        if self.done.called:
            return
        try:
            data = self._next()
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
            if self._offset < len(chunk):
                data = chunk.pread(self._offset, self._slice)
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
