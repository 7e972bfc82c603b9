"""
L{kcoral.server.join.pull} against a stand-in for nats-py's client: how a
pull request reads the messages of its own subscription (jobs handed on
as they come, the statuses that end it, an error status), what it asks
nats-server for, and what becomes of its subscription.  The real
nats-server's side is in tests/integration/test_job_pull.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import pytest

from kcoral.server.join import pull as pull_module
from kcoral.server.join.pull import PullRefused, pull, pull_subject, status_of, unsubscribe


@attrs.define
class Message:
    data: bytes = b""
    headers: dict[str, str] | None = None
    nakked: int = 0

    async def nak(self) -> None:
        self.nakked += 1


@attrs.define
class Subscription:
    ended: int = 0

    async def unsubscribe(self) -> None:
        self.ended += 1


@attrs.define
class Client:
    """Records the subscription and the request; C{deliver} plays nats-server's part."""

    published: list[tuple[str, bytes, str]] = attrs.field(factory=list)
    callback: Callable[[Any], Awaitable[None]] | None = None
    subscription: Subscription = attrs.field(factory=Subscription)
    inbox: str = "_INBOX_node-a.x1"

    def new_inbox(self) -> str:
        return self.inbox

    async def subscribe(self, subject: str, cb: Callable[[Any], Awaitable[None]]) -> Subscription:
        assert subject == self.inbox
        self.callback = cb
        return self.subscription

    async def publish(self, subject: str, payload: bytes, reply: str) -> None:
        self.published.append((subject, payload, reply))

    async def deliver(self, message: Message) -> None:
        assert self.callback is not None
        await self.callback(message)


def status(code: str, description: str = "") -> Message:
    return Message(headers={"Status": code, "Description": description})


def run(scenario: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(scenario(), 10))


async def started(client: Client, *args: Any, **kwargs: Any) -> asyncio.Task[int]:
    """A pull begun, its request published."""
    task = asyncio.ensure_future(pull(client, *args, **kwargs))
    for _ in range(5):
        await asyncio.sleep(0)
    assert client.published, "no request published"
    return task


def test_the_request_asked_for() -> None:
    """A request for what is there now says C{no_wait}; a waiting one its expiry, in ns."""

    async def scenario() -> None:
        now = Client()
        task = await started(now, "S", "c1", 3, None, lambda m: None)
        await now.deliver(status("404", "No Messages"))
        assert await task == 0
        waiting = Client()
        task = await started(waiting, "S", "c1", 1, 2.5, lambda m: None)
        await waiting.deliver(status("408", "Request Timeout"))
        assert await task == 0
        (subject, body, reply), (_, body2, _) = now.published[0], waiting.published[0]
        assert subject == pull_subject("S", "c1") == "$JS.API.CONSUMER.MSG.NEXT.S.c1"
        assert reply == now.inbox
        assert json.loads(body) == {"batch": 3, "no_wait": True}
        assert json.loads(body2) == {"batch": 1, "expires": 2_500_000_000}

    run(scenario)


def test_jobs_are_handed_on_as_they_come() -> None:
    """
    Each job goes to C{arrived} in the subscription's callback, before
    the request ends; a heartbeat is skipped; the batch filled ends it.
    """

    async def scenario() -> None:
        client = Client()
        seen: list[Message] = []
        task = await started(client, "S", "c1", 2, None, seen.append)
        first, second = Message(b"one"), Message(b"two")
        await client.deliver(first)
        assert seen == [first] and not task.done()
        await client.deliver(status("100", "Idle Heartbeat"))
        await client.deliver(second)
        assert await task == 2
        assert seen == [first, second]
        assert client.subscription.ended == 1

    run(scenario)


@pytest.mark.parametrize("code", ["404", "408"])
def test_the_end_statuses(code: str) -> None:
    """404 (nothing now) and 408 (expired, or fewer than asked for) end a request normally."""

    async def scenario() -> None:
        client = Client()
        seen: list[Message] = []
        task = await started(client, "S", "c1", 3, None, seen.append)
        await client.deliver(Message(b"one"))
        await client.deliver(status(code))
        assert await task == 1
        assert len(seen) == 1

    run(scenario)


def test_an_error_status_raises() -> None:
    """Any other status ends the request with L{PullRefused}, its code and description."""

    async def scenario() -> None:
        client = Client()
        task = await started(client, "S", "c1", 1, 5.0, lambda m: None)
        await client.deliver(status("409", "Consumer Deleted"))
        with pytest.raises(PullRefused) as refused:
            await task
        assert (refused.value.status, refused.value.description) == ("409", "Consumer Deleted")
        assert client.subscription.ended == 1

    run(scenario)


def test_a_request_never_ended_gives_up_after_its_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no end from nats-server (a lost connection), the pull returns what came."""
    monkeypatch.setattr(pull_module, "EXPIRY_GRACE", 0.05)

    async def scenario() -> None:
        client = Client()
        task = await started(client, "S", "c1", 1, 0.05, lambda m: None)
        assert await task == 0
        assert client.subscription.ended == 1

    run(scenario)


def test_a_spent_subscription_is_left_to_the_caller() -> None:
    """
    With C{spent}, a request nats-server ended leaves its subscription
    there (its UNSUB need not go before the jobs), for L{unsubscribe}.
    """

    async def scenario() -> None:
        client = Client()
        spent: list[Any] = []
        task = await started(client, "S", "c1", 1, 1.0, lambda m: None, spent=spent)
        await client.deliver(Message(b"job"))
        assert await task == 1
        assert spent == [client.subscription] and client.subscription.ended == 0
        await unsubscribe(spent)
        assert spent == [] and client.subscription.ended == 1

    run(scenario)


def test_stopping_ends_the_request_and_gives_back_a_late_job() -> None:
    """
    C{stopping} ends a waiting request at once (its subscription too,
    spent or not); a job nats-server sent it meanwhile is given back (NAK)
    rather than left to the consumer's acknowledgement wait.
    """

    async def scenario() -> None:
        client = Client()
        stopping: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        seen: list[Message] = []
        spent: list[Any] = []
        task = await started(
            client, "S", "c1", 1, 30.0, seen.append, stopping=stopping, spent=spent
        )
        stopping.set_result(None)
        assert await task == 0
        assert spent == [] and client.subscription.ended == 1
        late = Message(b"late job")
        await client.deliver(late)
        assert seen == [] and late.nakked == 1
        await client.deliver(status("408"))  # ignored: the request is over here

    run(scenario)


def test_arguments_refused() -> None:
    """A waiting request is for one message; a batch is at least one."""

    async def scenario() -> None:
        with pytest.raises(ValueError):
            await pull(Client(), "S", "c1", 2, 1.0, lambda m: None)
        with pytest.raises(ValueError):
            await pull(Client(), "S", "c1", 0, None, lambda m: None)

    run(scenario)


def test_status_of() -> None:
    """A status message's code and description; a job message has none."""
    assert status_of(status("408", "Request Timeout")) == ("408", "Request Timeout")
    assert status_of(Message(b"job", {"Nats-Msg-Id": "j1"})) is None
    assert status_of(Message(b"job")) is None
