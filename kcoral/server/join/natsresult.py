# -*- test-case-name: tests.unit.test_join -*-
"""
A small result back to the gateway as a NATS request, not an HTTP post.

A job's result goes to the gateway process that holds its client.  Over
HTTP that is a second request on each side (the node's agent, the
gateway's site and routes), about half a millisecond of CPU each for a
null program's answer.  When the job names the gateway process's result
subjects (L{JobMessage.results}) and the body is at most
L{NATS_RESULT_BYTES} (and fits the server's C{max_payload}),
L{NatsResults.send} sends it as one NATS request
instead, on C{kcoral.results.<key>.<node id>} (the only result subjects
this node's NATS user may publish on), with the result headers, the job
and its token; the gateway replies once the client has it.

Nothing is lost on the way: when NATS is down, nobody listens (C{no
responders}), or no reply comes in L{NatsResults.timeout} seconds,
L{send} says so (C{None}) and the caller posts the result over HTTP.  A
result the gateway took over NATS and that then comes again by post (its
reply lost) is refused there, never relayed twice: a settled job is
forgotten, and its token with it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import attrs
from twisted.internet.defer import CancelledError
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from kcoral.gateway.jobs import (
    NATS_RESULT_BYTES,
    JobMessage,
    nats_result_headers,
    parse_result_reply,
    result_headers,
    results_subject,
)
from kcoral.gateway.natsbridge import NatsBridge
from kcoral.ipc.shared import SharedBuffer
from kcoral.server.http.app import Answer

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js import JetStreamContext

__all__ = ["NatsResults", "nats_payload"]

#: Seconds to wait for the gateway's reply before posting over HTTP.
REPLY_TIMEOUT = 5.0

#: Seconds results are only posted after a reply that never came: a node
#: whose NATS user may not publish results (permissions not updated) would
#: otherwise hold every small result for the whole reply timeout.
PAUSE_SECONDS = 60.0

#: Bytes of a message's budget (nats-server's C{max_payload}) kept for its
#: headers: a body that does not fit beside them is posted.
RESULT_HEAD_ROOM = 4096


def nats_payload(answer: Answer, limit: int = NATS_RESULT_BYTES) -> bytes | None:
    """C{answer}'s body as one message's payload, or C{None} when it is over C{limit}."""
    if answer.length > limit:
        return None
    body = answer.body
    if isinstance(body, bytes):
        return body
    return b"".join(c.tobytes() if isinstance(c, SharedBuffer) else bytes(c) for c in body)


@attrs.define(eq=False)
class NatsResults:
    """
    Sends jobs' small results over the node's NATS connection.

    @ivar node_id: this node's id: the last token of its result subjects.
    @ivar timeout: seconds to wait for the gateway's reply.
    @ivar pause: seconds of posting only after a reply timed out.
    """

    bridge: NatsBridge
    node_id: str
    _clock: IReactorTime
    timeout: float = REPLY_TIMEOUT
    pause: float = PAUSE_SECONDS
    #: Until when (the clock's seconds) results are only posted.
    paused_until: float = 0.0

    log = Logger()

    async def send(self, job: JobMessage, answer: Answer) -> int | None:
        """
        Send C{job}'s result over NATS: the status the gateway answered
        (as its post would have been answered), or C{None} when it was not
        sent or not answered (the caller posts it then).
        """
        if job.results is None or not self.bridge.connected:
            return None
        if self._clock.seconds() < self.paused_until:
            return None
        payload = nats_payload(answer)
        if payload is None:
            return None
        subject = results_subject(job.results, self.node_id)
        headers = nats_result_headers(
            job,
            result_headers(
                answer.status,
                answer.content_type,
                retry_after=answer.headers.get("Retry-After"),
                node=self.node_id,
            ),
        )

        async def request(client: Client, js: JetStreamContext) -> bytes | None:
            if len(payload) > client.max_payload - RESULT_HEAD_ROOM:
                return None  # a server with a smaller max_payload: posted
            reply = await client.request(subject, payload, timeout=self.timeout, headers=headers)
            return bytes(reply.data)

        try:
            data = await self.bridge.call(request, timeout=self.timeout + 1.0)
            if data is None:
                return None
            status, _ = parse_result_reply(data)
        except (TimeoutError, asyncio.TimeoutError, CancelledError):  # nats-py's too
            # No answer at all (a reply does come within milliseconds when
            # the gateway took the result): likely this node may not publish
            # on its result subjects; post for a while without waiting.
            self.paused_until = self._clock.seconds() + self.pause
            self.log.warn(
                "job {job}: no reply to its result over NATS in {timeout} s; posting "
                "results for {pause} s (may this node's NATS user publish on {subject}?)",
                kcoral_event="join_result_nats_paused",
                job=job.job,
                request_id=job.request_id,
                timeout=self.timeout,
                pause=self.pause,
                subject=subject,
            )
            return None
        except Exception as e:  # the post is the fallback, whatever went wrong
            self.log.info(
                "job {job}: result over NATS not answered ({error}); posting it",
                kcoral_event="join_result_fallback",
                job=job.job,
                request_id=job.request_id,
                error=f"{type(e).__name__}: {e}",
            )
            return None
        return status
