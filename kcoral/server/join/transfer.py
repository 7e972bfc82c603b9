# -*- test-case-name: tests.unit.test_join -*-
"""
A node's HTTP(S) traffic with the gateway: the bytes that NATS does not
carry.

L{GatewayLink.fetch_blob} fetches one blob a job needs with the job's
token, streaming it as it arrives into what an upload's blob becomes on
the server (L{kcoral.ipc.uploads.StreamingBlobWriter}: in memory when
small, else a sealed shared buffer written and hashed by threads off the
reactor), and checks its size and SHA-256: a blob that does not match is
refused (L{BlobRefused}) and never reaches the node's cache.
L{GatewayLink.post_result} posts the answer the node's pipeline gave
(L{kcoral.server.http.app.Answer}), streaming a large body from the
worker's sealed buffers a slice at a time (L{ChunksProducer}), retried a
few times over connection failures.  Neither needs NATS: a job that is
running when the NATS connection drops still delivers its result.

Both go through Twisted's own L{IAgent} (persistent connections from the
server's pool), not treq's C{HTTPClient}: a result post is on every job's
critical path, and treq's layers (its cookie and content-decoding agents,
its URL parsing) cost about 0.1 ms of the node's CPU per post for nothing
a node needs (no redirects, no cookies, no compressed answers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import attrs
import hyperlink
from treq import content
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IConsumer, IDelayedCall, IReactorFromThreads, IReactorTime
from twisted.internet.protocol import Protocol
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IBodyProducer, IResponse
from zope.interface import implementer

from kcoral.gateway.jobs import BlobRef, JobMessage, result_headers
from kcoral.ipc.shared import READ_CHUNK, SharedBuffer
from kcoral.ipc.shared import available as shared_memory_available
from kcoral.ipc.uploads import StreamingBlobWriter
from kcoral.server.http.app import Answer
from kcoral.wire.multipart import Blob

__all__ = ["BlobRefused", "ChunksProducer", "GatewayLink", "ResultNotDelivered"]

#: Fetched blobs up to this size stay bytes; larger ones stream into a
#: sealed shared buffer (as an upload's do).
SHARE_BYTES = 64 * 1024

#: Bytes of a fetched blob that may wait for the hash thread before the
#: connection stops reading, and the level at which it reads again (as an
#: upload's, L{kcoral.server.http.request}).
BACKLOG_PAUSE_BYTES = 32 << 20
BACKLOG_RESUME_BYTES = 16 << 20


class BlobRefused(Exception):
    """A blob from the gateway was refused: wrong hash or size, or not served."""

    def __init__(self, sha256: str, reason: str) -> None:
        super().__init__(f"blob {sha256}: {reason}")
        self.sha256 = sha256
        self.reason = reason


class ResultNotDelivered(Exception):
    """The gateway did not take a job's result (the message says why)."""


