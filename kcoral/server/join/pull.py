# -*- test-case-name: tests.unit.test_join_pull,tests.integration.test_job_pull -*-
"""
JetStream pull requests whose messages reach the node as nats-py parses them.

A node claims each job the moment it arrives, so that the claim's round
trip to nats-server overlaps the node's own work on the job.  nats-py's
C{PullSubscription.fetch} hands its messages over only when its request
ends: a few loop turns after the first message (each C{next_msg} is a task
of its own around C{wait_for}), and, when it asked for more than one, after
the status that ends the batch, one more trip through nats-server.  So the
node makes its pull requests itself (C{$JS.API.CONSUMER.MSG.NEXT}, the
subject nats-py publishes them on) on a subscription with a callback, one
subscription per request: each message goes to the caller's C{arrived} in
the callback, and the request's end is read from its own reply subject.

Every request is one of two kinds, so that none is left open with jobs
still owed to it when its caller has gone on:

  - C{expires=None}: what the consumer holds now, up to C{batch} messages
    (C{no_wait}; nats-server ends it with a 404, or a 408 after fewer
    messages than asked for);
  - C{batch=1} with C{expires}: the next message, or a 408 when it expires.

A job is delivered to a request only while its subscription is there; the
subscription ends only with the request (or when nats-server has not ended
the request well past its expiry: a lost connection), so no job is sent
to a subscription that is gone and left to wait for its redelivery.  A
request the node ends itself as it stops (C{stopping}) gives back, with a
NAK, a job that its callback still sees.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from kcoral.gateway.natsbridge import bounded

__all__ = ["EXPIRY_GRACE", "PullRefused", "pull", "pull_subject", "status_of", "unsubscribe"]

#: Seconds past a request's expiry (or, for C{no_wait}, past its sending)
#: the node waits for nats-server to end it before giving up on it (a lost
#: connection: the request died with it).
EXPIRY_GRACE = 0.5

#: The JetStream API prefix (nats-py's default; the pool uses no domain).
API_PREFIX = "$JS.API"

#: Statuses that end a request normally: no messages now, or expired.
_ENDED = frozenset({"404", "408"})

#: A heartbeat (never asked for here, ignored if it comes).
_HEARTBEAT = "100"


class PullRefused(Exception):
    """
    nats-server ended a pull request with an error status (409 and the
    like: the consumer deleted, a limit of the consumer exceeded).
    """

    def __init__(self, status: str, description: str) -> None:
        super().__init__(f"{status} {description}".strip())
        self.status = status
        self.description = description


def pull_subject(stream: str, consumer: str) -> str:
    """The subject a pull request for C{consumer} of C{stream} is published on."""
    return f"{API_PREFIX}.CONSUMER.MSG.NEXT.{stream}.{consumer}"


def status_of(message: Any) -> tuple[str, str] | None:
    """A status message's code and description (C{("408", "Request Timeout")}), or C{None}."""
    headers = message.headers
    if not headers:
        return None
    status = headers.get("Status")
    if status is None:
        return None
    return str(status), str(headers.get("Description", ""))


async def _give_back(message: Any) -> None:
    """NAK C{message}, so that nats-server offers it again at once; failures ignored."""
    try:
        await message.nak()
    except Exception:
        pass  # not acknowledged either way: redelivered after the consumer's ack wait


def _request(batch: int, expires: float | None) -> bytes:
    body: dict[str, Any] = {"batch": batch}
    if expires is None:
        body["no_wait"] = True
    else:
        body["expires"] = max(1, int(expires * 1e9))
    return json.dumps(body).encode("ascii")


async def pull(
    client: Any,
    stream: str,
    consumer: str,
    batch: int,
    expires: float | None,
    arrived: Callable[[Any], None],
    *,
    stopping: asyncio.Future[None] | None = None,
    spent: list[Any] | None = None,
) -> int:
    """
    One pull request for up to C{batch} messages of C{consumer}; returns
    how many arrived, once nats-server has ended the request (or it
    outlived its expiry by L{EXPIRY_GRACE}, or C{stopping} is done).

    @param expires: seconds the request waits for a message; C{None}: only
        what is there now (C{no_wait}).  A waiting request is for one
        message: see the module's docstring.
    @param arrived: called with each job message, in the subscription's
        callback, as nats-py has parsed it; it must not raise.
    @param spent: where a request that nats-server ended leaves its
        subscription, for the caller to end with L{unsubscribe} once it
        has handed the jobs on (an UNSUB need not go before them); without
        it, the subscription ends before this returns.
    @raise PullRefused: nats-server ended the request with an error status.
    """
    if expires is not None and batch != 1:
        raise ValueError("a waiting pull request is for one message")
    if batch < 1:
        raise ValueError("batch must be at least 1")
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()
    count = 0

    def end(error: Exception | None = None) -> None:
        if ended.done():
            return
        if error is None:
            ended.set_result(None)
        else:
            ended.set_exception(error)

    async def received(message: Any) -> None:
        nonlocal count
        status = status_of(message)
        if ended.done():
            # The request was ended here (C{stopping}) while nats-server
            # still had it: a job sent meanwhile goes back to the queue now.
            if status is None:
                await _give_back(message)
            return
        if status is None:
            count += 1
            arrived(message)
            if count >= batch:
                end()
            return
        code, description = status
        if code == _HEARTBEAT:
            return
        if code in _ENDED:
            end()
            return
        end(PullRefused(code, description))

    def stop(_: object) -> None:
        end()

    inbox = client.new_inbox()
    subscription = await client.subscribe(inbox, cb=received)
    if stopping is not None:
        stopping.add_done_callback(stop)
    try:
        await client.publish(pull_subject(stream, consumer), _request(batch, expires), reply=inbox)
        try:
            # Awaited directly (no task between): the caller goes on in the
            # loop turn after the message that ends the request.
            await bounded(ended, (expires or 0.0) + EXPIRY_GRACE)
        except (TimeoutError, asyncio.TimeoutError):
            pass  # never ended: the connection was lost with the request
        return count
    finally:
        if stopping is not None:
            stopping.remove_done_callback(stop)
        over = ended.done() and not ended.cancelled()
        if not ended.done():
            ended.cancel()
        if spent is not None and over and not (stopping is not None and stopping.done()):
            # nats-server has ended the request: nothing more comes to it.
            spent.append(subscription)
        else:
            await unsubscribe([subscription])


async def unsubscribe(subscriptions: list[Any]) -> None:
    """End C{subscriptions} (and empty the list); a closed connection has ended them already."""
    ending, subscriptions[:] = list(subscriptions), []
    for subscription in ending:
        try:
            await subscription.unsubscribe()
        except Exception:
            pass  # the connection is closed, or closing: the subscription is gone with it
