# -*- test-case-name: tests.unit.test_gateway_dispatch -*-
"""
The gateway's decisions about one job, from publish to answer.

A job is I{queued} once published, I{claimed} once a node's create-only
claim is seen, and I{settled} once it has its outcome:

  - a node's result, posted over HTTP: relayed to the client as it is;
  - no claim before the queue deadline, or every node that could run it
    gone while it waits: the gateway writes the C{{"cancelled": true}}
    claim; if that create wins, 503 (never run); if it loses, a node has
    claimed the job and the gateway waits for it;
  - the claiming node's presence gone (beyond the presence timeout; checked
    every L{TICK} seconds): 502 "outcome unknown, not retried";
  - the client gone: the cancel claim is written and the job forgotten;
  - publish refused (queue full, NATS down): 503 at once.

L{IJobQueue} is the seam to NATS (L{kcoral.gateway.natsqueue.NatsJobQueue};
L{kcoral.testing.gateway.FakeJobQueue} in unit tests).  Everything here
runs on the reactor thread, with time from an injected clock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import IO, Any

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import Attribute, Interface

from kcoral.gateway.jobs import Claim, JobMessage, ResultHead, job_subject
from kcoral.gateway.pool import PoolView
from kcoral.gateway.relay import ResultRelay

__all__ = [
    "Dispatcher",
    "IJobQueue",
    "Outcome",
    "PendingJob",
    "QueueRefused",
]

#: Seconds between presence and deadline checks.
TICK = 0.25

OUTCOME_UNKNOWN = "execution outcome is unknown and was not retried: the node running it is gone"
QUEUE_FULL = "gateway queue is full"
NO_NODE = "no node in the pool can run this program now"
NO_SEAT = "no node took the program before the queue deadline"
POOL_DOWN = "gateway cannot reach its job queue"


class QueueRefused(Exception):
    """Publishing a job failed: the queue is full (C{full}) or unreachable."""

    def __init__(self, message: str, *, full: bool) -> None:
        super().__init__(message)
        self.full = full


class IJobQueue(Interface):
    """The gateway's side of the NATS work queue and claims bucket."""

    connected = Attribute("Whether the NATS connection is up now.")

    def publish(subject: str, data: bytes, job: str) -> Deferred[None]:
        """
        Publish a job message (deduplicated by C{job}); fails with
        L{QueueRefused} when the stream refuses it or NATS is unreachable.
        """

    def cancel(job: str) -> Deferred[Claim | None]:
        """
        Create C{job}'s C{{"cancelled": true}} claim; C{None} when the create
        won (no node will ever run it), else the claim that was there.
        """

    def prepare(compat: str, gpus: int) -> Deferred[None]:
        """Make sure the durable consumer of C{(compat, gpus)} exists."""


@attrs.frozen
class Outcome:
    """
    How a job ended for its client: a relayed result (C{head} and the
    open C{body} file), or an error of the protocol's kinds.
    """

    head: ResultHead | None = None
    #: The body: a file read whole, or a large one relayed as it arrives.
    body: IO[bytes] | ResultRelay | None = None
    body_length: int = 0
    #: C{"busy"} (503) or C{"node_lost"} (502) when not relayed.
    error: str | None = None
    message: str = ""
    finish_reason: str = ""
    node: str | None = None
    #: Fires once the relayed body is written (or the client left): the
    #: node's result post is answered then.
    delivered: Deferred[bool] | None = None


@attrs.define(eq=False)
class PendingJob:
    """One job between publish and answer."""

    message: JobMessage
    compat: str
    gpus: int
    #: Run timeout the program asked for (clamped): bounds the wait for a
    #: claimed job's result together with L{Dispatcher.result_grace}.
    timeout_seconds: float
    #: Releases what the job holds (the pinned blobs) once it is settled.
    release: Callable[[], None] = lambda: None
    state: str = "queued"
    node: str | None = None
    published_at: float = 0.0
    claimed_at: float | None = None
    outcome: Deferred[Outcome] = attrs.field(factory=Deferred)
    #: The job's blobs by digest (bytes or sealed shared buffers), served to its node.
    blobs: Mapping[str, Any] = attrs.field(factory=dict)
    #: Blob fetches in flight: a node sending none is not declared lost meanwhile.
    transfers: int = 0

    @property
    def job(self) -> str:
        return self.message.job


