# -*- test-case-name: tests.unit.test_spares,tests.unit.test_pool -*-
"""
Warm spares: workers started ahead, kept beside the seats of their group (a
GPU; C{None}: the CPU pool), so that a seat whose worker retires is refilled
at once instead of waiting for a process start.

L{WarmSpares} starts them, replaces one that dies while it waits, backs off
a group whose spares fail to start, and hands a ready one over
(L{WarmSpares.take}); the pool decides when a seat takes one.  Processes,
directories and the clock are the pool's, injected.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from kcoral.server.workers.backoff import Backoff
from kcoral.server.workers.job import WorkerHandle
from kcoral.server.workers.line import PoolStopping
from kcoral.server.workers.reactor import Clock


@attrs.define(eq=False)
class Spare:
    """
    A warm worker kept beside the seats of its GPU (C{None}: the CPU pool),
    started and ready (its context created under the maintenance lease),
    waiting to refill a seat whose worker retires.
    """

    spare_id: str
    gpu_id: int | None
    worker: WorkerHandle | None = None
    seat_dir: Path | None = None
    work_dir: Path | None = None
    #: C{starting} or C{ready}.
    status: str = "starting"
    ready_at: float | None = None

    @property
    def gpus(self) -> tuple[int, ...]:
        return () if self.gpu_id is None else (self.gpu_id,)


@attrs.define(eq=False)
class WarmSpares:
    """
    Up to L{wanted} warm spares per group, started, watched and handed over.

    @ivar spares: every spare, starting or ready, of every group.
    @ivar pending: spare starts in progress (the pool waits for them when it
        stops).
    """

    _clock: Clock
    #: Spares per group (C{--spares-per-group}).
    wanted: int
    #: The directory of a spare, by its name.
    _place: Callable[[str], Path]
    #: Prepares a worker's directory (in a thread): its work directory.
    _prepare: Callable[[Path], Deferred[Path]]
    #: Starts a spare's worker: its name, GPUs and work directory.
    _spawn: Callable[[str, tuple[int, ...], Path], WorkerHandle]
    #: Removes directories (in a thread).
    _remove: Callable[[list[Path]], Deferred[None]]
    #: The wait before a group's next start after its spares failed to start.
    backoff: Backoff = Backoff()
    #: With several front ends each numbers its spares apart (s1, s3, ...
    #: and s2, s4, ...), so a name is unique in the server's logs.
    front_ends: int = 1
    front_end_index: int = 0
    spares: list[Spare] = attrs.field(factory=list)
    pending: set[Deferred[None]] = attrs.field(factory=set)
    closing: bool = False
    _serial: int = 0
    #: Spare starts that failed in a row, per group, and the backoff timer.
    _failures: dict[int | None, int] = attrs.field(factory=dict)
    _retry: dict[int | None, IDelayedCall] = attrs.field(factory=dict)

    log = Logger()

    def fill(self, gpu: int | None) -> None:
        """Start spares of C{gpu} until it has as many as configured."""
        # A start that fails at once sets the retry: no tight loop then.
        while (
            not self.closing
            and gpu not in self._retry
            and sum(1 for s in self.spares if s.gpu_id == gpu) < self.wanted
        ):
            self._serial += 1
            prefix = "cpu" if gpu is None else f"gpu{gpu}"
            serial = (self._serial - 1) * self.front_ends + self.front_end_index + 1
            spare = Spare(f"{prefix}/s{serial}", gpu)
            self.spares.append(spare)
            d = Deferred.fromCoroutine(self._start(spare))
            self.pending.add(d)
            d.addBoth(self._started, d)

    def ready(self, gpu: int | None) -> Spare | None:
        """The spare of C{gpu} that has been ready longest, if any."""
        ready = [s for s in self.spares if s.gpu_id == gpu and s.status == "ready"]
        return min(ready, key=lambda s: s.ready_at or 0.0) if ready else None

    def take(self, gpu: int | None) -> Spare | None:
        """
        Hand over the spare of C{gpu} that has been ready longest, if any
        (and none while closing): it is no spare any more, and its worker
        is the taker's to watch.  Call L{fill} once it is adopted.
        """
        spare = None if self.closing else self.ready(gpu)
        if spare is not None:
            self.spares.remove(spare)
        return spare

    def workers(self) -> list[WorkerHandle]:
        """Every spare's worker, starting or ready."""
        return [spare.worker for spare in self.spares if spare.worker is not None]

    def close(self) -> None:
        """Start no more spares (the pool is closing)."""
        self.closing = True
        for call in self._retry.values():
            if call.active():
                call.cancel()
        self._retry.clear()

    def stop(self) -> tuple[list[Deferred[int | None]], list[Path]]:
        """
        Stop every spare: a ready one is asked to exit, one still starting
        cannot read that yet and is killed at once (no request runs any more,
        so no lease is needed to kill it).  Returns their ends and their
        directories, to remove once they ended (then call L{forget}).
        """
        spares = list(self.spares)
        ends: list[Deferred[int | None]] = []
        for spare in spares:
            if spare.worker is None:
                continue
            if spare.status == "ready":
                ends.append(spare.worker.stop())
            else:
                ends.append(spare.worker.ended)
                spare.worker.kill_at_once()
        return ends, [spare.seat_dir for spare in spares if spare.seat_dir is not None]

    def forget(self) -> None:
        """Drop every spare (they were stopped)."""
        self.spares = []

    def status(self, now: float) -> list[dict[str, Any]]:
        """Per-spare status for /health and /status (spares take no requests)."""
        return [
            {
                "spare_id": spare.spare_id,
                "gpu_id": spare.gpu_id,
                "state": spare.status,
                "pid": None if spare.worker is None else spare.worker.pid,
                "uptime_seconds": 0.0
                if spare.worker is None or not spare.worker.alive
                else round(now - spare.worker.started_at, 3),
            }
            for spare in self.spares
        ]

    def _started(self, result: object, d: Deferred[None]) -> None:
        self.pending.discard(d)
        if isinstance(result, Failure):
            self.log.failure("starting a spare failed", result)

    async def _start(self, spare: Spare) -> None:
        """Start one spare; on failure, back off before the group's next try."""
        spare.seat_dir = self._place(spare.spare_id)
        try:
            spare.work_dir = await self._prepare(spare.seat_dir)
            if self.closing:
                raise PoolStopping()
            worker = self._spawn(spare.spare_id, spare.gpus, spare.work_dir)
            spare.worker = worker
            worker.ended.addCallback(self._ended, spare, worker)
            info = await worker.ready
        except Exception as e:
            if spare in self.spares:
                self.spares.remove(spare)
            if spare.worker is not None and spare.worker.alive:
                await spare.worker.kill()
            await self._remove([spare.seat_dir])
            if self.closing:
                return
            failures = self._failures.get(spare.gpu_id, 0) + 1
            self._failures[spare.gpu_id] = failures
            delay = self.backoff.delay(failures)
            self.log.error(
                "spare {spare_id} failed to start: {error}",
                kcoral_event="spare_failed",
                spare_id=spare.spare_id,
                gpu_id=spare.gpu_id,
                error=str(e),
                failures=failures,
                retry_in_seconds=delay,
            )
            if spare.gpu_id not in self._retry:
                self._retry[spare.gpu_id] = self._clock.callLater(
                    delay, self._retry_group, spare.gpu_id
                )
            return
        self._failures.pop(spare.gpu_id, None)
        if spare not in self.spares:
            return
        spare.status = "ready"
        spare.ready_at = self._clock.seconds()
        self.log.info(
            "spare {spare_id} ready (pid {pid})",
            kcoral_event="spare_ready",
            spare_id=spare.spare_id,
            gpu_id=spare.gpu_id,
            pid=worker.pid,
            startup_ms=(spare.ready_at - worker.started_at) * 1000.0,
            arch=info.get("target", {}).get("arch"),
        )
        # A seat being replaced in place right now keeps its own start;
        # the spare waits for the next retirement.

    def _retry_group(self, gpu: int | None) -> None:
        self._retry.pop(gpu, None)
        self.fill(gpu)

    def _ended(self, code: int | None, spare: Spare, worker: WorkerHandle) -> int | None:
        """A ready spare died on its own: drop it and start another."""
        if spare in self.spares and spare.worker is worker and spare.status == "ready":
            if self.closing:
                # Stopped with the pool (its directory is removed then).
                return code
            self.spares.remove(spare)
            self.log.warn(
                "spare {spare_id} exited (code {code})",
                kcoral_event="spare_exited",
                spare_id=spare.spare_id,
                gpu_id=spare.gpu_id,
                pid=worker.pid,
                code=code,
            )
            if spare.seat_dir is not None:
                self._remove([spare.seat_dir]).addErrback(
                    lambda f: self.log.failure("removing a spare's directory failed", f)
                )
            self.fill(spare.gpu_id)
        return code
