# -*- test-case-name: tests.unit.test_gpu_monitor -*-
"""
The GPU monitor: what happened on each GPU while a worker held its lease.

The lease (L{kcoral.server.leases.lease}) keeps the server's own workers
from running on a GPU at once, but only as long as they ask for it.  The
monitor, in the reactor process and never in a worker, reads every GPU
through an L{IGpuSampler} (NVML on a GPU server) every
L{GpuMonitor.interval} seconds, in a thread, and:

  - B{enforces exclusivity for descendants}: any process holding a compute
    context on a GPU that a worker's program started (a child, a
    double-forked orphan, an exec'd binary: each stays in the worker's
    process tree or PID namespace) is killed at once, with its own
    descendants, and the worker's request fails with an error naming it
    (the worker is retired: its program broke the lease).  Only a worker's
    own process (L{main_pid}) may hold a context.
  - B{marks interference}: a process other than the holder that used the
    GPU (NVML's per-process utilization samples) while an exclusive lease
    was held is logged (C{gpu_interference}, naming the holder's worker and
    request and the offender's) and counted in C{/metrics}; a worker's
    process is excused for L{EXCUSE_SECONDS} after its own hold ended (a
    sample covers a period before its timestamp).  An interfering process
    that is not one of the server's is never killed: it is not the
    server's to kill (an operator's job, another server).  A worker's own
    process that uses the GPU outside its lease is not killed either (its
    program's thread, say, running on after its function returned): the
    results it disturbed are flagged, and the log names it.
  - B{marks throttling}: clock event reasons in L{THROTTLING} during a
    hold (C{gpu_throttled}).
  - B{judges measurements} (L{GpuMonitor.judge}): a C{benchmark}'s timed
    loop gets C{interference:} and C{throttled:} reasons in its
    C{validity}, and a summary of the samples under C{"gpu"}.
"""

from __future__ import annotations

import os
import signal
import statistics
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import attrs
from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from kcoral.measurement import DevicePeak, peak_for
from kcoral.proctree import descendants_of
from kcoral.server.leases.lease import EXCLUSIVE, HoldInterval, LeaseBook, seat_of
from kcoral.server.leases.nvml import (
    THROTTLE_MASK,
    GpuSample,
    IGpuSampler,
    ProcessUse,
    throttle_names,
)
from kcoral.server.workers.reactor import RunBlocking

__all__ = [
    "EXCUSE_SECONDS",
    "GpuMonitor",
    "GpuMonitorService",
    "ProcFs",
    "Role",
    "classify",
    "judge_samples",
    "main_pid",
]

#: A worker's process is not blamed for GPU use this long after its own
#: hold of that GPU ended: NVML's per-process sample describes a period
#: (about 1/6 s on an H200) that ends at its timestamp.
EXCUSE_SECONDS = 0.5
#: How long samples are kept (seconds): longer than any timed loop judged.
RETENTION_SECONDS = 600.0
#: At most this many samples per GPU are kept.
MAX_SAMPLES = 20_000


class ProcessTable(Protocol):
    """What the monitor reads of processes (L{ProcFs}; a dict-backed fake in tests)."""

    def parent_of(self, pid: int) -> int | None: ...

    def name_of(self, pid: int) -> str | None: ...

    def started_at(self, pid: int) -> int | None: ...

    def pid_namespace(self, pid: int) -> int | None: ...

    def descendants(self, pid: int) -> list[int]: ...


class ProcFs:
    """L{ProcessTable} from C{/proc} (C{None} for a process that is gone)."""

    @staticmethod
    def _stat(pid: int) -> list[str] | None:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                text = f.read().decode("ascii", "replace")
        except OSError:
            return None
        head, _, tail = text.rpartition(")")
        return [head.partition("(")[2], *tail.split()]

    def parent_of(self, pid: int) -> int | None:
        stat = self._stat(pid)
        return None if stat is None else int(stat[2])

    def name_of(self, pid: int) -> str | None:
        stat = self._stat(pid)
        return None if stat is None else stat[0]

    def started_at(self, pid: int) -> int | None:
        stat = self._stat(pid)
        return None if stat is None else int(stat[20])

    def pid_namespace(self, pid: int) -> int | None:
        try:
            return os.stat(f"/proc/{pid}/ns/pid").st_ino
        except OSError:
            return None

    def descendants(self, pid: int) -> list[int]:
        return descendants_of(pid) or []


