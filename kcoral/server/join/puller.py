# -*- test-case-name: tests.unit.test_join -*-
"""
The node's seat loop: one job per free seat, claimed before it runs.

L{JobPuller} asks the queue (L{kcoral.server.join.queue.IJobQueue}) for
as many jobs as the node has free seats, one long poll at a time.  Free
seats are the pool's: seats that would take a program now (idle, with a
worker up, owed to no queued request), less the jobs this node holds
that have not reached the seat line yet (being claimed, or fetching
their blobs).  A seat that a direct request takes, or whose worker is
being replaced, is not free; the pool says when one frees
(L{kcoral.server.workers.line.WaitingLine.offered}) and the loop
pulls again.  Each job it gets:

  1. a malformed message is dropped (C{term});
  2. a job past its deadline is acknowledged and skipped (the gateway has
     answered its client 503 by then);
  3. a job that prefers another node, inside its preference window, is
     given back for a moment (C{nak} with a short delay), so the preferred
     node can pull it while the window lasts;
  4. otherwise the node creates the job's claim: only the first claim
     wins, so a job runs at most once, and a job the gateway cancelled
     (its C{{"cancelled": true}} claim came first) never runs;
  5. while the claim is on its way, the job goes into the node's pipeline
     (parsed, checked, its request events begun) up to the pool's seat
     line, where it waits for the claim: won, it takes its seat and runs;
     lost, it ends there (C{claim_lost}) and nothing is sent back;
  6. the message is acknowledged once the claim is decided, after the job
     has gone on (it never waits for the acknowledgement); a claim whose
     outcome is unknown gives the message back.  On a node that held
     no other job, the next pull, too, waits for the claim's answer, so
     that it and its reply do not take the loop's turns in front of that
     answer.

Steps 1 to 4 are first taken on the queue's own loop as each message
arrives (L{JobPuller.screen}, the queue's C{screen}): a job that passes
1 to 3 is claimed there and then, and reaches the reactor with its claim
in flight, so the claim's round trip to nats-server overlaps the
pipeline's own work instead of preceding it.  A job claimed so is run even
when its seat has gone meanwhile (to a direct request): it waits in the
pool's line, since no other node may run it now.  A message the screen
passed over goes through the steps here.

When the queue fails (NATS lost), the loop waits with a doubling backoff
and tries again; jobs already running carry on and post their results
over HTTP.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from kcoral.gateway.jobs import JobMessage, SchemaError
from kcoral.server.join.queue import Delivery, IJobQueue

__all__ = ["JobPuller"]


@attrs.define(eq=False)
class JobPuller:
    """
    Pulls, claims and starts jobs for the pool's free seats.

    @ivar seats: the node's seats (for its logs; what it pulls for is
        C{pool_free}).
    @ivar pool_free: the pool's seats that would take a program now.
    @ivar run_job: runs a job to its posted result, calling its second
        argument once the job is in the seat line, and asking its third
        (a Deferred of whether this node won the job's claim) before the
        job takes a seat and before anything is sent back; its Deferred
        must not fail (the runner logs its own errors).
    @ivar on_change: called when the free seat count changes (the presence
        announcer refreshes the node's key).
    @ivar poll_timeout: seconds one fetch waits for a job.
    @ivar backoff: seconds before the first retry after a failed fetch,
        doubled up to C{max_backoff}.
    """

    queue: IJobQueue
    _clock: IReactorTime
    node_id: str
    seats: int
    pool_free: Callable[[], int]
    run_job: Callable[
        [JobMessage, Callable[[], None], Callable[[], Deferred[bool]]], Deferred[None]
    ]
    on_change: Callable[[], None] = lambda: None
    poll_timeout: float = 1.0
    backoff: float = 0.5
    max_backoff: float = 10.0
    #: Prepares the queue again after a failure (consumers created again).
    reprepare: Callable[[], Deferred[None]] | None = None

    #: Seats taken by jobs being claimed or run, by job id (or a
    #: placeholder while the message is being read).
    _held: dict[object, Deferred[None]] = attrs.field(factory=dict)
    #: Of C{_held}, the jobs not in the pool's seat line yet.
    _unseated: set[object] = attrs.field(factory=set)
    _fetching: bool = False
    _stopped: bool = True
    _retry: IDelayedCall | None = None
    _preparing: bool = False
    _delay: float = 0.0
    _failing: bool = False
    #: Set by L{screen} (the queue's thread) before it reads C{_stopped}:
    #: the fetch in flight may bring claimed jobs, which L{stop} waits for.
    #: Cleared here once that fetch has come back.
    _screened: bool = False
    #: The jobs the fetch in flight handed on as they came
    #: (L{_take_claimed}): their claims, by their keys in C{_held}.
    _early: dict[object, Deferred[bool]] = attrs.field(factory=dict)
    #: Fired when the fetch in flight comes back (L{stop} waits on them).
    _fetch_waiters: list[Deferred[None]] = attrs.field(factory=list)
    #: Jobs run, claims lost, skipped (deadline, malformed), handed back.
    counts: dict[str, int] = attrs.field(
        factory=lambda: {"run": 0, "lost": 0, "late": 0, "malformed": 0, "deferred": 0}
    )

    log = Logger()

    @property
    def busy(self) -> int:
        """Seats held by jobs (being claimed or running)."""
        return len(self._held)

    @property
    def free(self) -> int:
        """The pool's free seats less the jobs held that have none yet."""
        return max(0, self.pool_free() - len(self._unseated))

    def seat_freed(self) -> None:
        """A pool seat became free: pull for it (and say so)."""
        self.on_change()
        self._pump()

    def start(self) -> None:
        """Start pulling."""
        self._stopped = False
        self._delay = self.backoff
        self._pump()

    def stop(self) -> Deferred[Any]:
        """
        Stop pulling; fires when every job this node holds has ended,
        those the fetch in flight claimed as they arrived included.
        """
        # Set before reading _screened, as screen sets _screened before
        # reading _stopped: either it sees the stop and claims nothing, or
        # the stop sees that it may have claimed.
        self._stopped = True
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        self._retry = None
        if not (self._fetching and self._screened):
            return self._held_ended()
        back: Deferred[None] = Deferred()
        self._fetch_waiters.append(back)
        return back.addCallback(lambda _: self._held_ended())

    def _held_ended(self) -> Deferred[Any]:
        return DeferredList(list(self._held.values()), consumeErrors=True)

    def screen(self, data: bytes) -> JobMessage | None:
        """
        On the queue's thread, as a message arrives: the job to claim at
        once (steps 1 to 3 above passed), or C{None} (malformed, late,
        preferred elsewhere, or the node is stopping: handled here).
        Reads only what does not change under it (the node id, the clock).
        """
        self._screened = True
        if self._stopped:
            return None
        try:
            job = JobMessage.decode(data)
        except SchemaError:
            return None
        now = self._clock.seconds()
        if now >= job.deadline or job.preferred_elsewhere(self.node_id, now):
            return None
        return job

    def kick(self) -> None:
        """Pull now if a seat is free and no pull is waiting (NATS is back)."""
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
            self._retry = None
        self._pump()

    # -- the loop -------------------------------------------------------------

    def _pump(self) -> None:
        if (
            self._stopped
            or self._fetching
            or self._preparing
            or self._retry is not None
            or self.free == 0
        ):
            return
        self._fetching = True
        d = self.queue.fetch(self.free, self.poll_timeout, self.screen, self._take_claimed)
        d.addCallbacks(self._fetched, self._fetch_failed)
        d.addErrback(self._bug)
        d.addBoth(self._fetch_back)

    def _fetch_back(self, _: object) -> None:
        waiters, self._fetch_waiters = self._fetch_waiters, []
        for waiter in waiters:
            waiter.callback(None)

    def _take_claimed(self, delivery: Delivery) -> None:
        """A job claimed as it arrived, handed on before its fetch is back."""
        if delivery.claim is None:
            raise ValueError("only a claimed job is handed on as it arrives")
        self._early[self._take(delivery)] = delivery.claim

    def _fetched(self, deliveries: list[Delivery]) -> None:
        self._fetching = False
        self._screened = False
        early, self._early = self._early, {}
        if self._failing:
            self._failing = False
            self.log.info(
                "pulling jobs again",
                kcoral_event="join_pulling",
                node=self.node_id,
            )
        self._delay = self.backoff
        # Jobs held before this fetch's (those it handed on already aside).
        held = len(self._held.keys() - early.keys())
        # A claim decided while the fetch was out could not pull again then
        # (L{_claimed}): only one still in flight does so later.
        claiming = any(not claim.called for claim in early.values())
        for delivery in deliveries:
            if delivery.claim is None and (self._stopped or self.free == 0):
                # Not ours to run: straight back to the queue for another node.
                self._give_back(delivery)
                continue
            claiming = claiming or delivery.claim is not None
            self._take(delivery)
        if not claiming or held:
            self._pump()
        # Else, on a node that ran nothing else, the next pull waits for a
        # claim's answer (L{_claimed}): sent now, it and its reply would
        # take the loop turns that the answer needs, in front of the job it
        # decides.  A busy node pulls at once, to keep its seats fed.

    def _fetch_failed(self, failure: Failure) -> None:
        self._fetching = False
        self._screened = False
        if self._stopped:
            return
        delay = self._delay
        self._delay = min(self._delay * 2, self.max_backoff)
        log = self.log.info if self._failing else self.log.warn
        self._failing = True
        log(
            "cannot pull jobs ({error}); {running} running job(s) still post their "
            "results over HTTP; retrying in {delay} s",
            kcoral_event="join_pull_failed",
            node=self.node_id,
            error=_describe(failure),
            running=self.busy,
            delay=delay,
        )
        self._retry = self._clock.callLater(delay, self._retried)

    def _retried(self) -> None:
        self._retry = None
        if self.reprepare is None:
            self._pump()
            return
        # Prepare the queue again first: a restarted nats-server or a
        # recreated stream may have lost the consumers.
        self._preparing = True
        d = self.reprepare()

        def prepared(result: object) -> None:
            self._preparing = False
            if isinstance(result, Failure):
                self._fetch_failed(result)
            else:
                self._pump()

        d.addBoth(prepared)
        d.addErrback(self._bug)

    def _give_back(self, delivery: Delivery) -> None:
        d = delivery.nak(0.0)
        d.addErrback(self._ack_failed, "nak")

    def _take(self, delivery: Delivery) -> object:
        """Hold a seat for C{delivery} and handle it; the key it is held under."""
        key = object()
        done: Deferred[None] = Deferred()
        self._held[key] = done
        self._unseated.add(key)
        self.on_change()
        d = Deferred.fromCoroutine(self._handle(delivery, lambda: self._seated(key)))
        d.addErrback(self._bug)

        def release(_: object) -> None:
            del self._held[key]
            self._unseated.discard(key)
            done.callback(None)
            self.on_change()
            self._pump()

        d.addBoth(release)
        return key

    def _seated(self, key: object) -> None:
        # The pool's own count has the job from here on (a taken seat, or
        # one more request in its line).
        self._unseated.discard(key)

    async def _handle(self, delivery: Delivery, seated: Callable[[], None]) -> None:
        if delivery.claim is not None and delivery.job is not None:
            # Claimed as it arrived (steps 1 to 3 passed on the queue's thread).
            await self._claimed(delivery, delivery.job, delivery.claim, seated)
            return
        try:
            job = JobMessage.decode(delivery.data)
        except SchemaError as e:
            self.counts["malformed"] += 1
            self.log.warn(
                "dropping a malformed job message: {error}",
                kcoral_event="join_job_malformed",
                error=str(e),
            )
            await self._settle(delivery.term(), "term")
            return
        if delivery.claim is not None:
            await self._claimed(delivery, job, delivery.claim, seated)
            return
        now = self._clock.seconds()
        if now >= job.deadline:
            self.counts["late"] += 1
            self.log.info(
                "job {job} is past its deadline; skipped",
                kcoral_event="join_job_late",
                job=job.job,
                request_id=job.request_id,
            )
            await self._settle(delivery.ack(), "ack")
            return
        if job.preferred_elsewhere(self.node_id, now):
            # Back to the queue for a moment, not the whole window: the
            # queue hands it to whichever node pulls next, so the preferred
            # one gets its chances while the window lasts.
            self.counts["deferred"] += 1
            await self._settle(delivery.nak(job.defer_seconds(now)), "nak")
            return
        await self._claimed(delivery, job, self.queue.claim(job.job), seated)

    async def _claimed(
        self,
        delivery: Delivery,
        job: JobMessage,
        claim: Deferred[bool],
        seated: Callable[[], None],
    ) -> None:
        """
        Start C{job} now, gated on C{claim}: it runs only if the claim wins
        it; its message is acknowledged once the claim is decided, and
        given back when that is unknown.
        """
        decision = _Decision()
        running = self.run_job(job, seated, decision.wait)
        try:
            won = await claim
        except Exception as e:
            # Unknown whether the claim landed: leave the message to be
            # delivered again; the claim decides then.
            self.log.warn(
                "job {job}: claim failed ({error}); leaving it to the queue",
                kcoral_event="join_claim_failed",
                job=job.job,
                error=repr(e),
            )
            decision.decide(False)
            self._pump()
            await running
            await self._settle(delivery.nak(0.0), "nak")
            return
        # The job goes on (to its worker, when a seat is free) before
        # anything else here: the line below, the acknowledgement (it only
        # takes the message off the queue; the claim decided who runs the
        # job) and the next pull all come after it.
        decision.decide(won)
        if won:
            self.counts["run"] += 1
            self.log.info(
                "job {job} claimed by {node}",
                kcoral_event="join_job_claimed",
                job=job.job,
                request_id=job.request_id,
                node=self.node_id,
            )
        else:
            self.counts["lost"] += 1
            self.log.info(
                "job {job}: claimed elsewhere or cancelled; skipped",
                kcoral_event="join_claim_lost",
                job=job.job,
                request_id=job.request_id,
            )
        acked = Deferred.fromCoroutine(self._settle(delivery.ack(), "ack"))
        self._pump()
        await running
        await acked

    async def _settle(self, d: Deferred[None], what: str) -> None:
        try:
            await d
        except Exception as e:
            self._ack_failed(Failure(e), what)

    def _ack_failed(self, failure: Failure, what: str) -> None:
        # Redelivered later, the claim keeps it from running twice.
        self.log.warn(
            "{what} of a job message failed: {error}",
            kcoral_event="join_ack_failed",
            what=what,
            error=failure.getErrorMessage(),
        )

    def _bug(self, failure: Failure) -> None:
        self.log.failure("job puller error", failure)


@attrs.define(eq=False)
class _Decision:
    """Whether this node won a job's claim, for each who asks, once known."""

    won: bool | None = None
    _waiting: list[Deferred[bool]] = attrs.field(factory=list)

    def wait(self) -> Deferred[bool]:
        """Fires with the decision (at once when it is known)."""
        if self.won is not None:
            return succeed(self.won)
        d: Deferred[bool] = Deferred()
        self._waiting.append(d)
        return d

    def decide(self, won: bool) -> None:
        self.won = won
        waiting, self._waiting = self._waiting, []
        for d in waiting:
            d.callback(won)


def _describe(failure: Failure) -> str:
    """A failure as a short text, its type included (a bare TimeoutError has no message)."""
    return f"{failure.type.__name__}: {failure.getErrorMessage()}"  # type: ignore[union-attr]
