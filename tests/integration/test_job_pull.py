"""
A node's pull requests (L{kcoral.server.join.pull}) and its fetch
(L{kcoral.server.join.queue.NatsJobQueue.fetch}) against the real
nats-server: each job reaches the caller as it arrives, claimed there and
its claim written before the fetch hands the job on; no request is left
open with jobs owed to it once a fetch has returned; an error status is
an error; closing the queue ends a waiting fetch.

These drive nats-py on a private asyncio loop, with a stand-in for
L{kcoral.gateway.natsbridge.NatsBridge} that runs the queue's work on that
loop (the bridge itself has its own tests).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, KeyValueConfig, RetentionPolicy, StreamConfig

from kcoral.gateway.jobs import JobMessage, consumer_name, job_subject
from kcoral.gateway.natsbridge import EAGER_TASKS, start_task, write_now
from kcoral.server.join.pull import PullRefused, pull
from kcoral.server.join.queue import NatsJobQueue
from kcoral.testing.nats import (
    CLAIMS_BUCKET,
    GATEWAY_USER,
    JOBS_STREAM,
    NODES_BUCKET,
    NatsServer,
    nats_server_binary,
)

pytestmark = pytest.mark.skipif(nats_server_binary() is None, reason="nats-server not installed")

_T = TypeVar("_T")

COMPAT = "c0ffee00c0ffee00"


@pytest.fixture(scope="module")
def server() -> Iterator[NatsServer]:
    with NatsServer(node_ids=("node-a",)) as running:
        yield running


def run(coroutine: Callable[[], Awaitable[_T]]) -> _T:
    return asyncio.run(asyncio.wait_for(coroutine(), 60))


async def connect(server: NatsServer, user: str) -> Any:
    return await server.connect(user)


async def fresh_pool(gateway: Any) -> Any:
    """The job stream and both buckets, emptied of an earlier test's jobs and claims."""
    js = gateway.jetstream()
    for stream in (JOBS_STREAM, f"KV_{CLAIMS_BUCKET}", f"KV_{NODES_BUCKET}"):
        try:
            await js.delete_stream(stream)
        except nats.js.errors.NotFoundError:
            pass
    await js.add_stream(
        StreamConfig(
            name=JOBS_STREAM, subjects=["kcoral.jobs.>"], retention=RetentionPolicy.WORK_QUEUE
        )
    )
    await js.create_key_value(KeyValueConfig(bucket=NODES_BUCKET, ttl=3))
    await js.create_key_value(KeyValueConfig(bucket=CLAIMS_BUCKET))
    return js


def job_message(deadline: float | None = None) -> JobMessage:
    return JobMessage(
        job=uuid.uuid4().hex,
        request_id="req-" + uuid.uuid4().hex[:8],
        program='{"instructions": []}',
        blobs=(),
        options={},
        deadline=deadline if deadline is not None else time.time() + 60,
        token="t" * 43,
        gateway="http://127.0.0.1:1",
    )


async def publish(js: Any, job: JobMessage) -> None:
    await js.publish(
        job_subject(COMPAT, 0), job.encode(), stream=JOBS_STREAM, headers={"Nats-Msg-Id": job.job}
    )


class LoopBridge:
    """
    The queue's bridge on the test's own loop: C{call} runs the work as a
    task of it and C{begin}'s outcome is the task itself, so what the
    queue hands on is awaited here as the reactor would get it.
    """

    def __init__(self, client: Any) -> None:
        self.client = client
        self.js = client.jetstream()
        #: What nats-py still had to write as each call's work ended.
        self.unsent: list[bytes] = []

    def call(self, work: Any, timeout: float | None = None) -> Any:
        async def run() -> Any:
            result = await work(self.client, self.js)
            self.unsent.append(b"".join(self.client._pending))
            return result

        return asyncio.ensure_future(run())

    def begin(self, work: Any) -> Any:
        return start_task(work)  # begun at once where Python can, as the bridge does

    def deliver(self, f: Callable[..., object], *args: Any) -> None:
        f(*args)


async def node_queue(server: NatsServer) -> tuple[Any, NatsJobQueue]:
    client = await connect(server, "node-a")
    queue = NatsJobQueue(LoopBridge(client), "node-a", COMPAT, 0)  # type: ignore[arg-type]
    await queue.prepare()
    return client, queue


@asynccontextmanager
async def pool_and_node(server: NatsServer) -> AsyncIterator[tuple[Any, Any, NatsJobQueue]]:
    """
    The gateway's JetStream context on a fresh pool, and node-a's client
    and prepared queue; both clients closed at the end, failed or not.
    """
    gateway = await connect(server, GATEWAY_USER)
    try:
        js = await fresh_pool(gateway)
        client, queue = await node_queue(server)
        try:
            yield js, client, queue
        finally:
            await client.close()
    finally:
        await gateway.close()


