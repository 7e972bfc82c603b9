# -*- test-case-name: tests.unit.test_pool -*-
"""
A seat and one request's hold on it.

L{Seat} is a named place for one worker process (C{cpu/w0}, C{gpu0/w3});
L{SeatUse} is one request's hold on a seat, from the line to its release:
which worker runs the request and where, whether it is the worker's last
(the pool alone counts a worker's requests), and what the run told the pool
about the worker.  L{hold_seat} is that hold as a context manager, for
L{kcoral.server.workers.pool.WorkerPool.seat}.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Protocol

import attrs
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger

from kcoral.config import ServerConfig
from kcoral.server.leases.lease import Leases, LeaseUnavailable
from kcoral.server.sandbox.interface import ISandbox
from kcoral.server.workers.job import Job, JobResult, WorkerHandle
from kcoral.server.workers.line import PoolBusy, PoolStopping
from kcoral.server.workers.reactor import Clock, RunBlocking
from kcoral.wire.render import Placement

log = Logger()


class SeatHost(Protocol):
    """What a request's hold on a seat uses of the pool."""

    config: ServerConfig
    sandbox: ISandbox
    leases: Leases

    def acquire(
        self, timeout: float, client: str | None = None, *, seat_only: bool = False
    ) -> Deferred[Seat]: ...

    def release(self, seat: Seat, *, retire: str | None = None, clean: bool = False) -> None: ...

    def give_back(self, seat: Seat) -> None: ...

    async def start_transient(
        self, seat: Seat, gpus: tuple[int, ...]
    ) -> tuple[WorkerHandle, Path]: ...

    def remove_transient(self, worker: WorkerHandle, work_dir: Path) -> Deferred[None]: ...


class WorkerStartFailed(Exception):
    """The one-request worker of a multi-GPU program did not start."""


class BudgetSpent(Exception):
    """Starting a multi-GPU program's worker used up its whole time budget."""


@attrs.define(eq=False)
class Seat:
    """A named place for one worker process."""

    worker_id: str
    gpu_id: int | None
    generation: int = 0
    worker: WorkerHandle | None = None
    work_dir: Path | None = None
    seat_dir: Path | None = None
    status: str = "starting"
    served: int = 0
    #: The client (address) whose requests the current worker has served;
    #: C{None} while it has served none (docs/security.md, "reuse scope").
    owner: str | None = None
    #: Replacements that failed in a row (reset by one that starts).
    respawn_failures: int = 0
    #: Why the last replacement failed, while C{respawn_failures} > 0.
    respawn_error: str | None = None
    #: When the next replacement is tried (reactor seconds), while backing off.
    respawn_at: float | None = None
    _respawn_call: IDelayedCall | None = None

    @property
    def gpus(self) -> tuple[int, ...]:
        return () if self.gpu_id is None else (self.gpu_id,)

    def status_row(self, now: float) -> dict[str, Any]:
        """
        This seat in /health and /status.

        C{status} is one of the protocol's worker states, C{idle} or
        C{busy}, which is all 0.1.1-era consumers accept: a seat that is
        starting, being replaced or dead cannot take a request, so it is
        C{busy}.  C{state} says which of those it is.
        """
        worker = self.worker
        return {
            "worker_id": self.worker_id,
            "gpu_id": self.gpu_id,
            "status": "idle" if self.status == "idle" else "busy",
            "state": self.status,
            "generation": self.generation,
            "pid": None if worker is None else worker.pid,
            "uptime_seconds": 0.0
            if worker is None or not worker.alive
            else round(now - worker.started_at, 3),
            "respawn_failures": self.respawn_failures,
            "respawn_error": self.respawn_error,
            "respawn_in_seconds": None
            if self.respawn_at is None
            else round(max(0.0, self.respawn_at - now), 3),
        }


