"""
Where a measurement's CPU went: the host's cores, and each role of a pool.

A throughput figure alone cannot say whether a pool fell short because one
of its processes was the bottleneck or because the host ran out of cores.
L{CpuMeter} answers that.  It reads C{/proc/stat} at the start and end of
a span, which gives the share of all cores that were busy.  It also reads
each named process tree through psutil, which gives the CPU each role
spent (user + system, reaped children included).  Divide by the jobs done
and you get CPU milliseconds per job, role by role.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import hwcounters
import psutil


def host_jiffies() -> tuple[int, int, int]:
    """
    (busy, total, steal) clock ticks of all CPUs since boot, from
    C{/proc/stat}; steal is time a virtual machine's CPUs were ready but the
    hypervisor ran something else (counted in busy as well).
    """
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])
    steal = fields[7] if len(fields) > 7 else 0
    return total - idle, total, steal


def tree_seconds(pid: int) -> float:
    """
    CPU seconds of C{pid} and every live process below it, each with the
    children it has reaped: a worker that ended during the span still counts
    once its parent has waited for it.
    """
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for process in processes:
        try:
            t = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def own_seconds(pid: int) -> float:
    """CPU seconds of C{pid} alone (all its threads), no children."""
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return t.user + t.system


#: One unit of the speed probe's core work: about a millisecond of pure
#: Python that stays in the core's own caches.
PROBE_LOOP = 40_000
#: The memory work: reads at random places of a list of this many integers
#: (some 70 MB with their objects, beyond a core's caches), as a server's
#: heap is read, so that what other cores do to the shared cache and memory
#: shows.
PROBE_HEAP = 2_000_000
PROBE_READS = 4_000


def _probe(stop: Any, out: Any, period: float) -> None:
    """The speed probe's process: time both works every C{period} s until C{stop} is set."""
    import random

    heap = [i * 7 + 1000 for i in range(PROBE_HEAP)]
    rng = random.Random(37)
    places = [rng.randrange(PROBE_HEAP) for _ in range(PROBE_READS)]
    core: list[int] = []
    memory: list[int] = []
    out.send("ready")
    ready = time.process_time()
    while not stop.wait(period) or not core:
        started = time.thread_time_ns()
        total = 0
        for i in range(PROBE_LOOP):
            total += i
        middle = time.thread_time_ns()
        for j in places:
            total += heap[j]
        core.append(middle - started)
        memory.append(time.thread_time_ns() - middle)
    out.send((core, memory, time.process_time() - ready))


class SpeedProbe:
    """
    How fast the host runs two fixed pieces of pure Python now: the CPU
    time (not wall time: waiting for a core does not count) of one unit of
    core work (L{PROBE_LOOP}) and of memory work (L{PROBE_READS} reads
    about a L{PROBE_HEAP} list), sampled every C{period} seconds in a
    process of its own (a few percent of one core).  When every process of a pool spends
    more CPU per job under a heavier host load, this shows whether the host
    itself got slower (shared cores, clock) or the pool's own work grew.
    """

    def __init__(self, period: float = 0.05) -> None:
        self.period = period
        self._process: Any = None

    def start(self) -> None:
        ctx = multiprocessing.get_context("fork")
        self._stop = ctx.Event()
        self._out, child = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=_probe, args=(self._stop, child, self.period))
        self._process.start()
        child.close()
        # Its heap built before the span starts, so the span has none of that.
        self._out.recv()

    def stop(self) -> dict[str, float]:
        """
        The probe's medians (microseconds of CPU per unit of work), its
        sample count and the CPU seconds it spent since it was ready.
        """
        self._stop.set()
        core, memory, spent = self._out.recv()
        self._process.join()

        def median_us(samples: list[int]) -> float:
            return statistics.median(samples) / 1000.0 if samples else float("nan")

        return {
            "probe_us": median_us(core),
            "probe_memory_us": median_us(memory),
            "probe_samples": len(core),
            "probe_seconds": spent,
        }


def _ballast(stop: Any) -> None:
    """One ballast process: the probe's two kinds of work, back to back, until C{stop}."""
    import random

    heap = [i * 7 + 1000 for i in range(PROBE_HEAP)]
    rng = random.Random(os.getpid())
    places = [rng.randrange(PROBE_HEAP) for _ in range(PROBE_READS)]
    total = 0
    while not stop.is_set():
        for i in range(PROBE_LOOP):
            total += i
        for j in places:
            total += heap[j]


class Ballast:
    """
    C{processes} processes that keep a core busy each, with the probe's
    core and memory work: a host as busy as a bigger pool makes it, with no
    more of the pool running.  With it a small pool can be timed on a host
    under the load a larger one puts on it, so that the two figures differ
    only in the pool's size.
    """

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self._running: list[Any] = []

    def __enter__(self) -> Ballast:
        ctx = multiprocessing.get_context("fork")
        self._stop = ctx.Event()
        self._running = [
            ctx.Process(target=_ballast, args=(self._stop,)) for _ in range(self.processes)
        ]
        for process in self._running:
            process.start()
        time.sleep(0.5)  # past the heaps' building
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for process in self._running:
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join()
        self._running = []