class Worker(Protocol):
    """What the monitor uses of a worker (L{kcoral.server.workers.workerproc.WorkerProcess})."""

    pid: int | None
    seat: str
    alive: bool

    @property
    def request_id(self) -> str | None: ...

    def gpu_violation(self, reason: str, location: str) -> None: ...


#: The processes of a worker's sandbox that are not the worker: bubblewrap
#: (a spawned worker's pid is bubblewrap's), and a forked worker's
#: C{kcoral-sandbox} (its pid) and C{kcoral-init} (its namespace's init),
#: both older than the worker (L{kcoral.worker.template}).
SANDBOX_SHELLS = frozenset({"bwrap", "kcoral-sandbox", "kcoral-init"})


def main_pid(root: int, table: ProcessTable) -> int | None:
    """
    A worker's own process: the oldest process of the tree at C{root} that
    is not one of its sandbox's (L{SANDBOX_SHELLS}).  Everything its
    programs start is younger, whatever it is named.
    """
    best: tuple[int, int] | None = None
    for pid in [root, *table.descendants(root)]:
        if table.name_of(pid) in SANDBOX_SHELLS:
            continue
        started = table.started_at(pid)
        if started is not None and (best is None or (started, pid) < best):
            best = (started, pid)
    return None if best is None else best[1]


@attrs.frozen
class Role:
    """
    Who a process on a GPU is: C{"main"} (a worker's own process),
    C{"descendant"} (started by a worker's program, or by some other
    process of the server's: C{worker} is C{None} then) or C{"foreign"}
    (not the server's).
    """

    kind: str
    worker: Any = None


def classify(
    pid: int,
    mains: Mapping[int, Any],
    roots: Mapping[int, Any],
    table: ProcessTable,
    server_pid: int,
) -> Role:
    """
    The L{Role} of C{pid}.

    @param mains: each worker's own process (L{main_pid}) -> the worker.
    @param roots: each worker's pid (the root of its tree) -> the worker.
    @param server_pid: the reactor process (every worker descends from it).
    """
    worker = mains.get(pid)
    if worker is not None:
        return Role("main", worker)
    # Its ancestors: a worker's tree, or the server's.
    ours = False
    seen = {pid}
    parent = table.parent_of(pid)
    while parent is not None and parent > 0 and parent not in seen:
        if parent in roots:
            return Role("descendant", roots[parent])
        if parent == server_pid:
            ours = True
            break
        seen.add(parent)
        parent = table.parent_of(parent)
    # A forked worker's orphans go to its namespace's init, beside it:
    # the same PID namespace as a worker's process, not the server's.
    namespace = table.pid_namespace(pid)
    if namespace is not None and namespace != table.pid_namespace(server_pid):
        for main, candidate in mains.items():
            if table.pid_namespace(main) == namespace:
                return Role("descendant", candidate)
    return Role("descendant" if ours else "foreign")


def _window(samples: Iterable[GpuSample], start: float, stop: float) -> list[GpuSample]:
    return [s for s in samples if start <= s.taken_at <= stop]