class _BlobReceiver(Protocol):
    """
    Streams a blob response into a L{StreamingBlobWriter}, counting it
    against the announced size; C{done} fires with the finished L{Blob}
    (its digest not yet checked) or fails with L{BlobRefused}.
    """

    def __init__(
        self,
        ref: BlobRef,
        reactor: Any,
        run_blocking: Callable[..., Deferred[Any]] | None,
        stall_seconds: float = 60.0,
    ) -> None:
        self.ref = ref
        self._reactor = reactor
        self._run_blocking = run_blocking
        self.stall_seconds = stall_seconds
        shared = ref.size > SHARE_BYTES and shared_memory_available()
        self.writer = StreamingBlobWriter(SHARE_BYTES, None, shared=shared)
        self.done: Deferred[Blob] = Deferred()
        self._paused = False
        self._stall: IDelayedCall | None = None

    def connectionMade(self) -> None:
        self._watch()

    def _watch(self) -> None:
        """(Re)start the stall timer: a body that sends nothing for C{stall_seconds} is cut off."""
        if self._stall is not None and self._stall.active():
            self._stall.reset(self.stall_seconds)
        else:
            self._stall = self._reactor.callLater(self.stall_seconds, self._stalled)

    def _unwatch(self) -> None:
        if self._stall is not None and self._stall.active():
            self._stall.cancel()
        self._stall = None

    def _stalled(self) -> None:
        self._stall = None
        if self.done.called or self._paused:
            return
        self._refuse(f"no byte for {self.stall_seconds:g} s (the transfer stalled)")
        cast(Any, self.transport).stopProducing()

    def dataReceived(self, data: bytes) -> None:
        if self.done.called:
            return
        self._watch()
        if self.writer.size + len(data) > self.ref.size:
            self._refuse(f"more than the {self.ref.size} bytes announced")
            transport: Any = self.transport
            transport.stopProducing()
            return
        self.writer.write(data)
        sink = self.writer.offload
        if sink is not None and not self._paused and sink.backlog > BACKLOG_PAUSE_BYTES:
            # The hash thread is behind: TCP holds the gateway back meanwhile.
            self._paused = True
            self._unwatch()
            cast(Any, self.transport).pauseProducing()
            from_threads = IReactorFromThreads(self._reactor)
            sink.notify_at(BACKLOG_RESUME_BYTES, lambda: from_threads.callFromThread(self._resume))

    def _resume(self) -> None:
        if self._paused:
            self._paused = False
            if not self.done.called:
                self._watch()
                cast(Any, self.transport).resumeProducing()

    def connectionLost(self, reason: Failure = ResponseDone()) -> None:  # type: ignore[assignment]
        self._unwatch()
        if self.done.called:
            return
        if not reason.check(ResponseDone):
            self._refuse(f"the transfer broke off: {reason.getErrorMessage()}")
            return
        if self.writer.size != self.ref.size:
            self._refuse(f"{self.writer.size} bytes, not the {self.ref.size} announced")
            return
        if self.writer.offload is None or self._run_blocking is None:
            self._finished(self.writer.finish())
            return
        # Waits for the blob's threads: in the thread pool, not here.
        d = self._run_blocking(self.writer.finish)
        d.addCallbacks(self._finished, self._failed)

    def _finished(self, blob: Blob) -> None:
        if blob.digest != self.ref.sha256:
            blob.close()
            self.done.errback(BlobRefused(self.ref.sha256, "content does not match its SHA-256"))
            return
        self.done.callback(blob)

    def _failed(self, failure: Failure) -> None:
        self.writer.discard()
        self.done.errback(BlobRefused(self.ref.sha256, failure.getErrorMessage()))

    def _refuse(self, reason: str) -> None:
        self.writer.discard()
        self.done.errback(BlobRefused(self.ref.sha256, reason))