class CpuMeter:
    """
    One span's CPU: C{start()}, then C{stop(jobs)} for the report.

    C{roles} maps a role's name to a callable giving its root pids now (a
    pool's nodes change between spans, not within one).  The report's
    C{client} is this process's tree less every role, so that the load
    generator's share shows as well.  The main processes of the roles
    named in C{counted} also get the CPU's cycle and instruction counters
    (L{hwcounters}), where the host has them.
    """

    def __init__(
        self,
        roles: Mapping[str, Callable[[], Sequence[int]]],
        counted: Sequence[str] = (),
    ) -> None:
        self.roles = roles
        self.counted = counted
        self._counters: dict[str, hwcounters.Counters | str] = {}
        self._counts: dict[str, tuple[int, int]] = {}
        self._start: dict[str, float] = {}
        self._host: tuple[int, int, int] = (0, 0, 0)
        self._began = 0.0
        self._probe = SpeedProbe()

    def _sample(self) -> dict[str, float]:
        sample: dict[str, float] = {}
        for name, pids in self.roles.items():
            roots = list(pids())
            sample[name] = sum(tree_seconds(pid) for pid in roots)
            sample[name + "_main"] = sum(own_seconds(pid) for pid in roots)
        sample["_self"] = tree_seconds(os.getpid())
        return sample

    def start(self) -> None:
        self._probe.start()
        self._host = host_jiffies()
        self._counters = {
            name: hwcounters.open_counters(self.roles[name]()) for name in self.counted
        }
        self._counts = {
            name: counters.read()
            for name, counters in self._counters.items()
            if isinstance(counters, hwcounters.Counters)
        }
        self._start = self._sample()
        self._began = time.monotonic()

    def stop(self, jobs: int) -> dict[str, Any]:
        seconds = time.monotonic() - self._began
        probe = self._probe.stop()
        end = self._sample()
        counted = self._read_counters(end, jobs)
        busy, total, steal = host_jiffies()
        busy0, total0, steal0 = self._host
        report: dict[str, Any] = {
            "cores": os.cpu_count(),
            "seconds": seconds,
            "host_busy": (busy - busy0) / max(1, total - total0),
            "host_steal": (steal - steal0) / max(1, total - total0),
            **probe,
        }
        # How busy each role's busiest kind of process was: a role's main
        # processes' CPU over the span, per process (1.0: a core, flat out).
        report["main_busy"] = {
            name: (end[name + "_main"] - self._start[name + "_main"])
            / max(1e-9, seconds * max(1, len(self.roles[name]())))
            for name in self.roles
        }
        per_job: dict[str, float] = {}
        roles_total = 0.0
        for name in self.roles:
            spent = end[name] - self._start[name]
            roles_total += spent
            per_job[name] = 1000.0 * spent / max(1, jobs)
            main = end[name + "_main"] - self._start[name + "_main"]
            per_job[name + "_main"] = 1000.0 * main / max(1, jobs)
        client = end["_self"] - self._start["_self"] - roles_total - report["probe_seconds"]
        per_job["client"] = 1000.0 * client / max(1, jobs)
        # (Ballast processes started after C{start} are this process's
        # children too: their CPU lands in C{client} once reaped.)
        report["ms_per_job"] = per_job
        if counted:
            report["counters"] = counted
        return report

    def _read_counters(self, end: Mapping[str, float], jobs: int) -> dict[str, Any]:
        """
        Per counted role's main processes: cycles and instructions per job,
        instructions per cycle, and the clock they ran at (cycles over their
        CPU seconds); or why there are none.
        """
        out: dict[str, Any] = {}
        for name, counters in self._counters.items():
            if not isinstance(counters, hwcounters.Counters):
                out[name] = {"unavailable": counters}
                continue
            cycles0, instructions0 = self._counts[name]
            cycles, instructions = counters.read()
            counters.close()
            cycles -= cycles0
            instructions -= instructions0
            seconds = end[name + "_main"] - self._start[name + "_main"]
            out[name] = {
                "kernel_counted": counters.kernel,
                "mcycles_per_job": cycles / 1e6 / max(1, jobs),
                "minstructions_per_job": instructions / 1e6 / max(1, jobs),
                "ipc": instructions / max(1, cycles),
                "ghz": cycles / 1e9 / max(1e-9, seconds),
            }
        self._counters = {}
        return out


def describe(report: Mapping[str, Any]) -> str:
    """One line: the host's busy share and each role's CPU ms per job."""
    per_job = report["ms_per_job"]
    parts = [f"{name} {value:.2f}" for name, value in per_job.items()]
    mains = ", ".join(f"{name} {100 * v:.0f}%" for name, v in report["main_busy"].items())
    return (
        f"host {100 * report['host_busy']:.0f}% of {report['cores']} cores busy "
        f"({100 * report['host_steal']:.1f}% stolen); "
        f"probe: core {report['probe_us']:.0f} us, memory {report['probe_memory_us']:.0f} us "
        f"CPU per unit; main process busy: {mains}; "
        f"CPU ms/job: "
        + ", ".join(parts)
        + "".join(
            f"; {name} main: "
            + (
                counted["unavailable"]
                if "unavailable" in counted
                else f"{counted['minstructions_per_job']:.2f} M instructions/job, "
                f"{counted['mcycles_per_job']:.2f} M cycles/job, IPC {counted['ipc']:.2f}, "
                f"{counted['ghz']:.2f} GHz" + ("" if counted["kernel_counted"] else " (user mode)")
            )
            for name, counted in report.get("counters", {}).items()
        )
    )