def judge_samples(
    samples: Sequence[GpuSample],
    start: float,
    stop: float,
    own: Callable[[int], bool],
    excused: Callable[[int, int, float], bool],
    describe: Callable[[int], str] = str,
    read_slack: float = 0.0,
) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """
    The reasons (C{(code, text)}) a timed loop from C{start} to C{stop}
    cannot be trusted, and a summary of the GPU's state meanwhile.

    @param samples: the readings of the loop's GPUs, in any order; their
        per-process utilization samples that fall in C{[start, stop]} count
        (each sample is counted once).
    @param own: whether a pid is the measuring worker's own process.
    @param excused: whether a pid's use of a GPU at a moment is excused
        (C{(gpu, pid, at)}: its own hold had just ended).
    @param describe: a pid as the reason names it (its worker and request).
    @param read_slack: readings taken up to this long after C{stop} count
        for the clocks (one is taken as the loop is judged).
    """
    reasons: list[tuple[str, str]] = []
    uses: dict[tuple[int, int, float], ProcessUse] = {}
    for sample in samples:
        for use in sample.usage:
            if start <= use.at <= stop and (use.sm > 0 or use.mem > 0):
                uses[(sample.gpu, use.pid, use.at)] = use
    others: dict[tuple[int, int], list[ProcessUse]] = {}
    for (gpu, pid, at), use in sorted(uses.items()):
        if own(pid) or excused(gpu, pid, at):
            continue
        others.setdefault((gpu, pid), []).append(use)
    for (gpu, pid), seen in sorted(others.items()):
        reasons.append(
            (
                "interference",
                f"another process used GPU {gpu} during the measurement: "
                f"{describe(pid)}, in {len(seen)} utilization samples "
                f"(up to {max(u.sm for u in seen)}% SM, {max(u.mem for u in seen)}% memory)",
            )
        )
    readings = _window(samples, start, stop + read_slack)
    throttled: dict[str, int] = {}
    for reading in readings:
        for name in throttle_names(reading.throttle & THROTTLE_MASK):
            throttled[name] = throttled.get(name, 0) + 1
    if throttled:
        shown = ", ".join(
            f"{name} in {n} of {len(readings)} readings" for name, n in throttled.items()
        )
        reasons.append(("throttled", f"the GPU's clocks were throttled: {shown}"))
    summary: dict[str, Any] = {"samples": len(readings)}
    if readings:
        sm = [r.sm_clock_mhz for r in readings]
        power = [r.power_w for r in readings]
        summary.update(
            {
                "sm_clock_mhz": {
                    "min": min(sm),
                    "median": statistics.median(sm),
                    "max": max(sm),
                },
                "sm_clock_max_mhz": max(r.sm_clock_max_mhz for r in readings),
                "mem_clock_mhz": {
                    "min": min(r.mem_clock_mhz for r in readings),
                    "max": max(r.mem_clock_mhz for r in readings),
                },
                "temperature_c_max": max(r.temperature_c for r in readings),
                "power_w_mean": round(statistics.fmean(power), 1),
                "power_w_max": round(max(power), 1),
                "throttle_reasons": sorted(throttled),
            }
        )
    summary["utilization_samples"] = len(uses)
    summary["other_processes"] = sorted({pid for _, pid in others})
    return reasons, summary


def _sigkill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass  # gone already


