# -*- test-case-name: tests.integration.test_node_join,tests.integration.test_job_pull -*-
"""
The pool's NATS side as one node sees it: its job consumers, the claims
bucket and its presence key.

L{IJobQueue} is what the puller and the presence announcer need;
L{NatsJobQueue} provides it over L{kcoral.gateway.natsbridge.NatsBridge}
(nats-py on its own asyncio loop), and L{kcoral.testing.fakes}-style fakes
provide it in unit tests.  Every method returns a Deferred that fires on
the reactor thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import attrs
from twisted.internet.defer import Deferred, fail
from zope.interface import Interface, implementer

from kcoral.gateway.jobs import (
    CLAIMS_BUCKET,
    MAX_GPUS,
    NODES_BUCKET,
    STREAM,
    Claim,
    JobMessage,
    Presence,
    SchemaError,
    consumer_name,
)

if TYPE_CHECKING:
    from kcoral.gateway.natsbridge import NatsBridge

__all__ = ["CLAIM_TIMEOUT", "Delivery", "IJobQueue", "NatsJobQueue"]

#: Seconds a claim may take (its create, and reading the claim back when
#: the create's answer was lost).
CLAIM_TIMEOUT = 15.0

#: Seconds a node with several consumers (a GPU node: one per GPU count it
#: can take) long-polls its last one in each fetch.  A pull is one
#: consumer's, so while it waits a job of another class waits too; the
#: others are asked only whether they hold anything now.
TURN_SECONDS = 0.1

#: Seconds each consumer but the last is asked in a fetch.
GLANCE_SECONDS = 0.05


def poll_waits(consumers: int, timeout: float) -> list[float]:
    """
    How long a fetch waits on each of C{consumers} consumers in turn: a
    glance at each but the last, then a long poll on the last, of
    C{timeout} when it is the only one, else at most L{TURN_SECONDS}, so a
    job for any class is seen within about a turn of the cycle.
    """
    if consumers <= 0:
        return []
    if consumers == 1:
        return [timeout]
    glance = min(timeout, GLANCE_SECONDS)
    return [glance] * (consumers - 1) + [min(timeout, TURN_SECONDS)]


@attrs.frozen
class Delivery:
    """
    One job message pulled from the queue, with its acknowledgements.

    @ivar data: the message body (a L{kcoral.gateway.jobs.JobMessage}'s JSON).
    @ivar ack: done with it: it leaves the queue.
    @ivar nak: give it back, to be delivered again after C{delay} seconds.
    @ivar term: drop it for good (a malformed message).
    @ivar claim: the outcome of the job's claim for this node, begun as the
        message arrived (L{IJobQueue.fetch}'s C{screen}): fires with whether
        this node won it, or fails when that is unknown; C{None}: not
        claimed (the puller claims it, or skips it).
    @ivar job: with C{claim}, the message as the screen decoded it (so it
        is not decoded again); C{None} without one.
    """

    data: bytes
    ack: Callable[[], Deferred[None]]
    nak: Callable[[float], Deferred[None]]
    term: Callable[[], Deferred[None]]
    claim: Deferred[bool] | None = None
    job: JobMessage | None = None


class IJobQueue(Interface):
    """A node's view of the pool's queue, claims and presence."""

    def fetch(
        count: int,
        timeout: float,
        screen: Callable[[bytes], JobMessage | None] | None = None,
        take: Callable[[Delivery], None] | None = None,
    ) -> Deferred[list[Delivery]]:
        """
        At most C{count} jobs, waiting up to about C{timeout} seconds for
        the first; an empty list when none came.

        @param screen: called with each message's body as it arrives, on
            the queue's own thread (it may read, never change, what the
            reactor holds): the decoded job to claim for this node at once,
            or C{None}.  Such a delivery reaches the reactor with its claim
            in flight (L{Delivery.claim}): the claim is made where the
            message arrived, and the node prepares the job while
            nats-server answers it.
        @param take: called on the reactor's thread with each delivery so
            claimed, as soon as its claim has been written, instead of
            being in the list the fetch fires with.  The fetch may still
            return it in its list (where a claim is written only a turn
            later: Python before 3.12).
        """

    def claim(job: str) -> Deferred[bool]:
        """
        Create job C{job}'s claim for this node (create-only): C{True} when
        this node won, C{False} when a claim (another node's, or the
        gateway's cancel) was there first.
        """

    def put_presence(presence: Presence) -> Deferred[None]:
        """Put this node's presence key."""

    def delete_presence() -> Deferred[None]:
        """Remove this node's presence key (a clean leave)."""


@implementer(IJobQueue)
@attrs.define(eq=False)
class NatsJobQueue:
    """
    L{IJobQueue} over NATS: the durable pull consumers C{jobs-<compat>-<g>}
    for every C{g} up to the node's GPU count, and the two KV buckets.

    L{prepare} creates the consumers (idempotently) and opens the buckets
    once the bridge is connected; it is called again after a failed fetch,
    so a stream recreated by the gateway is picked up.  L{fetch} makes its
    pull requests itself (L{kcoral.server.join.pull}), so each job is
    claimed and handed on as it arrives.
    """

    bridge: NatsBridge
    node_id: str
    compat: str
    gpus: int
    #: Seconds a consumer waits for an acknowledgement before redelivering
    #: (a node that died between pulling and claiming).
    ack_wait: float = 30.0
    #: The consumers this node pulls from, as L{prepare} made them.
    _consumers: list[str] = attrs.field(factory=list)
    _nodes: Any = None
    _claims: Any = None
    #: Done (on the bridge's loop) when L{close} ends the pull in flight.
    _closing: asyncio.Future[None] | None = None
    #: Subscriptions of ended pull requests, ended at the next fetch.
    _spent: list[Any] = attrs.field(factory=list)

    def prepare(self) -> Deferred[None]:
        """Create the consumers (idempotently) and open the buckets (on the loop)."""
        from kcoral.gateway.natsbridge import ensure_consumer

        gpus = min(self.gpus, MAX_GPUS)

        async def work(client: Any, js: Any) -> None:
            consumers = []
            # Jobs needing the most GPUs first: fewer nodes can take them.
            for g in range(gpus, -1, -1):
                consumers.append(await ensure_consumer(js, self.compat, g, ack_wait=self.ack_wait))
            nodes = await js.key_value(NODES_BUCKET)
            claims = await js.key_value(CLAIMS_BUCKET)
            self._consumers = consumers
            self._nodes, self._claims = nodes, claims

        return self.bridge.call(work, timeout=30.0)

    @property
    def prepared(self) -> bool:
        return bool(self._consumers) and self._claims is not None

    def consumers(self) -> list[str]:
        """The consumer names this node pulls from."""
        return [consumer_name(self.compat, g) for g in range(min(self.gpus, MAX_GPUS), -1, -1)]

    def fetch(
        self,
        count: int,
        timeout: float,
        screen: Callable[[bytes], JobMessage | None] | None = None,
        take: Callable[[Delivery], None] | None = None,
    ) -> Deferred[list[Delivery]]:
        from kcoral.gateway.natsbridge import EAGER_TASKS, bounded, write_now
        from kcoral.server.join.pull import PullRefused, pull, unsubscribe

        bridge = self.bridge
        consumers = list(self._consumers)
        # Claimed jobs go to C{take} as they come where a claim's publish is
        # written as the claim is made; else in the fetch's list.
        take_now = take if EAGER_TASKS else None

        async def work(client: Any, js: Any) -> list[Delivery]:
            if self._closing is None:
                self._closing = asyncio.get_running_loop().create_future()
            closing = self._closing
            # The last fetch's ended requests, whose subscriptions were left
            # until its jobs had gone on.
            await unsubscribe(self._spent)
            deliveries: list[Delivery] = []
            # Claimed jobs handed to C{take} as they came.
            handed = 0

            def arrived(message: Any) -> None:
                # In the pull's subscription callback, as nats-py has parsed
                # the message: claimed here and now, the job goes to the
                # reactor with its claim in flight, so the node's pipeline
                # starts on it while nats-server answers the claim
                # (L{JobPuller} runs nothing before the claim is won).
                data = bytes(message.data)
                try:
                    job = None if screen is None else screen(data)
                except Exception:
                    job = None  # the puller looks at it again on the reactor
                delivery = _delivery(bridge, message, data, None)
                if job is not None:
                    claim = bridge.begin(
                        bounded(self._claim_work(job.job)(client, js), CLAIM_TIMEOUT)
                    )
                    delivery = attrs.evolve(delivery, claim=claim, job=job)
                    # Begun at once (3.12), its publish leaves before this
                    # callback's other work (the next job, the request's end).
                    write_now(client)
                    if take_now is not None:
                        # On to the pipeline now, not once the pull has
                        # ended and the fetch come back (two turns on).
                        nonlocal handed
                        handed += 1
                        bridge.deliver(take_now, delivery)
                        return
                deliveries.append(delivery)

            async def pull_from(consumer: str, wanted: int, expires: float | None) -> None:
                await pull(
                    client,
                    STREAM,
                    consumer,
                    wanted,
                    expires,
                    arrived,
                    stopping=closing,
                    spent=self._spent,
                )

            try:
                for consumer, wait in zip(
                    consumers, poll_waits(len(consumers), timeout), strict=True
                ):
                    got = len(deliveries) + handed
                    wanted = count - got
                    if wanted <= 0 or closing.done():
                        break
                    if got or wanted > 1:
                        # What the consumer holds now, as many as wanted.
                        await pull_from(consumer, wanted, None)
                        if len(deliveries) + handed:
                            continue
                    # Nothing yet: wait for the next job (one, so that no
                    # request is left open with jobs owed to it).
                    await pull_from(consumer, 1, wait)
            except PullRefused:
                if not (deliveries or handed):
                    raise
                # Jobs that came (claimed, some) go to the reactor; the next
                # fetch meets the refusal again.
            if any(d.claim is not None for d in deliveries):
                # The claims leave before the reactor takes the jobs (on
                # Twisted's asyncio reactor it runs their pipelines in this
                # same thread).  Where a task does not begin at once, each
                # claim's first step ran ahead of the pull's return (both were
                # scheduled by the callback, the claim first): its publish is
                # pending now.
                write_now(client)
            return deliveries

        if not consumers:
            return fail(RuntimeError("job consumers not prepared"))
        # No timeout over the whole: a claim begun must reach the reactor
        # with its delivery (each pull request has its own).
        return bridge.call(work)

    def close(self) -> None:
        """End the pull in flight now (the node is leaving); jobs that came still go to the reactor."""
        closing = self._closing
        if closing is not None and not closing.done():
            loop = closing.get_loop()
            if not loop.is_closed():
                loop.call_soon_threadsafe(_set_done, closing)

    def claim(self, job: str) -> Deferred[bool]:
        return self.bridge.call(self._claim_work(job), timeout=CLAIM_TIMEOUT)

    def _claim_work(self, job: str) -> Callable[[Any, Any], Awaitable[bool]]:
        """The coroutine function of C{job}'s create-only claim for this node."""
        import nats.js.errors

        claims = self._claims
        mine = Claim(node=self.node_id)

        async def work(client: Any, js: Any) -> bool:
            if claims is None:
                raise RuntimeError("claims bucket not open")
            try:
                await claims.create(job, mine.encode())
                return True
            except nats.js.errors.KeyWrongLastSequenceError:
                return False
            except (nats.errors.TimeoutError, TimeoutError):
                # The create may have landed: read the claim back.
                entry = await claims.get(job)
                try:
                    return Claim.decode(entry.value or b"") == mine
                except SchemaError:
                    return False

        return work

    def put_presence(self, presence: Presence) -> Deferred[None]:
        nodes = self._nodes
        key = self.node_id

        async def work(client: Any, js: Any) -> None:
            if nodes is None:
                raise RuntimeError("nodes bucket not open")
            await nodes.put(key, presence.encode())

        return self.bridge.call(work, timeout=5.0)

    def delete_presence(self) -> Deferred[None]:
        nodes = self._nodes
        key = self.node_id

        async def work(client: Any, js: Any) -> None:
            if nodes is not None:
                await nodes.delete(key)

        return self.bridge.call(work, timeout=2.0)


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _delivery(
    bridge: NatsBridge, message: Any, data: bytes, claim: Deferred[bool] | None
) -> Delivery:
    """A pulled message with acknowledgements that run on the bridge's loop."""

    async def ack(client: Any, js: Any) -> None:
        await message.ack()

    async def term(client: Any, js: Any) -> None:
        await message.term()

    def nak(delay: float) -> Deferred[None]:
        async def work(client: Any, js: Any) -> None:
            await message.nak(delay=max(0.0, delay))

        return bridge.call(work, timeout=5.0)

    return Delivery(
        data=data,
        ack=lambda: bridge.call(ack, timeout=5.0),
        nak=nak,
        term=lambda: bridge.call(term, timeout=5.0),
        claim=claim,
    )