@attrs.define(eq=False)
class Dispatcher:
    """
    Pending jobs by id, and the rules above.

    @ivar queue_timeout: seconds a job may wait for a claim.
    @ivar result_grace: seconds beyond its run timeout a claimed job's node
        may take to post the result (a live node that never posts).
    """

    queue: Any
    pool: PoolView
    _clock: IReactorTime
    queue_timeout: float = 300.0
    result_grace: float = 60.0
    jobs: dict[str, PendingJob] = attrs.field(factory=dict)
    #: Counts by outcome, for /status and /metrics.
    counts: dict[str, int] = attrs.field(factory=dict)
    _ticker: IDelayedCall | None = None
    _prepared: set[tuple[str, int]] = attrs.field(factory=set)

    log = Logger()

    # -- life ----------------------------------------------------------------

    def start(self) -> None:
        """Begin the periodic presence and deadline checks."""
        if self._ticker is None:
            self._ticker = self._clock.callLater(TICK, self._tick)

    def stop(self) -> None:
        """Stop checking; every waiting job is answered 503 (its gateway is going)."""
        if self._ticker is not None and self._ticker.active():
            self._ticker.cancel()
        self._ticker = None
        for pending in list(self.jobs.values()):
            if pending.state == "queued":
                self._cancel_then(pending, "gateway_stopping")
            elif pending.state == "claimed":
                self._settle(
                    pending,
                    Outcome(
                        error="node_lost",
                        message=OUTCOME_UNKNOWN,
                        finish_reason="gateway_stopping",
                        node=pending.node,
                    ),
                )

    def _tick(self) -> None:
        self._ticker = None
        try:
            self.check(self._clock.seconds())
        except Exception:
            self.log.failure("gateway check failed")
        self._ticker = self._clock.callLater(TICK, self._tick)

    # -- submit ----------------------------------------------------------------

    def submit(self, pending: PendingJob) -> Deferred[Outcome]:
        """
        Publish C{pending}; its C{outcome} fires with how the job ended.
        Cancelling that Deferred (the client left) cancels the job.
        """
        job = pending.job
        now = self._clock.seconds()
        pending.published_at = now
        outcome: Deferred[Outcome] = Deferred(lambda _: self.abandon(job))
        pending.outcome = outcome
        self.jobs[job] = pending
        subject = job_subject(pending.compat, pending.gpus)
        key = (pending.compat, pending.gpus)
        if key in self._prepared:
            published = self.queue.publish(subject, pending.message.encode(), job)
        else:
            prepared = self.queue.prepare(pending.compat, pending.gpus)

            def ready(_: object) -> Deferred[None]:
                self._prepared.add(key)
                return self.queue.publish(subject, pending.message.encode(), job)

            published = prepared.addCallback(ready)
        published.addCallbacks(
            lambda _: self._published(pending),
            lambda f: self._publish_failed(pending, f),
        )
        return outcome

    def _published(self, pending: PendingJob) -> None:
        self.log.info(
            "job {job} of request {request_id} queued for {compat}/{gpus}",
            kcoral_event="job_queued",
            job=pending.job,
            request_id=pending.message.request_id,
            compat=pending.compat,
            gpus=pending.gpus,
            prefer=pending.message.prefer,
            publish_ms=round((self._clock.seconds() - pending.published_at) * 1000.0, 3),
        )

    def _publish_failed(self, pending: PendingJob, failure: Failure) -> None:
        if self.jobs.get(pending.job) is not pending:
            return
        error = failure.value
        full = isinstance(error, QueueRefused) and error.full
        if not isinstance(error, QueueRefused):
            self.log.failure("job {job}: publish failed", failure, job=pending.job)
        # The message may have reached the stream all the same (an ack lost
        # on the way): the cancel claim keeps any node from running it.
        self._cancel_then(
            pending,
            "queue_full" if full else "queue_unavailable",
            message=QUEUE_FULL if full else POOL_DOWN,
        )

    # -- events ----------------------------------------------------------------

    def claimed(self, job: str, claim: Claim) -> None:
        """A claim for C{job} appeared in the claims bucket."""
        pending = self.jobs.get(job)
        if pending is None or claim.cancelled or pending.state != "queued":
            return
        pending.state = "claimed"
        pending.node = claim.node
        pending.claimed_at = self._clock.seconds()
        self.log.info(
            "job {job} of request {request_id} claimed by {node}",
            kcoral_event="job_claimed",
            job=job,
            request_id=pending.message.request_id,
            node=claim.node,
            queue_ms=round((pending.claimed_at - pending.published_at) * 1000.0, 3),
        )

    def result(
        self, job: str, head: ResultHead, body: IO[bytes] | ResultRelay, length: int
    ) -> Deferred[bool] | None:
        """
        A node posted C{job}'s result; the Deferred fires with whether it
        reached the client (C{None}: the job is not waiting for one).
        """
        pending = self.jobs.get(job)
        if pending is None or pending.state not in ("queued", "cancelling", "claimed"):
            return None
        if pending.state != "claimed":
            # The result overtook its claim's watch event.
            pending.node = head.node
        delivered: Deferred[bool] = Deferred()
        self._settle(
            pending,
            Outcome(
                head=head,
                body=body,
                body_length=length,
                finish_reason="relayed",
                node=head.node or pending.node,
                delivered=delivered,
            ),
        )
        return delivered

    def abandon(self, job: str) -> None:
        """The client left: cancel the job (a node that claimed it first runs it anyway)."""
        pending = self.jobs.get(job)
        if pending is None or pending.state == "settled":
            return
        was = pending.state
        pending.state = "settled"
        self._forget(pending)
        self._count("client_disconnected")
        self.log.info(
            "job {job} of request {request_id}: client left while {state}",
            kcoral_event="job_abandoned",
            job=job,
            request_id=pending.message.request_id,
            state=was,
            node=pending.node,
        )
        if was == "queued":
            d = self.queue.cancel(job)
            d.addErrback(lambda f: self.log.failure("job {job}: cancel failed", f, job=job))

    def check(self, now: float) -> None:
        """Expire silent nodes; answer the jobs whose deadline or node is gone."""
        for node in self.pool.expire(now):
            self.log.info("node {node} gone", kcoral_event="node_left", node=node)
        for pending in list(self.jobs.values()):
            if pending.state == "queued":
                if now >= pending.message.deadline:
                    self._cancel_then(pending, "queue_timeout", message=NO_SEAT)
                elif not self.pool.suspended and not self.pool.can_run(
                    pending.compat, pending.gpus, now
                ):
                    self._cancel_then(pending, "no_node", message=NO_NODE)
            elif pending.state == "claimed":
                assert pending.node is not None and pending.claimed_at is not None
                lost = not self.pool.present(pending.node, now)
                overdue = now - pending.claimed_at > pending.timeout_seconds + self.result_grace
                if (lost or overdue) and pending.transfers == 0:
                    self._settle(
                        pending,
                        Outcome(
                            error="node_lost",
                            message=OUTCOME_UNKNOWN,
                            finish_reason="node_lost" if lost else "result_overdue",
                            node=pending.node,
                        ),
                    )

    # -- settling ------------------------------------------------------------

    def _cancel_then(self, pending: PendingJob, reason: str, *, message: str = NO_SEAT) -> None:
        """
        Write the cancel claim; when it wins answer 503 (never run), when a
        node's claim is there already wait for that node instead.
        """
        if pending.state != "queued":
            return
        pending.state = "cancelling"
        d = self.queue.cancel(pending.job)

        def done(existing: Claim | None) -> None:
            if pending.state != "cancelling":
                return
            if existing is None or existing.cancelled:
                self._settle(
                    pending,
                    Outcome(error="busy", message=message, finish_reason=reason),
                )
            else:
                pending.state = "queued"
                assert existing.node is not None
                self.claimed(pending.job, existing)

        def failed(failure: Failure) -> None:
            # Without the cancel claim nothing proves the job will not run;
            # the queue is unreachable, so no node can claim it now either,
            # and its deadline keeps nodes off it later.
            self.log.failure("job {job}: cancel failed", failure, job=pending.job)
            if pending.state == "cancelling":
                self._settle(pending, Outcome(error="busy", message=message, finish_reason=reason))

        d.addCallbacks(done, failed)

    def _settle(self, pending: PendingJob, outcome: Outcome) -> None:
        pending.state = "settled"
        self._forget(pending)
        self._count(outcome.finish_reason)
        if not pending.outcome.called:
            pending.outcome.callback(outcome)

    def _forget(self, pending: PendingJob) -> None:
        if self.jobs.get(pending.job) is pending:
            del self.jobs[pending.job]
        try:
            pending.release()
        except Exception:
            self.log.failure("job {job}: release failed", job=pending.job)

    def _count(self, reason: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1

    # -- figures ---------------------------------------------------------------

    def waiting(self) -> int:
        return sum(1 for p in self.jobs.values() if p.state in ("queued", "cancelling"))

    def running(self) -> int:
        return sum(1 for p in self.jobs.values() if p.state == "claimed")