@attrs.define(eq=False)
class GpuMonitor:
    """
    Samples every GPU of C{leases} while running (see the module docstring).

    @ivar defer: runs a blocking call off the reactor and returns a Deferred
        of its result (C{deferToThreadPool} on a server; at once in tests).
    @ivar leases: the lease whose holds are watched (its current holders
        and C{history}).
    """

    sampler: IGpuSampler
    leases: LeaseBook
    reactor: IReactorTime
    defer: RunBlocking
    interval: float = 0.2
    processes: ProcessTable = attrs.field(factory=ProcFs)
    server_pid: int = attrs.field(factory=os.getpid)
    kill: Callable[[int], None] = _sigkill
    #: Each GPU's readings, oldest first.
    timelines: dict[int, deque[GpuSample]] = attrs.field(factory=dict)
    #: Every worker seen holding a lease (by identity), until it dies.
    _workers: dict[int, Any] = attrs.field(factory=dict)
    #: A worker (by identity) -> its root pid, main pid and the main's start time.
    _mains: dict[int, tuple[int, int, int | None]] = attrs.field(factory=dict)
    #: Per GPU, the newest per-process sample read so far.
    _usage_since: dict[int, float] = attrs.field(factory=dict)
    #: Holds already reported as interfered with / throttled (once each).
    _reported: set[tuple[str, int, int, float]] = attrs.field(factory=set)
    #: Each GPU's peaks for the plausibility check (L{GpuMonitorService}
    #: sets them from the device names and NVML's memory bus).
    peaks: dict[int, DevicePeak] = attrs.field(factory=dict)
    #: The processes killed so far (pid, start time): NVML may list them
    #: until their parent reaps them.
    _killed: set[tuple[int, int]] = attrs.field(factory=set)
    _loop: LoopingCall | None = None
    _failing: bool = False
    #: L{_index} while one reading is absorbed.
    _indexed: tuple[dict[int, Any], dict[int, Any]] | None = None

    log = Logger()

    # -- running --------------------------------------------------------------

    def start(self) -> None:
        """Sample every L{interval} seconds until L{stop}."""
        if self._loop is not None or not self.leases.gpus:
            return
        self._loop = LoopingCall(self.poll)
        self._loop.clock = self.reactor
        self._loop.start(self.interval, now=True).addErrback(
            lambda f: self.log.failure("the GPU monitor stopped", f)
        )

    def stop(self) -> None:
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None

    def poll(self, gpus: Sequence[int] | None = None) -> Deferred[None]:
        """Read C{gpus} (all of the server's) once, in a thread; act on what was read."""
        wanted = tuple(self.leases.gpus if gpus is None else gpus)
        since = {gpu: self._usage_since.get(gpu, 0.0) for gpu in wanted}
        d = self.defer(self._read, wanted, since)
        return d.addCallback(self.absorb).addErrback(self._read_failed)

    def _read(self, gpus: Sequence[int], since: Mapping[int, float]) -> list[GpuSample]:
        """In a thread: one reading of each GPU."""
        return [self.sampler.sample(gpu, since[gpu]) for gpu in gpus]

    def _read_failed(self, failure: Failure) -> None:
        if not self._failing:
            self._failing = True
            self.log.failure("the GPU monitor could not read the GPUs", failure)

    def absorb(self, samples: Iterable[GpuSample]) -> None:
        """On the reactor: keep C{samples}, enforce exclusivity, report interference."""
        self._failing = False
        self._note_workers()
        self._indexed = self._index()
        try:
            self._absorb(samples)
        finally:
            self._indexed = None

    def _absorb(self, samples: Iterable[GpuSample]) -> None:
        for sample in samples:
            timeline = self.timelines.setdefault(sample.gpu, deque(maxlen=MAX_SAMPLES))
            timeline.append(sample)
            while timeline and timeline[0].taken_at < sample.taken_at - RETENTION_SECONDS:
                timeline.popleft()
            if sample.usage:
                self._usage_since[sample.gpu] = max(
                    self._usage_since.get(sample.gpu, 0.0), max(u.at for u in sample.usage)
                )
            self._enforce(sample)
            self._watch_hold(sample)

    # -- who is who -----------------------------------------------------------

    def _note_workers(self) -> None:
        """Remember every lease holder (current or in the history) that is alive."""
        found: list[Hashable] = []
        for gpu in self.leases.gpus:
            holder = self.leases.holder_of(gpu)
            if holder is not None:
                found.append(holder)
            found.extend(self.leases.maintainers_of(gpu))
            found.extend(i.holder for i in self.leases.history.get(gpu, ()))
        for worker in found:
            if getattr(worker, "pid", None) is not None:
                self._workers.setdefault(id(worker), worker)
        for key, worker in list(self._workers.items()):
            if not getattr(worker, "alive", True):
                del self._workers[key]
                self._mains.pop(id(worker), None)

    def main_of(self, worker: object) -> int | None:
        """C{worker}'s own process (L{main_pid}), remembered while it lives."""
        root = getattr(worker, "pid", None)
        if root is None:
            return None
        known = self._mains.get(id(worker))
        if known is not None and known[0] == root:
            _, cached, started = known
            if self.processes.started_at(cached) == started:
                return cached
        found = main_pid(root, self.processes)
        if found is not None:
            self._mains[id(worker)] = (root, found, self.processes.started_at(found))
        return found

    def _index(self) -> tuple[dict[int, Any], dict[int, Any]]:
        """Each known worker by its own process's pid, and by its root pid."""
        if self._indexed is not None:
            return self._indexed
        mains: dict[int, Any] = {}
        roots: dict[int, Any] = {}
        for worker in self._workers.values():
            main = self.main_of(worker)
            if main is not None:
                mains[main] = worker
            roots[worker.pid] = worker
        return mains, roots

    def _role(self, pid: int) -> Role:
        mains, roots = self._index()
        return classify(pid, mains, roots, self.processes, self.server_pid)

    def describe(self, pid: int) -> str:
        """C{pid} as a report names it: its worker and request, if it is the server's."""
        role = self._role(pid)
        name = self.processes.name_of(pid) or "?"
        if role.kind == "foreign":
            return f"process {pid} ({name}), not the server's"
        worker = role.worker
        if worker is None:
            return f"process {pid} ({name}), started by the server's processes"
        whose = "the process" if role.kind == "main" else "a process started by the program"
        request = getattr(worker, "request_id", None)
        return f"process {pid} ({name}), {whose} of worker {worker.seat}" + (
            f" running request {request}" if request else ""
        )

    # -- exclusivity for descendants -----------------------------------------

    def _enforce(self, sample: GpuSample) -> None:
        pids = set(sample.processes) | {u.pid for u in sample.usage if u.sm > 0 or u.mem > 0}
        for pid in sorted(pids):
            if pid == self.server_pid:
                continue
            role = self._role(pid)
            if role.kind != "descendant" or role.worker is None:
                # Not started by a worker's program (a process of the
                # server's own is left alone; a measurement it disturbs is
                # flagged like any other).
                continue
            started = self.processes.started_at(pid)
            if started is None or (pid, started) in self._killed:
                continue  # gone since NVML listed it, or killed already
            self._killed.add((pid, started))
            if len(self._killed) > 4096:
                self._killed.clear()
            name = self.processes.name_of(pid) or "?"
            victims = [pid, *self.processes.descendants(pid)]
            for victim in victims:
                self.kill(victim)
            worker = role.worker
            request = getattr(worker, "request_id", None)
            self.log.warn(
                "process {pid} ({name}) on GPU {gpu_id}, started by worker {worker_id}"
                " (request {request_id}), killed: only a worker's own process may use a GPU",
                kcoral_event="gpu_descendant_killed",
                pid=pid,
                name=name,
                gpu_id=sample.gpu,
                worker_id=worker.seat,
                request_id=request,
                killed=victims,
            )
            worker.gpu_violation(
                f"process {pid} ({name}), started by the program, used GPU "
                f"{sample.gpu} outside the worker's lease and was killed: only the "
                "worker's own process may create a GPU context",
                f"process {pid} ({name}), started by the program",
            )

    # -- interference and throttling during holds ---------------------------

    def excused(self, gpu: int, pid: int, at: float) -> bool:
        """
        Whether C{pid} is a worker's own process whose hold of C{gpu} (any
        mode) ended less than L{EXCUSE_SECONDS} before C{at}, or goes on.
        """
        holders = [self.leases.holder_of(gpu), *self.leases.maintainers_of(gpu)]
        for holder in holders:
            if holder is not None and self.main_of(holder) == pid:
                return True
        intervals: Iterable[HoldInterval] = self.leases.history.get(gpu, ())
        for interval in intervals:
            if interval.end >= at - EXCUSE_SECONDS and interval.start <= at:
                if self.main_of(interval.holder) == pid:
                    return True
        return False

    def _watch_hold(self, sample: GpuSample) -> None:
        """Report (once per hold) interference and throttling during the current hold."""
        holder = self.leases.holder_of(sample.gpu)
        if holder is None:
            return
        grant = self.leases.grant_of(holder)
        if grant is None or grant.mode != EXCLUSIVE:
            return
        own = self.main_of(holder)
        label = self.leases.label_of(holder)
        hold = (sample.gpu, id(holder), grant.granted_at)
        # What both reports say of the hold.
        held = {"gpu_id": sample.gpu, "worker_id": seat_of(holder), "request_id": label}
        for use in sample.usage:
            if use.at < grant.granted_at or (use.sm <= 0 and use.mem <= 0):
                continue
            if use.pid == own or self.excused(sample.gpu, use.pid, use.at):
                continue
            if ("interference", *hold) in self._reported:
                break
            self._reported.add(("interference", *hold))
            offender = self._role(use.pid)
            self.log.warn(
                "GPU {gpu_id} was used by {offender} while worker {worker_id} held it"
                " for request {request_id}",
                kcoral_event="gpu_interference",
                **held,
                offender=self.describe(use.pid),
                offender_pid=use.pid,
                offender_worker_id=None if offender.worker is None else offender.worker.seat,
                offender_request_id=None
                if offender.worker is None
                else getattr(offender.worker, "request_id", None),
            )
            break
        reasons = throttle_names(sample.throttle & THROTTLE_MASK)
        if reasons and ("throttled", *hold) not in self._reported:
            self._reported.add(("throttled", *hold))
            self.log.warn(
                "GPU {gpu_id} was throttled ({reasons}) while worker {worker_id} held it"
                " for request {request_id}",
                kcoral_event="gpu_throttled",
                **held,
                reasons=reasons,
                sm_clock_mhz=sample.sm_clock_mhz,
                temperature_c=sample.temperature_c,
                power_w=sample.power_w,
            )
        if len(self._reported) > 4096:
            self._reported.clear()

    # -- measurements ---------------------------------------------------------

    def peak_of(self, gpus: Sequence[int]) -> DevicePeak | None:
        """The peaks of a measurement's (first) GPU, when known."""
        return self.peaks.get(gpus[0]) if gpus else None

    def judge(
        self, worker: object, gpus: Sequence[int], start: float, stop: float
    ) -> Deferred[tuple[list[tuple[str, str]], dict[str, Any]]]:
        """
        The reasons a timed loop of C{worker} on C{gpus}, from C{start} to
        C{stop} (the reactor's clock), cannot be trusted, and a summary of
        the GPUs meanwhile; reads the GPUs once more first, so every
        utilization sample up to now counts.
        """
        d = self.poll(gpus)

        def judged(_: None) -> tuple[list[tuple[str, str]], dict[str, Any]]:
            own = self.main_of(worker)
            samples = [s for gpu in gpus for s in self.timelines.get(gpu, ())]
            slack = max(self.reactor.seconds() - stop, 0.0)
            return judge_samples(
                samples,
                start,
                stop,
                own=lambda pid: pid == own,
                excused=self.excused,
                describe=self.describe,
                read_slack=slack,
            )

        return d.addCallback(judged)


