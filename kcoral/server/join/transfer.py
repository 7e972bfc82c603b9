# -*- test-case-name: tests.unit.test_join -*-
"""
A node's HTTP(S) traffic with the gateway: the bytes that NATS does not
carry.

L{GatewayLink.fetch_blob} fetches one blob a job needs with the job's
token and checks its size and SHA-256 as it arrives: a blob that does not
match is refused (L{BlobRefused}) and never reaches the node's cache.
L{GatewayLink.post_result} posts the response the node's own server gave
(L{kcoral.server.join.local.LocalResponse}), retried a few times over
connection failures.  Neither needs NATS: a job that is running when the
NATS connection drops still delivers its result.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, cast

import attrs
import treq
from treq.client import HTTPClient
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.web.http_headers import Headers

from kcoral.gateway.jobs import BlobRef, JobMessage, result_headers
from kcoral.server.join.local import LocalResponse

__all__ = ["BlobRefused", "GatewayLink", "ResultNotDelivered"]


class BlobRefused(Exception):
    """A blob from the gateway was refused: wrong hash or size, or not served."""

    def __init__(self, sha256: str, reason: str) -> None:
        super().__init__(f"blob {sha256}: {reason}")
        self.sha256 = sha256
        self.reason = reason


class ResultNotDelivered(Exception):
    """The gateway did not take a job's result (the message says why)."""


class _Hashing:
    """Collects a blob's chunks, hashing and counting them as they come."""

    def __init__(self, ref: BlobRef) -> None:
        self.ref = ref
        self.hash = hashlib.sha256()
        self.chunks: list[bytes] = []
        self.size = 0

    def __call__(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.ref.size:
            raise BlobRefused(self.ref.sha256, f"more than the {self.ref.size} bytes announced")
        self.hash.update(chunk)
        self.chunks.append(chunk)

    def result(self) -> bytes:
        if self.size != self.ref.size:
            raise BlobRefused(
                self.ref.sha256, f"{self.size} bytes, not the {self.ref.size} announced"
            )
        if self.hash.hexdigest() != self.ref.sha256:
            raise BlobRefused(self.ref.sha256, "content does not match its SHA-256")
        return b"".join(self.chunks)


@attrs.define(eq=False)
class GatewayLink:
    """
    The gateway's node routes, as one node uses them.

    @ivar node_id: sent with each result (C{X-KCoral-Result-Node}).
    @ivar retries: further attempts of a result post after a connection failure.
    @ivar retry_delay: seconds before the first retry; doubled after each.
    @ivar response_timeout: seconds to wait for a response's head.
    """

    _http: HTTPClient
    _clock: IReactorTime
    node_id: str
    retries: int = 3
    retry_delay: float = 0.5
    response_timeout: float = 60.0

    log = Logger()

    def _auth(self, job: JobMessage) -> dict[str, str]:
        return {"Authorization": f"Bearer {job.token}"}

    async def fetch_blob(self, job: JobMessage, ref: BlobRef) -> bytes:
        """
        The bytes of C{ref}, fetched with C{job}'s token and checked.

        @raise BlobRefused: not served (a non-200), or not the announced
            size and SHA-256.
        """
        response = await self._http.get(
            job.blob_url(ref.sha256),
            headers=_h(self._auth(job)),
            timeout=self.response_timeout,
            reactor=cast(Any, self._clock),
            # The token goes to the gateway and nowhere else.
            allow_redirects=False,
        )
        if response.code != 200:
            await response.content()
            raise BlobRefused(ref.sha256, f"the gateway answered {response.code}")
        collector = _Hashing(ref)
        await treq.collect(response, collector)
        return collector.result()

    async def post_result(self, job: JobMessage, response: LocalResponse) -> int:
        """
        Post C{response} as C{job}'s result; the gateway's status code.

        A refused connection or a dropped one is retried (C{retries} times,
        with doubling delays); an answer of any status is not.

        @raise ResultNotDelivered: every attempt failed to connect.
        """
        headers = result_headers(
            response.status,
            response.content_type,
            retry_after=response.retry_after,
            node=self.node_id,
        )
        headers.update(self._auth(job))
        delay = self.retry_delay
        for attempt in range(self.retries + 1):
            try:
                answer = await self._http.post(
                    job.result_url(),
                    data=response.body,
                    headers=_h(headers),
                    timeout=self.response_timeout,
                    reactor=cast(Any, self._clock),
                    allow_redirects=False,
                )
                await answer.content()
                return int(answer.code)
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


def _nothing() -> None:
    return None


#: What a blob fetch looks like to the runner (L{GatewayLink.fetch_blob}).
FetchBlob = Callable[[JobMessage, BlobRef], Any]


def _h(headers: dict[str, str]) -> Headers:
    """Twisted's L{Headers} of a plain mapping."""
    return Headers({name: [value] for name, value in headers.items()})
