# -*- test-case-name: tests.unit.test_gateway_relay -*-
"""
A node's large result, relayed to its client as it arrives.

A node posts a job's result to C{POST /_pool/jobs/<job>/result}.  A small
one is read whole and then relayed (L{kcoral.gateway.api}); one larger
than L{STREAM_RESULT_BYTES} is not spooled at all: as soon as the post's
head is in (token, result headers and C{Content-Length} checked), the job
is settled with a L{ResultRelay} as its body, the client's response starts
with the node's status and length, and each chunk of the post goes to the
client's connection as it is read from the node's.

Flow control is the request's own (L{kcoral.server.http.request}): the
relay is the post's streamed body, its L{backlog} is what the client's
connection has not taken yet, so a slow client stops the node's connection
from being read (and its stall deadline waits) until the client catches
up.  The relay is also the client response's push producer, so it learns
when the client's connection is full and when it drains.

What a streamed relay gives up: once the client has the head, a node that
dies mid-body can no longer be answered with a 502; the client's
connection is closed short of its C{Content-Length} instead (a transport
error to the client, an outcome as unknown as the 502's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer
from twisted.logger import Logger
from zope.interface import implementer

__all__ = ["STREAM_RESULT_BYTES", "ResultRelay"]

#: Results larger than this are relayed as they arrive; smaller ones are
#: read whole first (a node lost mid-post then still gets its client a 502).
STREAM_RESULT_BYTES = 1 << 20

#: What L{ResultRelay.backlog} says while the client's connection is full:
#: more than the request's pause threshold, so the node's connection stops.
_BLOCKED = 1 << 62


@implementer(IPushProducer)
class ResultRelay:
    """
    The body of one node's result post, passed to one client's response.

    Fed by the post's request (L{feed}, the streamed-body interface of
    L{kcoral.server.http.request.LimitedRequest}); written to the client's
    request once L{attach}ed.  L{done} fires with whether every byte
    reached the client.
    """

    log = Logger()

    def __init__(self, length: int, job: str = "") -> None:
        self.length = length
        self.job = job
        self.received = 0
        self.written = 0
        #: Fires with C{True} once all C{length} bytes are written to the
        #: client, C{False} when the client left or the node's post broke.
        self.done: Deferred[bool] = Deferred()
        #: The job's C{delivered} (L{kcoral.gateway.dispatch.Outcome}): the
        #: node's post is answered when it fires.
        self.delivered: Deferred[bool] | None = None
        self._early: list[bytes] = []
        self._client: Any = None
        self._client_gone = False
        self._blocked = False
        self._drained: list[tuple[int, Callable[[], None]]] = []

    # -- the node's side (the post's streamed body) ---------------------------

    @property
    def settling(self) -> bool:
        """Never: nothing is left to do once the post's last byte is fed."""
        return False

    def feed(self, data: bytes) -> None:
        """Bytes of the post's body, in order."""
        if self.done.called:
            return
        self.received += len(data)
        if self.received > self.length:
            self.abort()
            return
        if self._client_gone:
            pass
        elif self._client is None:
            self._early.append(data)
        else:
            self._client.write(data)
            self.written += len(data)
        if self.received == self.length and (self._client is not None or self._client_gone):
            # (Before the client is attached, L{attach} ends it.)
            self._end(not self._client_gone)

    def backlog(self) -> int:
        """Bytes the client has not taken: large while its connection is full."""
        if self._blocked:
            return _BLOCKED
        return sum(len(c) for c in self._early)

    def when_drained(self, level: int, f: Callable[[], None]) -> None:
        """Call C{f} once L{backlog} is at most C{level}."""
        if self.backlog() <= level:
            f()
        else:
            self._drained.append((level, f))

    def abort(self) -> None:
        """
        The post ended short (the node's connection was lost, or the body
        broke a limit): the client's connection is closed short of its
        length, so it cannot take the bytes it has for a whole answer.
        """
        if self.done.called:
            return
        if self._client is not None and not self._client_gone:
            self.log.warn(
                "job {job}: the node's result broke off after {received} of {length} "
                "bytes; the client's connection is closed",
                kcoral_event="job_relay_broken",
                job=self.job,
                received=self.received,
                length=self.length,
            )
            transport = getattr(getattr(self._client, "channel", None), "transport", None)
            if transport is not None:
                transport.abortConnection()
        self._end(False)

    def close(self) -> None:
        """Nothing to close (the relay holds no file)."""

    # -- the client's side --------------------------------------------------------

    def attach(self, request: Any) -> Deferred[bool]:
        """
        Write the body to C{request} (its head is set): what arrived so far
        at once, the rest as it arrives.  Fires as L{done}; cancelling it
        means the client left (the rest of the post is read and dropped).
        """
        self._client = request
        request.registerProducer(self, True)
        early, self._early = self._early, []
        for chunk in early:
            request.write(chunk)
            self.written += len(chunk)
        if self.received == self.length and not self.done.called:
            self._end(True)
        self._wake()
        d: Deferred[bool] = Deferred(lambda _: self._left())
        self.done.addBoth(lambda result: None if d.called else d.callback(result))
        return d

    def _left(self) -> None:
        self._client_gone = True
        self._blocked = False
        self._wake()

    def _end(self, ok: bool) -> None:
        client = self._client
        if client is not None and not self._client_gone:
            try:
                client.unregisterProducer()
            except Exception:
                pass
        self._blocked = False
        self._wake()
        if not self.done.called:
            self.done.callback(ok)

    def _wake(self) -> None:
        waiting, self._drained = self._drained, []
        for level, f in waiting:
            self.when_drained(level, f)

    # -- IPushProducer, for the client's connection -----------------------------

    def pauseProducing(self) -> None:
        self._blocked = True

    def resumeProducing(self) -> None:
        self._blocked = False
        self._wake()

    def stopProducing(self) -> None:
        self._left()