@implementer(IBodyProducer)
class ChunksProducer:
    """
    A request body of C{chunks}: bytes as they are, sealed buffers read a
    slice at a time as the connection takes them (the body is never
    joined or copied whole).
    """

    def __init__(self, chunks: Sequence[bytes | SharedBuffer], slice_bytes: int = READ_CHUNK):
        self._chunks = list(chunks)
        self._slice = slice_bytes
        self.length = sum(len(chunk) for chunk in self._chunks)
        self._index = 0
        self._offset = 0
        self._paused = False
        self._stopped = False
        self._consumer: IConsumer | None = None
        self._done: Deferred[None] = Deferred()

    def startProducing(self, consumer: IConsumer) -> Deferred[None]:
        self._consumer = consumer
        self._produce()
        return self._done

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

    def _produce(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        # Writing may pause this producer (the socket is full): the loop
        # stops, and resumeProducing goes on from here.
        while not self._paused and not self._stopped and not self._done.called:
            try:
                data = self._next()
            except Exception:
                self._done.errback()
                return
            if data is None:
                self._done.callback(None)
                return
            consumer.write(data)

    def pauseProducing(self) -> None:
        self._paused = True

    def resumeProducing(self) -> None:
        if self._paused:
            self._paused = False
            self._produce()

    def stopProducing(self) -> None:
        # (IBodyProducer: the Deferred of startProducing never fires then.)
        self._stopped = True


@attrs.define(eq=False)
class GatewayLink:
    """
    The gateway's node routes, as one node uses them.

    @ivar node_id: sent with each result (C{X-KCoral-Result-Node}).
    @ivar run_blocking: runs a blocking call in the server's thread pool
        (the wait for a large blob's hash); C{None}: here.
    @ivar retries: further attempts of a result post after a connection failure.
    @ivar retry_delay: seconds before the first retry; doubled after each.
    @ivar response_timeout: seconds to wait for a response's head, and
        the longest silence inside a blob's body before it is cut off.
    """

    _agent: IAgent
    _clock: IReactorTime
    node_id: str
    run_blocking: Callable[..., Deferred[Any]] | None = None
    retries: int = 3
    retry_delay: float = 0.5
    response_timeout: float = 60.0

    log = Logger()

    def _auth(self, job: JobMessage) -> dict[str, str]:
        return {"Authorization": f"Bearer {job.token}"}

    async def _request(
        self,
        method: bytes,
        url: str,
        headers: dict[str, str],
        body: IBodyProducer | None = None,
    ) -> IResponse:
        """
        The response's head, within C{response_timeout} (the request is
        cancelled then: C{twisted.internet.defer.TimeoutError}).
        """
        d = self._agent.request(method, _url(url), _h(headers), body)
        d.addTimeout(self.response_timeout, self._clock)
        response: IResponse = await d
        return response

    async def fetch_blob(self, job: JobMessage, ref: BlobRef) -> bytes | SharedBuffer:
        """
        The bytes of C{ref} (a sealed shared buffer when large), fetched
        with C{job}'s token and checked.

        @raise BlobRefused: not served (a non-200), or not the announced
            size and SHA-256.
        """
        # The token goes to the gateway and nowhere else (an agent follows
        # no redirect); the body streams into the writer below.
        response = await self._request(b"GET", job.blob_url(ref.sha256), self._auth(job))
        if response.code != 200:
            await content(response)
            raise BlobRefused(ref.sha256, f"the gateway answered {response.code}")
        receiver = _BlobReceiver(ref, self._clock, self.run_blocking, self.response_timeout)
        response.deliverBody(receiver)
        blob = await receiver.done
        if blob.shared is not None:
            return blob.shared
        try:
            return blob.read()
        finally:
            blob.close()

    async def post_result(self, job: JobMessage, answer: Answer) -> int:
        """
        Post C{answer} as C{job}'s result; the gateway's status code.

        A refused connection or a dropped one is retried (C{retries} times,
        with doubling delays); an answer of any status is not.

        @raise ResultNotDelivered: every attempt failed to connect.
        """
        headers = result_headers(
            answer.status,
            answer.content_type,
            retry_after=answer.headers.get("Retry-After"),
            node=self.node_id,
        )
        headers.update(self._auth(job))
        delay = self.retry_delay
        for attempt in range(self.retries + 1):
            try:
                answered = await self._request(
                    b"POST", job.result_url(), headers, ChunksProducer(_chunks(answer))
                )
                await content(answered)
                return int(answered.code)
            except Exception as e:
                if attempt == self.retries:
                    raise ResultNotDelivered(
                        f"job {job.job}: result not delivered after {attempt + 1} attempts: {e!r}"
                    ) from e
                self.log.warn(
                    "job {job}: result post failed ({error}); retrying in {delay} s",
                    kcoral_event="join_result_retry",
                    job=job.job,
                    error=repr(e),
                    delay=delay,
                )
                await deferLater(self._clock, delay, _nothing)
                delay *= 2
        raise AssertionError("unreachable")


def _chunks(answer: Answer) -> Sequence[bytes | SharedBuffer]:
    """
    A result post's body (a fresh producer of it for each attempt): bytes
    written as they are, at once (no turn of the reactor between the head
    and a small body), sealed buffers a slice at a time.
    """
    body = answer.body
    return [body] if isinstance(body, bytes) else body


def _nothing() -> None:
    return None


def _h(headers: dict[str, str]) -> Headers:
    """Twisted's L{Headers} of a plain mapping."""
    return Headers({name: [value] for name, value in headers.items()})


def _url(url: str) -> bytes:
    """A URL as an agent takes it: ASCII as it is, else IDNA-encoded."""
    try:
        return url.encode("ascii")
    except UnicodeEncodeError:
        return hyperlink.URL.from_text(url).to_uri().to_text().encode("ascii")