def screen_all(data: bytes) -> JobMessage | None:
    return JobMessage.decode(data)


def test_a_waiting_fetch_hands_on_a_job_as_it_arrives_with_its_claim_written(
    server: NatsServer,
) -> None:
    """
    A fetch waiting for one job returns as soon as it comes (not at the
    request's expiry), its claim already written to nats-server: nothing
    is left in nats-py's outgoing buffer when the job is handed on.
    """

    async def scenario() -> None:
        async with pool_and_node(server) as (js, client, queue):
            job = job_message()

            async def later() -> None:
                await asyncio.sleep(0.3)
                await publish(js, job)

            publishing = asyncio.ensure_future(later())
            started = time.monotonic()
            deliveries = await queue.fetch(1, 10.0, screen_all)
            elapsed = time.monotonic() - started
            unsent = queue.bridge.unsent[-1]  # type: ignore[attr-defined]
            assert CLAIMS_BUCKET.encode() not in unsent, "the claim was still in nats-py's buffer"
            await publishing
            assert 0.3 <= elapsed < 3.0
            assert [d.job.job for d in deliveries if d.job is not None] == [job.job]
            assert await deliveries[0].claim is True
            claims = await js.key_value(CLAIMS_BUCKET)
            assert json.loads((await claims.get(job.job)).value) == {"node": "node-a"}
            await deliveries[0].ack()

    run(scenario)


def test_a_claimed_job_is_taken_as_it_arrives(server: NatsServer) -> None:
    """
    With a C{take}, a job claimed as it arrives is handed to it there and
    then, its claim already written, and the fetch's own list leaves it
    out (Python 3.12 on, where a claim's publish is made at once; before,
    the job comes in the list, as without a C{take}).
    """

    async def scenario() -> None:
        async with pool_and_node(server) as (js, client, queue):
            job = job_message()
            taken: list[tuple[Any, bytes, bool]] = []
            fetching: asyncio.Future[list[Any]] | None = None

            def take(delivery: Any) -> None:
                assert fetching is not None
                taken.append((delivery, b"".join(client._pending), fetching.done()))

            async def later() -> None:
                await asyncio.sleep(0.3)
                await publish(js, job)

            publishing = asyncio.ensure_future(later())
            fetching = asyncio.ensure_future(queue.fetch(1, 10.0, screen_all, take))
            deliveries = await fetching
            await publishing
            if EAGER_TASKS:
                assert deliveries == []
                [(delivery, unsent, fetched)] = taken
                assert CLAIMS_BUCKET.encode() not in unsent, "the claim was not written yet"
                assert not fetched, "taken only once the fetch was back"
            else:
                assert taken == []
                [delivery] = deliveries
            assert delivery.job.job == job.job
            assert await delivery.claim is True
            await delivery.ack()

    run(scenario)


def test_write_now_hands_a_publish_to_the_socket(server: NatsServer) -> None:
    """
    C{write_now} writes what nats-py holds at once: nothing is left in its
    buffer, and the message arrives without the loop having turned for
    nats-py's flusher first.
    """

    async def scenario() -> None:
        sender = await connect(server, GATEWAY_USER)
        receiver = await connect(server, GATEWAY_USER)
        try:
            got: asyncio.Queue[bytes] = asyncio.Queue()

            async def seen(message: Any) -> None:
                await got.put(message.data)

            await receiver.subscribe("kcoral.test.now", cb=seen)
            await receiver.flush()
            await sender.publish("kcoral.test.now", b"one")
            assert sender.pending_data_size > 0, "nats-py wrote before its flusher ran"
            write_now(sender)
            assert sender.pending_data_size == 0
            assert sender._pending == []
            assert await asyncio.wait_for(got.get(), 5.0) == b"one"
            # The flusher, finding nothing, writes nothing twice; later
            # publishes go out as ever.
            await sender.publish("kcoral.test.now", b"two")
            await sender.flush()
            assert await asyncio.wait_for(got.get(), 5.0) == b"two"
            assert got.empty()
        finally:
            await sender.close()
            await receiver.close()

    run(scenario)


