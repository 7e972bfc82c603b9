# -*- test-case-name: tests.unit.test_pool -*-
"""
The worker pool: seats, replacement and status.

A seat (C{cpu/w0}, C{gpu0/w3}) keeps its name while the processes occupying
it come and go; each process has a generation.  A request takes an idle seat
(least-loaded GPU first, most recently returned seat within it) or waits in
line; when it is done the seat is either offered again at once (reuse) or
its worker is retired and the seat comes back only once a replacement is
ready, so no request ever waits for a process start it did not cause.

Its parts live beside it: the waiting line (L{kcoral.server.workers.line}),
the warm spares (L{kcoral.server.workers.spares}), how a worker process is
made, templates included (L{kcoral.server.workers.maker}), and a seat and
one request's hold on it (L{kcoral.server.workers.seat}).
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import attrs
from twisted.internet.defer import CancelledError, Deferred, DeferredList, fail, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from kcoral.config import ServerConfig
from kcoral.server.leases.lease import Leases
from kcoral.server.sandbox.interface import ISandbox
from kcoral.server.workers.backoff import Backoff
from kcoral.server.workers.job import WorkerHandle
from kcoral.server.workers.line import STOPPING_MESSAGE, PoolBusy, PoolStopping, WaitingLine
from kcoral.server.workers.maker import WorkerMaker, remove_trees, safe_name
from kcoral.server.workers.reactor import RunBlocking, WorkerReactor
from kcoral.server.workers.seat import (
    BudgetSpent,
    Seat,
    SeatHold,
    SeatUse,
    WorkerStartFailed,
    hold_seat,
)
from kcoral.server.workers.spares import Spare, WarmSpares
from kcoral.server.workers.template import WorkerTemplates


@attrs.define(eq=False)
class WorkerPool:
    """
    Seats and their worker processes.

    @ivar spawn_worker: how a process is started (replaced in tests).
    """

    config: ServerConfig
    _reactor: WorkerReactor
    leases: Leases
    #: Replaced by the probed sandbox when the server starts.
    sandbox: ISandbox
    _run_blocking: RunBlocking
    root_dir: Path
    #: This process's index among the server's front ends
    #: (L{kcoral.server.topology}): its seats and spares are every N-th from it.
    front_end: int = 0
    seats: list[Seat] = attrs.field(factory=list)
    _idle: list[Seat] = attrs.field(factory=list)
    #: Requests waiting for a seat (L{WaitingLine}), at most
    #: C{--max-queued-requests} of them.
    line: WaitingLine[Seat] = attrs.field(
        default=attrs.Factory(
            lambda self: WaitingLine(self._reactor, self.config.max_queued_requests),
            takes_self=True,
        )
    )
    _assigned: dict[int | None, int] = attrs.field(factory=dict)
    _replacing: set[Seat] = attrs.field(factory=set)
    _pending: set[Deferred[Any]] = attrs.field(factory=set)
    closing: bool = False
    #: The first wait after a failed replacement; it doubles with each
    #: failure in a row, up to L{respawn_backoff_max}.
    respawn_backoff_initial: float = 0.5
    respawn_backoff_max: float = 60.0
    active: int = 0
    target: dict[str, str] = attrs.field(factory=dict)
    versions: dict[str, str] = attrs.field(factory=dict)
    #: How worker processes are made (L{WorkerMaker}): the settings every
    #: worker gets, the worker templates, the one-request multi-GPU workers.
    maker: WorkerMaker = attrs.field(
        default=attrs.Factory(
            lambda self: WorkerMaker(
                self.config,
                self._reactor,
                self.leases,
                self,
                self._run_blocking,
                self.serving_one,
                backoff=self.backoff,
            ),
            takes_self=True,
        )
    )
    #: Warm spares, starting or ready, of every GPU (L{WarmSpares}).
    warm: WarmSpares = attrs.field(
        default=attrs.Factory(lambda self: self._warm_spares(), takes_self=True)
    )
    #: Retired workers not gone yet (their teardown or exit in progress).
    _retiring: set[WorkerHandle] = attrs.field(factory=set)

    log = Logger()

    def _warm_spares(self) -> WarmSpares:
        return WarmSpares(
            self._reactor,
            self.config.spares_of(self.front_end),
            lambda name: self.root_dir / safe_name(name),
            lambda directory: self._run_blocking(self.sandbox.prepare_seat, directory),
            lambda name, gpus, work_dir: self.maker.spawn(name, 0, gpus, work_dir),
            lambda paths: self._run_blocking(remove_trees, paths),
            backoff=self.backoff,
            front_ends=self.config.front_ends,
            front_end_index=self.front_end,
        )

    @property
    def backoff(self) -> Backoff:
        """The wait before the next try after replacements fail in a row."""
        return Backoff(self.respawn_backoff_initial, self.respawn_backoff_max)

    @property
    def spares(self) -> list[Spare]:
        """The warm spares, starting or ready, of every GPU."""
        return self.warm.spares

    def __attrs_post_init__(self) -> None:
        # This process's seats (with several front ends, every N-th).
        self.seats = [Seat(name, gpu) for name, gpu in self.config.seats(self.front_end)]
        for seat in self.seats:
            self._assigned.setdefault(seat.gpu_id, 0)

    # -- start and stop -----------------------------------------------------

    async def start(self) -> None:
        """Start every seat's worker; fail if any cannot start or targets differ."""
        if self.config.worker_start == "fork":
            await self.maker.templates.start(seat.gpu_id for seat in self.seats)
        results = await DeferredList(
            [Deferred.fromCoroutine(self._start_seat(seat, "startup")) for seat in self.seats],
            consumeErrors=True,
        )
        failures = [result for ok, result in results if not ok]
        if failures:
            failures[0].raiseException()  # type: ignore[attr-defined]
        by_target: dict[str, list[int | None]] = {}
        for seat in self.seats:
            assert seat.worker is not None
            arch = seat.worker.info.get("target", {}).get("arch", "")
            by_target.setdefault(arch, []).append(seat.gpu_id)
        if len(by_target) > 1:
            described = "; ".join(
                f"GPU(s) {sorted(set(g for g in gpus if g is not None))} are {arch}"
                for arch, gpus in by_target.items()
            )
            raise RuntimeError(f"a pool serves one target, but {described}")
        first = self.seats[0].worker
        assert first is not None
        self.target = dict(first.info.get("target", {}))
        self.versions = dict(first.info.get("versions", {}))
        for seat in self.seats:
            seat.status = "idle"
        self._idle = list(reversed(self.seats))
        for gpu in self._groups():
            self.warm.fill(gpu)

    @property
    def templates(self) -> WorkerTemplates:
        """The worker templates by GPU id (C{None}: the CPU template)."""
        return self.maker.templates

    @property
    def worker_start(self) -> str:
        """How new workers are made now (L{WorkerTemplates.worker_start})."""
        return self.maker.templates.worker_start

    async def _start_seat(self, seat: Seat, phase: str) -> None:
        seat.generation += 1
        seat.status = "starting"
        seat.seat_dir = self.root_dir / f"{safe_name(seat.worker_id)}-g{seat.generation}"
        seat.work_dir = await self._run_blocking(self.sandbox.prepare_seat, seat.seat_dir)
        worker = self.maker.spawn(seat.worker_id, seat.generation, seat.gpus, seat.work_dir)
        seat.worker = worker
        seat.served = 0
        seat.owner = None
        worker.ended.addCallback(self._worker_ended, seat, worker)
        try:
            info = await worker.ready
        except Exception as e:
            if self.closing:
                # Shutdown stopped a worker that was still starting.
                raise
            self.log.error(
                "worker {worker_id} failed to start: {error}",
                kcoral_event="worker_failed",
                worker_id=seat.worker_id,
                gpu_id=seat.gpu_id,
                generation=seat.generation,
                phase=phase,
                error=str(e),
            )
            if phase == "startup" and self.maker.fork_failed(worker, seat.gpus, e):
                # Its template is given up: this seat spawns.
                await self._start_seat(seat, phase)
                return
            raise
        self.log.info(
            "worker {worker_id} ready (generation {generation}, pid {pid})",
            kcoral_event="worker_ready",
            worker_id=seat.worker_id,
            gpu_id=seat.gpu_id,
            generation=seat.generation,
            pid=worker.pid,
            device=None if seat.gpu_id is None else str(seat.gpu_id),
            arch=info.get("target", {}).get("arch"),
            made=getattr(worker, "made", "spawn"),
            start_ms=(self._reactor.seconds() - worker.started_at) * 1000.0,
        )

    def serving_one(self) -> bool:
        """At most one seat is taken: an answering worker may watch (L{WorkerSettings})."""
        return self.active <= 1

    async def start_transient(self, seat: Seat, gpus: tuple[int, ...]) -> tuple[WorkerHandle, Path]:
        """A one-request worker that sees C{gpus}, for C{seat}'s request (L{WorkerMaker})."""
        return await self.maker.start_transient(seat.worker_id, gpus)

    def remove_transient(self, worker: WorkerHandle, work_dir: Path) -> Deferred[None]:
        """Stop a transient worker and delete its directory."""
        return self.maker.remove_transient(worker, work_dir)

    def _worker_ended(self, code: int | None, seat: Seat, worker: WorkerHandle) -> int | None:
        if seat.worker is worker and seat.status == "idle":
            # An idle worker died on its own: take it out of the idle set
            # and bring the seat back with a fresh process.
            if seat in self._idle:
                self._idle.remove(seat)
            if not self.closing:
                self._replace(seat, "crashed")
        return code

    def stop_waiters(self) -> None:
        """Refuse new work and answer every queued request with L{PoolBusy}."""
        self.closing = True
        for seat in self.seats:
            call, seat._respawn_call, seat.respawn_at = seat._respawn_call, None, None
            if call is not None and call.active():
                call.cancel()
        self.warm.close()
        self.maker.templates.close()
        self.line.close()

    def kill_now(self) -> int:
        """
        Refuse new work and SIGKILL every worker at once (a second stop
        signal): their requests end as crashed, nothing waits for a grace.
        Returns how many workers were killed.
        """
        self.stop_waiters()
        workers = [seat.worker for seat in self.seats if seat.worker is not None]
        workers += list(self.maker.transient_workers)
        workers += self.warm.workers()
        workers += list(self._retiring)
        alive = [worker for worker in workers if worker.alive]
        for worker in alive:
            worker.kill_at_once()
        return len(alive)

    async def stop(self) -> None:
        """
        Refuse new work, fail waiters, and stop every worker.

        Bounded: whatever has not ended after L{stop_guard_seconds} (a worker
        that ignores Exit and a kill alike would otherwise hold the server
        up for ever) is SIGKILLed at once (C{workers_stop_forced}).
        """
        self.stop_waiters()
        guard = self._reactor.callLater(self.stop_guard_seconds, self._force_stop)
        try:
            await self._stop_workers()
        finally:
            if guard.active():
                guard.cancel()

    @property
    def stop_guard_seconds(self) -> float:
        """How long L{stop} waits before it kills what is left: two graces and 10 s."""
        return 2 * self.config.worker_termination_grace_seconds + 10.0

    def _force_stop(self) -> None:
        killed = self.kill_now()
        # A forked worker's end is reported by its template: ending the
        # templates too counts whatever they still hold as gone.
        Deferred.fromCoroutine(self.maker.templates.stop()).addErrback(
            lambda f: self.log.failure("stopping the worker templates failed", f)
        )
        self.log.warn(
            "workers still running after {seconds} s of stopping: {killed} killed",
            kcoral_event="workers_stop_forced",
            seconds=self.stop_guard_seconds,
            killed=killed,
        )

    async def _stop_workers(self) -> None:
        ends, spare_dirs = self.warm.stop()
        pending = list(self._pending | self.warm.pending)
        if pending:
            await DeferredList(pending, consumeErrors=True)
        stops = [seat.worker.stop() for seat in self.seats if seat.worker is not None]
        await DeferredList(stops + ends, consumeErrors=True)
        self.warm.forget()
        await self.maker.templates.stop()
        dirs = [seat.seat_dir for seat in self.seats if seat.seat_dir is not None]
        dirs += spare_dirs
        await self._run_blocking(remove_trees, dirs)

    # -- one request's seat ----------------------------------------------------

    def seat(
        self, request_id: str, gpu_count: int | None = None, client: str | None = None
    ) -> AbstractAsyncContextManager[SeatUse]:
        """Hold a seat for one request, waiting in line for it (L{hold_seat})."""
        return hold_seat(self, self._reactor, self._run_blocking, request_id, gpu_count, client)

    # -- acquire and release -------------------------------------------------

    def acquire(
        self, timeout: float, client: str | None = None, *, seat_only: bool = False
    ) -> Deferred[Seat]:
        """
        Take an idle seat, or wait in line for one.

        A worker that served another client than C{client} (the request's
        client address) is replaced before the seat is handed over, unless
        the reuse scope is C{any} (L{_fit_for}), or C{seat_only} (the seat,
        not its worker, is wanted: L{hold_seat_only}).

        Fails with L{PoolBusy} after C{timeout} seconds or when the pool
        closes.  Cancelling the Deferred leaves the line.
        """
        if self.closing:
            return fail(PoolStopping())
        seat = self._take_idle(client)
        if seat is not None:
            return self._fit_for(seat, client, seat_only)
        return self.line.join(timeout, client, seat_only=seat_only)

    def _take_idle(self, client: str | None = None) -> Seat | None:
        if not self._idle:
            return None
        least = min(
            {seat.gpu_id for seat in self._idle},
            key=lambda gpu: (self._assigned[gpu], self._gpu_order(gpu)),
        )
        # On that GPU: the most recently returned seat whose worker may serve
        # this client as it is, else the most recently returned one.
        candidates = [i for i, seat in enumerate(self._idle) if seat.gpu_id == least]
        if not candidates:
            return None
        fitting = [i for i in candidates if self._may_serve(self._idle[i], client)]
        index = (fitting or candidates)[-1]
        seat = self._idle.pop(index)
        self._assigned[seat.gpu_id] += 1
        seat.status = "busy"
        self.active += 1
        return seat

    def _may_serve(self, seat: Seat, client: str | None) -> bool:
        """
        Whether C{seat}'s worker may run a program of C{client} as it is:
        it served nobody yet, the scope is C{any}, or it served only this
        client (an unknown client is never the same as another).
        """
        if seat.owner is None or self.config.reuse_scope == "any":
            return True
        return client is not None and seat.owner == client

    def _fit_for(self, seat: Seat, client: str | None, seat_only: bool = False) -> Deferred[Seat]:
        """
        C{seat}, taken for C{client}; its worker is replaced first when it
        served another client (the request waits for the start it causes),
        unless only the seat is wanted.
        """
        if seat_only:
            return succeed(seat)
        if self._may_serve(seat, client):
            seat.owner = client if client is not None else "?"
            return succeed(seat)
        return Deferred.fromCoroutine(self._renew(seat, client))

    async def _renew(self, seat: Seat, client: str | None) -> Seat:
        """Replace the worker of a taken seat for a request of another client."""
        old = seat.worker
        self.log.info(
            "worker {worker_id} retired: {reason}",
            kcoral_event="worker_retired",
            worker_id=seat.worker_id,
            gpu_id=seat.gpu_id,
            generation=seat.generation,
            pid=None if old is None else old.pid,
            reason="reuse_scope",
        )
        spare = None if self.closing else self.warm.take(seat.gpu_id)
        if spare is not None:
            # The request that caused the replacement need not wait for it.
            self._adopt(seat, spare, old, "reuse_scope", offer=False)
            seat.status = "busy"
            seat.owner = client if client is not None else "?"
            return seat
        if old is not None and old.alive:
            await old.kill()
        if seat.seat_dir is not None:
            await self._run_blocking(remove_trees, [seat.seat_dir])
        try:
            await self._start_seat(seat, "respawn")
        except Exception:
            self.release(seat, retire="crashed")
            raise PoolBusy("no worker could be started") from None
        seat.status = "busy"
        seat.owner = client if client is not None else "?"
        return seat

    def _gpu_order(self, gpu: int | None) -> int:
        gpus = list(self.config.gpus)
        return gpus.index(gpu) if gpu in gpus else 0

    def give_back(self, seat: Seat) -> None:
        """A seat taken with C{seat_only} is free: its worker is offered as it was."""
        self.active -= 1
        self._assigned[seat.gpu_id] -= 1
        self._offer(seat)

    def release(self, seat: Seat, *, retire: str | None = None, clean: bool = False) -> None:
        """
        The request is done with C{seat}.

        With C{retire} (a reason), the worker is retired and replaced in the
        background; the seat is offered again only once the replacement is
        ready.

        @param clean: the caller found the workspace clean (or emptied it)
            since the program answered, so it is not looked at again.
        """
        self.active -= 1
        self._assigned[seat.gpu_id] -= 1
        seat.served += 1
        worker = seat.worker
        if retire is None and worker is not None and worker.alive:
            # A seat in use has its workspace (L{hold_seat} checked it).
            assert seat.work_dir is not None
            if clean or self.sandbox.workspace_is_clean(seat.work_dir):
                self._offer(seat)
                return
            d = self._run_blocking(self.sandbox.clear_workspace, seat.work_dir)
            d.addCallbacks(
                lambda _: self._offer(seat),
                lambda f: self._replace(seat, "sandbox_cleanup", f),
            )
            return
        self._replace(seat, retire or "crashed")

    def _replace(self, seat: Seat, reason: str, failure: Failure | None = None) -> None:
        worker = seat.worker
        seat.status = "replacing"
        self._replacing.add(seat)
        level = self.log.info if reason == "request_limit" else self.log.warn
        if reason == "crashed":
            level = self.log.error
        level(
            "worker {worker_id} retired: {reason}",
            kcoral_event="worker_retired",
            worker_id=seat.worker_id,
            gpu_id=seat.gpu_id,
            generation=seat.generation,
            pid=None if worker is None else worker.pid,
            reason=reason,
        )
        spare = None if self.closing else self.warm.take(seat.gpu_id)
        if spare is not None:
            self._replacing.discard(seat)
            self._adopt(seat, spare, worker, reason)
            return
        d = Deferred.fromCoroutine(self._replace_worker(seat, worker, reason))
        self._pending.add(d)

        def done(result: object) -> None:
            self._pending.discard(d)
            self._replacing.discard(seat)
            if isinstance(result, Failure) and not self.closing:
                seat.respawn_failures += 1
                seat.respawn_error = result.getErrorMessage()
                delay = self.backoff.delay(seat.respawn_failures)
                self.log.error(
                    "could not replace worker {worker_id}: {error}",
                    kcoral_event="worker_replace_failed",
                    worker_id=seat.worker_id,
                    gpu_id=seat.gpu_id,
                    reason=reason,
                    error=seat.respawn_error,
                    failures=seat.respawn_failures,
                    retry_in_seconds=delay,
                )
                seat.status = "dead"
                # Back off: a replacement that cannot start (a broken
                # sandbox, no memory) must not be retried in a tight loop.
                seat.respawn_at = self._reactor.seconds() + delay
                seat._respawn_call = self._reactor.callLater(delay, self._retry_respawn, seat)
                return
            if not isinstance(result, Failure):
                seat.respawn_failures = 0
                seat.respawn_error = None
            self._offer(seat)

        d.addBoth(done)

    def _retry_respawn(self, seat: Seat) -> None:
        seat._respawn_call = None
        seat.respawn_at = None
        self._offer(seat)

    async def _replace_worker(self, seat: Seat, old: WorkerHandle | None, reason: str) -> None:
        await self._dispose(old, seat.seat_dir, reason)
        if self.closing:
            return
        await self._start_seat(seat, "respawn")

    async def _dispose(self, old: WorkerHandle | None, old_dir: Path | None, reason: str) -> None:
        """Let a retired worker go, then delete its directory."""
        if old is not None and old.alive:
            self._retiring.add(old)
            try:
                if reason == "request_limit":
                    # The worker goes by itself after answering: a GPU worker
                    # destroys its context under the maintenance lease first.
                    # One grace in all (the worker's): SIGKILL when it is spent.
                    await old.retire()
                else:
                    await old.kill()
            finally:
                self._retiring.discard(old)
        if old_dir is not None:
            await self._run_blocking(remove_trees, [old_dir])

    # -- warm spares ------------------------------------------------------------

    def _groups(self) -> list[int | None]:
        """The GPUs that keep spares (C{None}: the CPU pool), in configured order."""
        return list(dict.fromkeys(seat.gpu_id for seat in self.seats))

    def _adopt(
        self,
        seat: Seat,
        spare: Spare,
        old: WorkerHandle | None,
        reason: str,
        offer: bool = True,
    ) -> None:
        """
        Refill C{seat} with a ready spare at once (and offer it, unless a
        request holds it already: C{offer} false): the retired worker goes in
        the background (its context torn down on the lease, its directory
        removed) and a new spare starts.
        """
        assert spare.worker is not None
        old_dir = seat.seat_dir
        seat.generation += 1
        worker = spare.worker
        # The process now answers to its seat's name in logs and leases.
        worker.seat = seat.worker_id
        worker.generation = seat.generation
        seat.worker = worker
        seat.seat_dir, seat.work_dir = spare.seat_dir, spare.work_dir
        seat.served = 0
        seat.owner = None
        seat.respawn_failures = 0
        seat.respawn_error = None
        worker.ended.addCallback(self._worker_ended, seat, worker)
        now = self._reactor.seconds()
        self.log.info(
            "worker {worker_id} refilled from spare {spare_id} (pid {pid})",
            kcoral_event="spare_adopted",
            worker_id=seat.worker_id,
            gpu_id=seat.gpu_id,
            generation=seat.generation,
            pid=worker.pid,
            spare_id=spare.spare_id,
            ready_ms=(now - (spare.ready_at or now)) * 1000.0,
        )
        d = Deferred.fromCoroutine(self._dispose(old, old_dir, reason))
        self._pending.add(d)

        def done(result: object) -> None:
            self._pending.discard(d)
            if isinstance(result, Failure):
                self.log.failure(
                    "retiring worker {worker_id} failed", result, worker_id=seat.worker_id
                )

        d.addBoth(done)
        if offer:
            self._offer(seat)
        self.warm.fill(seat.gpu_id)

    def spare_status(self, now: float) -> list[dict[str, Any]]:
        """Per-spare status for /health and /status (spares take no requests)."""
        return self.warm.status(now)

    def _offer(self, seat: Seat) -> None:
        if self.closing:
            seat.status = "idle" if seat.worker is not None and seat.worker.alive else "dead"
            return
        if seat.worker is None or not seat.worker.alive:
            # A dead seat is revived before anyone gets it.
            self._replace(seat, "crashed")
            return
        seat.status = "idle"
        self._idle.append(seat)
        self.line.serve(self._serve_waiter)

    def _serve_waiter(self, client: str | None, seat_only: bool) -> Deferred[Seat] | None:
        """An idle seat for the head of the line (L{WaitingLine.serve}), if any."""
        seat = self._take_idle(client)
        return None if seat is None else self._fit_for(seat, client, seat_only)

    # -- load accounting -------------------------------------------------------

    @property
    def queue_length(self) -> int:
        return len(self.line)

    @property
    def capacity(self) -> int:
        if self.closing:
            return 0
        return len(self.seats) - len(self._replacing)

    def worker_status(self, now: float) -> list[dict[str, Any]]:
        """Per-seat status for /health and /status (L{Seat.status_row})."""
        return [seat.status_row(now) for seat in self.seats]


__all__ = [
    "BudgetSpent",
    "CancelledError",
    "STOPPING_MESSAGE",
    "PoolBusy",
    "PoolStopping",
    "Seat",
    "SeatHold",
    "SeatUse",
    "Spare",
    "WorkerHandle",
    "WorkerPool",
    "WorkerStartFailed",
]
