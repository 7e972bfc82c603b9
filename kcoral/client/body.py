# -*- test-case-name: tests.unit.test_client_async -*-
"""
The C{/execute} request body (protocol §3.1) as a streaming
L{IBodyProducer}: the program part, then one part per blob, framed exactly
as the 0.1.1 client frames them.

Blob bytes are never joined into one body: the producer writes slices of
the program's own blob objects, cooperatively and with back-pressure, so a
256 MiB tensor is held once, and the reactor keeps running while it goes.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IConsumer
from twisted.internet.task import CooperativeTask, Cooperator, TaskFinished
from twisted.web.iweb import IBodyProducer
from zope.interface import implementer

#: Bytes written per cooperative step.
CHUNK_SIZE = 1 << 20


@attrs.frozen
class Part:
    """One form-data part: its name, media type and payload."""

    name: str
    content_type: str
    data: bytes


def part_header(boundary: str, part: Part) -> bytes:
    return (
        f"--{boundary}\r\n"
        f'Content-Disposition: form-data; name="{part.name}"\r\n'
        f"Content-Type: {part.content_type}\r\n\r\n"
    ).encode()


def choose_boundary(parts: Sequence[Part]) -> str:
    """A random 32-hex boundary that occurs in no payload."""
    while True:
        boundary = secrets.token_hex(16)
        delimiter = f"\r\n--{boundary}".encode("ascii")
        if all(delimiter not in part.data for part in parts):
            return boundary


def body_chunks(boundary: str, parts: Sequence[Part], chunk_size: int) -> Iterator[bytes]:
    """The body, in pieces of at most C{chunk_size} payload bytes."""
    for part in parts:
        yield part_header(boundary, part)
        view = memoryview(part.data)
        for start in range(0, len(view), chunk_size):
            yield bytes(view[start : start + chunk_size])
        yield b"\r\n"
    yield f"--{boundary}--\r\n".encode("ascii")


def body_length(boundary: str, parts: Sequence[Part]) -> int:
    framing = sum(len(part_header(boundary, p)) + len(p.data) + 2 for p in parts)
    return framing + len(boundary) + 6


@implementer(IBodyProducer)
class MultipartProducer:
    """
    Writes C{parts} as C{multipart/form-data} to a consumer, one chunk per
    cooperative step; C{on_progress(sent, length)} follows it.

    @ivar content_type: the request's C{Content-Type} header value.
    @ivar length: the exact body length (so C{Content-Length} is sent).
    """

    def __init__(
        self,
        parts: Sequence[Part],
        *,
        cooperator: Cooperator,
        boundary: str | None = None,
        chunk_size: int = CHUNK_SIZE,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self._parts = list(parts)
        self._boundary = boundary if boundary is not None else choose_boundary(self._parts)
        self._cooperator = cooperator
        self._chunk_size = chunk_size
        self._on_progress = on_progress
        self._task: CooperativeTask[Any] | None = None
        self.content_type = f"multipart/form-data; boundary={self._boundary}"
        self.length = body_length(self._boundary, self._parts)

    def _write(self, consumer: IConsumer) -> Iterator[None]:
        sent = 0
        for chunk in body_chunks(self._boundary, self._parts, self._chunk_size):
            consumer.write(chunk)
            sent += len(chunk)
            if self._on_progress is not None:
                self._on_progress(sent, self.length)
            yield None

    def startProducing(self, consumer: IConsumer) -> Deferred[None]:
        self._task = self._cooperator.cooperate(self._write(consumer))
        done: Deferred[Any] = self._task.whenDone()
        return done.addCallback(lambda _: None)

    def _control(self, action: Callable[[CooperativeTask[Any]], None]) -> None:
        if self._task is None:
            return
        try:
            action(self._task)
        except TaskFinished:
            pass  # the body was already written, or its writing stopped

    def pauseProducing(self) -> None:
        self._control(CooperativeTask.pause)

    def resumeProducing(self) -> None:
        self._control(CooperativeTask.resume)

    def stopProducing(self) -> None:
        self._control(CooperativeTask.stop)


def encode_body(parts: Sequence[Part], boundary: str) -> bytes:
    """The whole body at once (for tests and comparisons)."""
    return b"".join(body_chunks(boundary, parts, CHUNK_SIZE))


__all__ = ["MultipartProducer", "Part", "choose_boundary", "encode_body"]