@attrs.define(eq=False)
class SeatUse:
    """
    One request's hold on a seat, from L{WorkerPool.seat}: which worker runs
    it and where, and what its run told the pool about the worker.

    @ivar gpus: the GPUs the worker sees (a multi-GPU program's grant).
    @ivar multi_gpu: the worker is a one-request worker started for it.
    """

    seat: Seat
    worker: WorkerHandle
    work_dir: Path
    _pool: SeatHost
    queue_ms: float
    assigned_at: float
    gpus: tuple[int, ...]
    multi_gpu: bool = False
    startup_seconds: float = 0.0
    #: What the job's budget was once the worker had started.
    timeout_seconds: float | None = None
    result: JobResult | None = None
    #: The request was cancelled (its client left) while its program ran.
    abandoned: bool = False
    #: The worker was told this is its last program (L{Job.last}).
    last: bool = False

    @property
    def worker_id(self) -> str:
        return self.seat.worker_id

    @property
    def gpu_id(self) -> int | None:
        """The GPU the request was routed to (a multi-GPU grant's first)."""
        return self.gpus[0] if self.multi_gpu else self.seat.gpu_id

    @property
    def generation(self) -> int:
        return 0 if self.multi_gpu else self.seat.generation

    @property
    def pid(self) -> int | None:
        return self.worker.pid

    @property
    def placement(self) -> Placement:
        """Where the request ran, as the response reports it."""
        return Placement(self.seat.worker_id, self.seat.gpu_id, self.gpus)

    def _is_last(self) -> bool:
        """
        Whether this is the worker's last request: a multi-GPU program's
        worker serves one, a seat's worker C{--max-requests-per-worker}
        (0: no limit).  The pool alone counts; the worker is told
        (L{Job.last}) and retires after answering.
        """
        limit = self._pool.config.max_requests_per_worker
        return self.multi_gpu or (limit > 0 and self.seat.served + 1 >= limit)

    async def run(self, job: Job) -> JobResult:
        """
        Run C{job} on this worker, in its workspace.

        Starting a multi-GPU worker counts against the budget (§6.5).

        @raise BudgetSpent: nothing of the budget is left to run in.
        """
        sandbox = self._pool.sandbox
        timeout = job.timeout_seconds - self.startup_seconds
        if self.multi_gpu and timeout <= 0:
            raise BudgetSpent()
        job = attrs.evolve(
            job,
            workspace=sandbox.worker_path(self.work_dir),
            reserved=sandbox.reserved,
            timeout_seconds=timeout,
            last=self._is_last(),
        )
        self.last = job.last
        self.timeout_seconds = timeout
        try:
            result: JobResult = await self.worker.run(job)
        except CancelledError:
            # The client left: the program is still running in the worker,
            # which must go (retire reason C{abandoned}).
            self.abandoned = True
            raise
        self.result = result
        return result

    def retire_reason(self) -> str | None:
        """
        Why the seat's worker must go after this request, or C{None} to
        reuse it: a timeout or crash, the worker's own word (a poisoned
        context), or the per-worker request limit.
        """
        result = self.result
        if self.abandoned:
            return "abandoned"
        if result is None:
            worker = self.seat.worker
            alive = worker is not None and worker.alive and not worker.busy
            return None if alive else "crashed"
        if result.ending == "timeout":
            return "timeout"
        if result.ending == "invalid":
            return "channel_violation"
        if result.ending != "outcome":
            return "crashed"
        assert result.outcome is not None
        if result.outcome.retire:
            return result.outcome.retire
        # Told it was its last (a worker that answers otherwise goes anyway).
        return "request_limit" if self.last else None