class GpuMonitorService(Service):
    """
    Runs a L{GpuMonitor} over C{leases}' GPUs while the server runs, once
    its sampler can read every one of them (NVML loaded, the GPUs found);
    otherwise logs C{gpu_monitor_unavailable} and measurements go unjudged.
    """

    log = Logger()

    def __init__(
        self,
        leases: LeaseBook,
        reactor: IReactorTime,
        run_blocking: RunBlocking,
        sampler: IGpuSampler | None = None,
    ) -> None:
        if sampler is None:
            from kcoral.server.leases.nvml import NvmlSampler

            sampler = NvmlSampler()
        self.leases = leases
        self.monitor = GpuMonitor(sampler, leases, reactor, run_blocking)
        self._run_blocking = run_blocking

    def startService(self) -> None:
        super().startService()
        gpus = tuple(self.leases.gpus)
        sampler = self.monitor.sampler
        d = self._run_blocking(
            lambda: [(sampler.name(gpu), sampler.memory_bandwidth(gpu)) for gpu in gpus]
        )
        d.addCallbacks(self._ready, self._unavailable)

    def _ready(self, devices: list[tuple[str, float | None]]) -> None:
        if not self.running:
            return
        names = [name for name, _ in devices]
        for gpu, (name, bandwidth) in zip(self.leases.gpus, devices, strict=True):
            peak = peak_for(name)
            if peak is None and bandwidth:
                peak = DevicePeak(name, bandwidth, {}, "NVML: memory bus width x clock")
            if peak is not None:
                self.monitor.peaks[gpu] = peak
            if peak is not None and bandwidth and abs(bandwidth / peak.bandwidth - 1) > 0.1:
                self.log.warn(
                    "GPU {gpu_id}: NVML's memory bandwidth {nvml} B/s differs from the "
                    "table's {table} B/s for {name}",
                    kcoral_event="gpu_peak_mismatch",
                    gpu_id=gpu,
                    name=name,
                    nvml=bandwidth,
                    table=peak.bandwidth,
                )
        self.leases.monitor = self.monitor
        self.monitor.start()
        self.log.info(
            "GPU monitor reading GPU(s) {gpu_ids} every {interval} s",
            kcoral_event="gpu_monitor_started",
            gpu_ids=list(self.leases.gpus),
            names=names,
            bandwidth_nvml=[bandwidth for _, bandwidth in devices],
            interval=self.monitor.interval,
        )

    def _unavailable(self, failure: Failure) -> None:
        self.log.warn(
            "GPU monitor unavailable ({error}): measurements are not checked for "
            "interference or throttling",
            kcoral_event="gpu_monitor_unavailable",
            error=failure.getErrorMessage(),
        )

    def stopService(self) -> None:
        super().stopService()
        if self.leases.monitor is self.monitor:
            self.leases.monitor = None
        self.monitor.stop()