def test_a_fetch_takes_what_waits_and_leaves_no_request_open(server: NatsServer) -> None:
    """
    Asked for three with two queued, a fetch returns both without waiting
    for its timeout; a job published after it came back goes to the next
    fetch at once (no earlier request holds it, to be redelivered only
    after the consumer's ack wait).
    """

    async def scenario() -> None:
        async with pool_and_node(server) as (js, client, queue):
            subscribed = len(client._subs)
            first, second, third = job_message(), job_message(), job_message()
            await publish(js, first)
            await publish(js, second)
            started = time.monotonic()
            deliveries = await queue.fetch(3, 10.0, screen_all)
            assert time.monotonic() - started < 3.0
            assert sorted(d.job.job for d in deliveries if d.job is not None) == sorted(
                [first.job, second.job]
            )
            assert [await d.claim for d in deliveries] == [True, True]
            # One waiting fetch that returns with one job leaves nothing open either.
            await publish(js, third)
            waited = await queue.fetch(2, 10.0, screen_all)
            assert [d.job.job for d in waited if d.job is not None] == [third.job]
            late = job_message()
            await publish(js, late)
            started = time.monotonic()
            after = await queue.fetch(1, 10.0, screen_all)
            assert time.monotonic() - started < 3.0
            assert [d.job.job for d in after if d.job is not None] == [late.job]
            for delivery in [*deliveries, *waited, *after]:
                await delivery.ack()
            # Each fetch ends the last one's request subscriptions: one is left.
            await queue.fetch(1, 0.2, screen_all)
            assert len(client._subs) - subscribed == 1

    run(scenario)


def test_a_message_the_screen_passes_over_comes_unclaimed(server: NatsServer) -> None:
    """A job the screen declines (past its deadline) is handed on without a claim."""

    async def scenario() -> None:
        async with pool_and_node(server) as (js, client, queue):
            late = job_message(deadline=time.time() - 1)
            await publish(js, late)

            def screen(data: bytes) -> JobMessage | None:
                job = JobMessage.decode(data)
                return job if job.deadline > time.time() else None

            deliveries = await queue.fetch(1, 10.0, screen)
            assert len(deliveries) == 1
            assert deliveries[0].claim is None and deliveries[0].job is None
            assert JobMessage.decode(deliveries[0].data).job == late.job
            claims = await js.key_value(CLAIMS_BUCKET)
            with pytest.raises(nats.js.errors.KeyNotFoundError):
                await claims.get(late.job)
            await deliveries[0].ack()

    run(scenario)


def test_an_empty_wait_ends_at_its_expiry(server: NatsServer) -> None:
    """With nothing queued a fetch returns empty once its wait is over (nats-server's 408)."""

    async def scenario() -> None:
        async with pool_and_node(server) as (_, client, queue):
            started = time.monotonic()
            assert await queue.fetch(2, 0.4, screen_all) == []
            elapsed = time.monotonic() - started
            assert 0.35 <= elapsed < 0.4 + 0.5 + 0.4

    run(scenario)


def test_closing_ends_a_waiting_fetch(server: NatsServer) -> None:
    """L{NatsJobQueue.close} ends a fetch that waits, long before its wait is over."""

    async def scenario() -> None:
        async with pool_and_node(server) as (_, client, queue):
            fetching = queue.fetch(1, 30.0, screen_all)
            await asyncio.sleep(0.3)
            started = time.monotonic()
            queue.close()
            assert await fetching == []
            assert time.monotonic() - started < 1.0

    run(scenario)


def test_an_error_status_is_refused(server: NatsServer) -> None:
    """
    A request nats-server ends with an error status (409: past the
    consumer's limit of waiting requests) raises, and the request that
    waits is not disturbed.
    """

    async def scenario() -> None:
        gateway = await connect(server, GATEWAY_USER)
        js = await fresh_pool(gateway)
        name = "limited"
        await js.add_consumer(
            JOBS_STREAM,
            ConsumerConfig(
                durable_name=name,
                filter_subject=job_subject(COMPAT, 0),
                ack_policy=AckPolicy.EXPLICIT,
                max_waiting=1,
            ),
        )
        waited: list[Any] = []
        waiting = asyncio.ensure_future(pull(gateway, JOBS_STREAM, name, 1, 5.0, waited.append))
        await asyncio.sleep(0.3)
        arrived: list[Any] = []
        with pytest.raises(PullRefused) as refused:
            await pull(gateway, JOBS_STREAM, name, 1, 5.0, arrived.append)
        assert refused.value.status == "409"
        assert arrived == []
        job = job_message()
        await publish(js, job)
        assert await waiting == 1
        assert JobMessage.decode(waited[0].data).job == job.job
        await waited[0].ack()
        await gateway.close()

    run(scenario)


def test_the_node_pulls_its_own_consumer(server: NatsServer) -> None:
    """The pull request goes to the consumer the node prepared, on its own inbox prefix."""

    async def scenario() -> None:
        async with pool_and_node(server) as (js, client, queue):
            assert queue.consumers() == [consumer_name(COMPAT, 0)]
            job = job_message()
            await publish(js, job)
            seen: list[Any] = []
            count = await pull(client, JOBS_STREAM, consumer_name(COMPAT, 0), 1, 5.0, seen.append)
            assert count == 1
            assert JobMessage.decode(seen[0].data).job == job.job
            await seen[0].ack()

    run(scenario)