@asynccontextmanager
async def hold_seat(
    pool: SeatHost,
    clock: Clock,
    run_blocking: RunBlocking,
    request_id: str,
    gpu_count: int | None = None,
    client: str | None = None,
) -> AsyncIterator[SeatUse]:
    """
    Hold a seat of C{pool} for one request, waiting in line for it
    (L{WorkerPool.seat}).

    With C{gpu_count}, start a one-request worker that sees the
    C{gpu_count} least busy GPUs (protocol §6.5); it takes their lease
    itself, only while its instructions use them, and is removed
    afterwards.  On exit the seat goes back to the pool, its
    worker retired when L{SeatUse.retire_reason} says so.

    @param client: the request's client address: a reused worker serves
        one client only (the reuse scope, L{WorkerPool.acquire}).
    @raise PoolBusy: no seat (or no GPUs) within the wait timeout.
    @raise WorkerStartFailed: the multi-GPU worker did not start.
    """
    seat, queue_ms, assigned = await _wait_for_seat(
        pool, clock, client if gpu_count is None else None
    )
    if gpu_count is None:
        assert seat.worker is not None and seat.work_dir is not None
        use = SeatUse(seat, seat.worker, seat.work_dir, pool, queue_ms, assigned, seat.gpus)
        try:
            yield use
        except BaseException:
            pool.release(seat, retire=use.retire_reason())
            raise
        retire = use.retire_reason()
        emptied = False
        try:
            if not await _empty_unsandboxed_workspace(pool, run_blocking, seat, use.worker, retire):
                retire = "sandbox_cleanup"
            else:
                emptied = pool.sandbox.name == "none" and seat.work_dir is not None
        finally:
            pool.release(seat, retire=retire, clean=emptied)
        return
    try:
        try:
            gpus = pool.leases.least_busy(gpu_count)
        except LeaseUnavailable:
            raise PoolBusy("server saturated", queue_ms=queue_ms) from None
        starting = clock.seconds()
        try:
            worker, work_dir = await pool.start_transient(seat, gpus)
        except Exception as e:
            raise WorkerStartFailed(str(e)) from e
        use = SeatUse(
            seat,
            worker,
            work_dir,
            pool,
            queue_ms,
            assigned,
            gpus,
            multi_gpu=True,
            startup_seconds=clock.seconds() - starting,
        )
        try:
            yield use
        finally:
            pool.remove_transient(worker, work_dir).addErrback(
                lambda f: log.failure("removing a multi-GPU worker failed", f)
            )
    finally:
        pool.release(seat)


async def _wait_for_seat(
    pool: SeatHost, clock: Clock, client: str | None, seat_only: bool = False
) -> tuple[Seat, float, float]:
    """
    A seat of C{pool}, how long the request waited for it (ms) and when it
    got it (L{WorkerPool.acquire}).

    @raise PoolBusy: (or L{PoolStopping}) none within the wait timeout,
        with how long the request waited.
    """
    queued = clock.seconds()
    try:
        seat = await pool.acquire(
            pool.config.worker_wait_timeout_seconds, client, seat_only=seat_only
        )
    except PoolBusy as e:
        queue_ms = (clock.seconds() - queued) * 1000.0
        if isinstance(e, PoolStopping):
            raise PoolStopping(queue_ms) from None
        raise PoolBusy(str(e), queue_ms=queue_ms) from None
    assigned = clock.seconds()
    return seat, (assigned - queued) * 1000.0, assigned


@attrs.frozen
class SeatHold:
    """A request's hold on a seat without its worker (L{hold_seat_only})."""

    seat: Seat
    queue_ms: float
    assigned_at: float


@asynccontextmanager
async def hold_seat_only(
    pool: SeatHost, clock: Clock, client: str | None = None
) -> AsyncIterator[SeatHold]:
    """
    Hold a seat of C{pool}, but not its worker, for one request the server
    runs itself (L{kcoral.server.workers.compileonly}), waiting in line for
    it like any other: the seats bound everything the server runs at once.
    On exit the seat goes back as it was (L{WorkerPool.give_back}).

    @param client: the request's client address (which idle seat it gets).
    @raise PoolBusy: no seat within the wait timeout.
    """
    seat, queue_ms, assigned = await _wait_for_seat(pool, clock, client, seat_only=True)
    try:
        yield SeatHold(seat, queue_ms, assigned)
    finally:
        pool.give_back(seat)


async def _empty_unsandboxed_workspace(
    pool: SeatHost,
    run_blocking: RunBlocking,
    seat: Seat,
    worker: WorkerHandle,
    retire: str | None,
) -> bool:
    """
    Without a sandbox nothing hides one request's workspace from the
    next, so empty it before the answer goes out rather than after
    (issue 17, item 5).  A retiring worker is stopped first, so nothing
    writes into the workspace once it is empty.  Returns C{False} when
    the workspace could not be emptied (the worker must then retire).
    """
    if pool.sandbox.name != "none" or seat.work_dir is None:
        return True
    if retire is not None and retire != "request_limit" and worker.alive:
        await worker.kill()
    if pool.sandbox.workspace_is_clean(seat.work_dir):
        # The program wrote nothing there: no clear, no thread.
        return True
    try:
        await run_blocking(pool.sandbox.clear_workspace, seat.work_dir)
    except Exception as e:
        log.warn(
            "could not empty the workspace of {worker_id}: {error}",
            worker_id=seat.worker_id,
            error=str(e),
        )
        return False
    return True
