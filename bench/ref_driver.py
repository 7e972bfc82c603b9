"""
Workloads driven through the reference client (PyPI C{kcoral==0.1.1}) only.

Every server (ours, the reference, the stub floor) is measured through the
same client, the one users run, so the figures compare like with like. This
script imports the reference client and nothing of ours: both packages are
named C{kcoral}, so run it with the reference alone on the path, e.g.

    PYTHONPATH=<reference install> python3 bench/ref_driver.py --url URL null

It refuses to run when C{import kcoral} finds this checkout's package.

Workloads (subcommands; C{all} runs them in turn):

- C{null}: a module C{noop()} that returns None. Sequential p50/p99, then
  closed-loop requests/s at each C{--clients} count (each client its own
  C{Client}, so its own keep-alive connection; clients are spread over
  C{--processes} processes so the client side's GIL is not the ceiling).
- C{open-loop}: the same program at fixed arrival rates (C{--rates}); the
  latency of each request counts from its scheduled arrival, so a slow
  server is not hidden by a waiting client (no coordinated omission).
- C{tensor}: a 64 MiB float32 tensor (bytes on a server with no GPU) in the
  client's own flow: round trip (fresh tensor: CACHE_MISS, then the blob, then
  the answer carrying it back), up (fresh tensor, nothing returned) and down
  (the tensor the server holds, returned).
- C{overlap}: per request, C{--cpu-ms} of host busy-wait in a C{cpu_only}
  function, then C{--gpu-ms} of one GPU spin kernel (C{torch.cuda._sleep},
  calibrated once per worker) and a synchronize; requests/s and their share of
  the GPU-bound limit C{gpus x 1000 / gpu_ms}.
- C{copy}: device-to-device copy bandwidth measured inside a request with the
  server's C{kcoral.builtins.benchmark} (needs a GPU server).

Each figure is printed as one line C{name value unit}; the JSON (C{--output})
holds them all, with the raw samples' summaries.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import platform
import queue
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent


def _import_reference() -> Any:
    """Import the reference C{kcoral}, never this checkout's package."""

    def ours(entry: str) -> bool:
        try:
            return Path(entry or ".").resolve() == _ROOT
        except OSError:
            return False

    sys.path[:] = [p for p in sys.path if not ours(p)]
    try:
        import kcoral
    except ImportError as e:
        raise SystemExit(
            f"ref_driver: the reference client is not importable ({e}); "
            "run with PYTHONPATH=<reference install>"
        ) from None

    where = Path(kcoral.__file__).resolve().parent
    if where.parent == _ROOT or not (where / "protocol.py").exists():
        raise SystemExit(
            f"ref_driver: 'import kcoral' found {where}, not the reference client 0.1.1; "
            "run with PYTHONPATH=<reference install> only"
        )
    return kcoral


kcoral = _import_reference()
import numpy as np  # noqa: E402

from kcoral import Client, Program  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spin_source import CALIBRATED_SLEEP, CPU_WORK  # noqa: E402

NULL_SOURCE = "def noop():\n    return None\n"

TENSOR_SOURCE = """
def echo(x):
    return x


def consume(x):
    return None
"""

OVERLAP_SOURCE = (
    '''
import time

def gpu_work(ms):
    """One spin kernel of about ms milliseconds, then a synchronize."""
    import torch

    torch.cuda._sleep(int(ms * _cycles_per_ms(torch)))
    torch.cuda.synchronize()
    return "torch_sleep"


def noop(ms):
    return "skipped"
'''
    + CPU_WORK
    + CALIBRATED_SLEEP
)

COPY_SOURCE = """
def copy_bandwidth(mib, repeat):
    import torch
    from kcoral.builtins import benchmark

    src = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)

    def copy(d, s):
        d.copy_(s)

    timing = benchmark(copy, dst, src, {"warmup": 10, "repeat": repeat, "flush_l2": False})
    return {k: v for k, v in timing.items() if isinstance(v, (int, float, bool))}
"""


# --------------------------------------------------------------------------
# programs


def module_program(source: str, calls: list[tuple[str, list[Any], bool]]) -> Program:
    """Upload C{source}, run each (name, args, cpu_only) in turn, return the last."""
    program = Program()
    module = program.upload(kind="module", source=source)
    result = None
    for name, args, cpu_only in calls:
        fn = program.get_function(module=module, name=name, cpu_only=cpu_only)
        result = program.run(fn=fn, args=args)
    assert result is not None
    program.return_(key="r", value=result)
    return program


def null_program() -> Program:
    return module_program(NULL_SOURCE, [("noop", [], False)])


def tensor_program(value: np.ndarray, gpu: bool, function: str) -> Program:
    program = Program()
    if gpu:
        data = program.upload(kind="tensor", value=value)
    else:
        data = program.upload(kind="bytes", value=value.data)
    module = program.upload(kind="module", source=TENSOR_SOURCE)
    fn = program.get_function(module=module, name=function, cpu_only=not gpu)
    program.return_(key="r", value=program.run(fn=fn, args=[data]))
    return program


def check(result: Any) -> Any:
    if not result.completed:
        raise RuntimeError(f"program failed: {result.error}")
    return result


# --------------------------------------------------------------------------
# statistics and output


def summary(samples_ms: list[float]) -> dict[str, float]:
    if not samples_ms:
        return {"n": 0}
    ordered = sorted(samples_ms)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]

    return {
        "n": len(ordered),
        "p50": pct(50),
        "p90": pct(90),
        "p99": pct(99),
        "mean": statistics.fmean(ordered),
        "min": ordered[0],
        "max": ordered[-1],
    }


class Report:
    """Figures (printed as they come) and details for the JSON."""

    def __init__(self) -> None:
        self.figures: dict[str, float] = {}
        self.units: dict[str, str] = {}
        self.details: dict[str, Any] = {}

    def figure(self, name: str, value: float, unit: str) -> None:
        self.figures[name] = value
        self.units[name] = unit
        print(f"{name:<34} {value:12.3f} {unit}", flush=True)


# --------------------------------------------------------------------------
# closed loop, spread over processes


def _client_loop(
    url: str, program_json: tuple[str, float], deadline: float, start: float, out: list
) -> None:
    """One client: requests back to back until C{deadline}; latencies after C{start}."""
    kind, arg = program_json
    program = _program_by_name(kind, arg)
    with Client(url) as client:
        while True:
            t0 = time.time()
            if t0 >= deadline:
                return
            check(client.execute(program))
            t1 = time.time()
            if t0 >= start:
                out.append((t1, (t1 - t0) * 1e3))


def _program_by_name(kind: str, arg: float) -> Program:
    if kind == "null":
        return null_program()
    if kind == "overlap":
        cpu_ms, gpu_ms, gpu = arg  # type: ignore[misc]
        second = ("gpu_work", [gpu_ms], False) if gpu else ("noop", [gpu_ms], False)
        return module_program(OVERLAP_SOURCE, [("cpu_work", [cpu_ms], True), second])
    raise ValueError(kind)


def _process_main(
    url: str, program: tuple, threads: int, start: float, deadline: float, pipe: Any
) -> None:
    results: list = []
    errors: list[str] = []

    def run() -> None:
        try:
            _client_loop(url, program, deadline, start, results)
        except Exception as e:  # reported to the parent
            errors.append(f"{type(e).__name__}: {e}")

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    pipe.send((results, errors))
    pipe.close()


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _cpu_ticks(stat_path: str) -> int:
    """utime + stime from a /proc .../stat file (0 when it is gone)."""
    try:
        with open(stat_path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def _tree(root: int) -> list[int]:
    """C{root} and every process descended from it."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(parents.get(pid, ()))
    return found


def _scheduler(pid: int) -> dict[str, float]:
    """
    The scheduler's counts for the main thread of C{pid}: seconds it waited
    runnable but off a CPU (C{schedstat}), switches it did not ask for, and
    moves between CPUs (C{sched}, where the kernel keeps it).
    """
    task = f"/proc/{pid}/task/{pid}"
    counts: dict[str, float] = {}
    try:
        with open(f"{task}/schedstat") as f:
            counts["runqueue_wait"] = int(f.read().split()[1]) / 1e9
        with open(f"{task}/status") as f:
            for line in f:
                if line.startswith("nonvoluntary_ctxt_switches:"):
                    counts["involuntary_switches"] = float(line.split()[1])
        with open(f"{task}/sched") as f:
            for line in f:
                if line.startswith("se.nr_migrations"):
                    counts["migrations"] = float(line.split(":")[1])
    except (OSError, IndexError, ValueError):
        pass
    return counts


@dataclass
class CpuSample:
    """
    CPU seconds so far: the server's main thread, its process tree, the
    machine; and the main thread's scheduler counts (L{_scheduler}).
    """

    reactor: float
    server: float
    machine_busy: float
    machine_all: float
    scheduler: dict[str, float]

    @classmethod
    def take(cls, server_pid: int) -> CpuSample:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        idle = ticks[3] + ticks[4]  # idle + iowait
        return cls(
            reactor=_cpu_ticks(f"/proc/{server_pid}/task/{server_pid}/stat") * _TICK_S,
            server=sum(_cpu_ticks(f"/proc/{pid}/stat") for pid in _tree(server_pid)) * _TICK_S,
            machine_busy=(sum(ticks) - idle) * _TICK_S,
            machine_all=sum(ticks) * _TICK_S,
            scheduler=_scheduler(server_pid),
        )

    def since(self, before: CpuSample, seconds: float, requests: int) -> dict[str, float]:
        """What the window between C{before} and this sample cost."""
        per = 1e3 / max(requests, 1)
        spent = {
            "reactor_busy": (self.reactor - before.reactor) / seconds,
            "reactor_ms_per_request": (self.reactor - before.reactor) * per,
            "server_cores": (self.server - before.server) / seconds,
            "server_ms_per_request": (self.server - before.server) * per,
            "machine_busy_cores": (self.machine_busy - before.machine_busy) / seconds,
        }
        changed = {
            name: self.scheduler[name] - before.scheduler[name]
            for name in self.scheduler.keys() & before.scheduler.keys()
        }
        if "runqueue_wait" in changed:
            spent["reactor_runqueue_wait_share"] = changed["runqueue_wait"] / seconds
        if "involuntary_switches" in changed:
            spent["reactor_involuntary_switches_per_request"] = changed[
                "involuntary_switches"
            ] / max(requests, 1)
        if "migrations" in changed:
            spent["reactor_migrations_per_s"] = changed["migrations"] / seconds
        return spent


def _scheduler_line(cpu: dict[str, float]) -> str:
    """The main thread's scheduler counts of a round, where the kernel gave them."""
    parts = []
    if "reactor_runqueue_wait_share" in cpu:
        parts.append(f"waited runnable {100 * cpu['reactor_runqueue_wait_share']:.1f} %")
    if "reactor_involuntary_switches_per_request" in cpu:
        parts.append(f"{cpu['reactor_involuntary_switches_per_request']:.2f} preemptions/request")
    if "reactor_migrations_per_s" in cpu:
        parts.append(f"{cpu['reactor_migrations_per_s']:.0f} CPU moves/s")
    return "; reactor " + ", ".join(parts) if parts else ""


def _sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.time()))


def closed_loop(
    url: str,
    program: tuple,
    clients: int,
    seconds: float,
    warmup: float,
    processes: int,
    server_pid: int | None = None,
) -> dict[str, Any]:
    """
    C{clients} clients for C{warmup + seconds}; requests/s over the last
    C{seconds}.  With C{server_pid} (a server on this machine), also the CPU
    the server's main thread, its process tree and the whole machine spent
    in that window.
    """
    processes = max(1, min(processes, clients))
    share = [clients // processes + (1 if i < clients % processes else 0) for i in range(processes)]
    ctx = multiprocessing.get_context("fork")
    start = time.time() + 0.5 + warmup
    deadline = start + seconds
    procs = []
    for threads in share:
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_process_main, args=(url, program, threads, start, deadline, child)
        )
        proc.start()
        procs.append((proc, parent))
    cpu = None
    if server_pid:
        _sleep_until(start)
        before = CpuSample.take(server_pid)
        _sleep_until(deadline)
        cpu = (before, CpuSample.take(server_pid))
    samples: list = []
    errors: list[str] = []
    for proc, parent in procs:
        got, errs = parent.recv()
        samples.extend(got)
        errors.extend(errs)
        proc.join()
    # Count only requests that finished inside the window.
    done = [lat for t, lat in samples if t <= deadline]
    if errors:
        raise RuntimeError(f"{len(errors)} client(s) failed: {errors[0]}")
    level = {
        "clients": clients,
        "processes": processes,
        "seconds": seconds,
        "requests": len(done),
        "requests_per_s": len(done) / seconds,
        "latency_ms": summary(done),
    }
    if cpu:
        level["cpu"] = cpu[1].since(cpu[0], seconds, len(done))
    return level


# --------------------------------------------------------------------------
# workloads


def health(url: str) -> dict[str, Any]:
    with Client(url) as client:
        return client.health()


def is_gpu(args: argparse.Namespace, info: dict[str, Any]) -> bool:
    if args.mode != "auto":
        return args.mode == "gpu"
    return int(info.get("gpu_count") or 0) > 0


def sequential(client: Client, program: Program, n: int, max_seconds: float) -> list[float]:
    samples = []
    end = time.time() + max_seconds
    for _ in range(n):
        t0 = time.perf_counter()
        check(client.execute(program))
        samples.append((time.perf_counter() - t0) * 1e3)
        if time.time() > end:
            break
    return samples


def run_null(args: argparse.Namespace, report: Report, info: dict[str, Any]) -> None:
    """
    The sequential phase, then each closed-loop level; with C{--rounds N},
    N times over, interleaved (sequential, every level, sequential, ...),
    so that a drift of the machine touches every figure alike.  The
    sequential figures pool every round's samples; a level's requests a
    second are the median of its rounds (each round in the details).
    """
    program = null_program()
    samples: list[float] = []
    rounds: dict[str, list[dict[str, Any]]] = {str(clients): [] for clients in args.clients}
    with Client(args.url) as client:
        sequential(client, program, args.warmup, args.max_seconds)
    for _ in range(args.rounds):
        with Client(args.url) as client:
            samples += sequential(client, program, args.sequential, args.max_seconds)
        for clients in args.clients:
            rounds[str(clients)].append(
                closed_loop(
                    args.url,
                    ("null", 0.0),
                    clients,
                    args.seconds,
                    args.warmup_seconds,
                    args.processes,
                    args.server_pid,
                )
            )
    seq = summary(samples)
    report.details["null_sequential"] = seq
    report.figure("null.sequential.p50", seq["p50"], "ms")
    report.figure("null.sequential.p99", seq["p99"], "ms")
    levels = {}
    for clients in args.clients:
        runs = rounds[str(clients)]
        # The median of the rounds' rates (of the middle two for an even
        # count: the upper one alone would bias a level's peak upward).
        rates = [run["requests_per_s"] for run in runs]
        rate = statistics.median(rates)
        level = min(runs, key=lambda run: abs(run["requests_per_s"] - rate))
        levels[str(clients)] = {**level, "requests_per_s": rate, "rounds_per_s": rates}
        if "cpu" in level:
            levels[str(clients)]["rounds_cpu"] = [run["cpu"] for run in runs]
            for run in runs:
                print(
                    f"  c{clients}: {run['requests_per_s']:8.1f} req/s, reactor busy "
                    f"{run['cpu']['reactor_busy']:.2f} ({run['cpu']['reactor_ms_per_request']:.2f} "
                    f"ms/request), server {run['cpu']['server_cores']:.2f} cores, machine "
                    f"{run['cpu']['machine_busy_cores']:.2f} cores busy"
                    + _scheduler_line(run["cpu"]),
                    flush=True,
                )
        report.figure(f"null.rps.c{clients}", rate, "req/s")
        report.figure(f"null.p99.c{clients}", level["latency_ms"].get("p99", 0.0), "ms")
    report.details["null_closed_loop"] = levels
    top = max(args.clients)
    shares = round_peak_shares(rounds, top)
    if shares:
        report.details["null_round_peak_shares"] = {str(top): shares}
        report.figure(f"null.round_peak_share.c{top}", statistics.median(shares), "of peak")


def round_peak_shares(rounds: dict[str, list[dict[str, Any]]], clients: int) -> list[float]:
    """
    Each round's rate at C{clients} over the highest rate of that round's
    levels.  The levels of one round run back to back, so a slow spell of
    the host touches the ratio's two sides alike; across rounds it does
    not (the median level over the highest median level takes the maximum
    of noisy figures, which reads low when two levels are equal).
    """
    count = min(len(runs) for runs in rounds.values())
    shares = []
    for i in range(count):
        peak = max(runs[i]["requests_per_s"] for runs in rounds.values())
        if peak > 0:
            shares.append(rounds[str(clients)][i]["requests_per_s"] / peak)
    return shares


def open_loop_level(
    url: str, program: Program, rate: float, seconds: float, threads: int
) -> dict[str, Any]:
    """
    C{rate} arrivals a second for C{seconds}; latency from each scheduled
    arrival.  Every sender has its client and its connection open (one
    C{/health}) before the first arrival, so starting threads and connecting
    are not counted as the server's latency.
    """
    offsets: queue.Queue = queue.Queue()
    latencies: list[float] = []
    errors: list[str] = []
    count = max(1, int(rate * seconds))
    for i in range(count):
        offsets.put(i / rate)
    ready = threading.Barrier(threads + 1)
    go = threading.Event()
    start = [0.0]

    def worker() -> None:
        with Client(url) as client:
            try:
                client.health()
            finally:
                ready.wait()
            go.wait()
            while True:
                try:
                    due = start[0] + offsets.get_nowait()
                except queue.Empty:
                    return
                wait = due - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                try:
                    check(client.execute(program))
                except Exception as e:
                    errors.append(f"{type(e).__name__}: {e}")
                    return
                latencies.append((time.perf_counter() - due) * 1e3)

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    ready.wait()
    start[0] = time.perf_counter() + 0.1
    go.set()
    for t in pool:
        t.join()
    if errors:
        raise RuntimeError(f"open loop at {rate}/s: {errors[0]}")
    return {
        "rate": rate,
        "requests": count,
        "achieved_per_s": count / (time.perf_counter() - start[0]),
        "latency_ms": summary(latencies),
    }


def run_open_loop(args: argparse.Namespace, report: Report, info: dict[str, Any]) -> None:
    program = null_program()
    levels = {}
    for rate in args.rates:
        level = open_loop_level(args.url, program, rate, args.seconds, args.open_loop_threads)
        levels[str(rate)] = level
        report.figure(f"open.r{rate:g}.p50", level["latency_ms"]["p50"], "ms")
        report.figure(f"open.r{rate:g}.p99", level["latency_ms"]["p99"], "ms")
    report.details["open_loop"] = levels


@contextlib.contextmanager
def counting_requests(attempts: list[int]) -> Iterator[None]:
    """
    Count every HTTP request sent meanwhile in C{attempts}, through httpx's
    public C{Client.send} (the reference client has no hook of its own and
    its httpx client is private).
    """
    import httpx

    send = httpx.Client.send

    def counted(self: Any, request: Any, **kwargs: Any) -> Any:
        attempts.append(1)
        return send(self, request, **kwargs)

    httpx.Client.send = counted  # type: ignore[method-assign]
    try:
        yield
    finally:
        httpx.Client.send = send  # type: ignore[method-assign]


def run_tensor(args: argparse.Namespace, report: Report, info: dict[str, Any]) -> None:
    gpu = is_gpu(args, info)
    mib = args.tensor_mib
    rng = np.random.default_rng(0)
    base = rng.standard_normal((mib << 20) // 4, dtype=np.float32).reshape(-1, 1024)
    nbytes = base.nbytes
    stamp = [0]

    def fresh() -> np.ndarray:
        # A new digest each time: the server has never seen this tensor.
        stamp[0] += 1
        base[0, 0] = np.float32(stamp[0] + time.time() % 1000)
        return base

    attempts: list[int] = []
    samples: dict[str, list[float]] = {"roundtrip": [], "up": [], "down": []}
    with counting_requests(attempts), Client(args.url) as client:

        def timed(program: Program, flow: str) -> Any:
            attempts.clear()
            t0 = time.perf_counter()
            result = check(client.execute(program))
            samples[flow].append((time.perf_counter() - t0) * 1e3)
            report.details.setdefault(f"tensor_{flow}_attempts", []).append(len(attempts))
            return result

        for i in range(args.iterations + 1):
            keep = i > 0  # the first pass warms up
            value = fresh()
            program = tensor_program(value, gpu, "echo")
            result = timed(program, "roundtrip")
            back = result["r"]
            got = bytes(back) if not gpu else back
            if (gpu and not np.array_equal(got, value)) or (not gpu and got != value.tobytes()):
                raise RuntimeError("tensor round trip: the bytes that came back differ")
            timed(tensor_program(fresh(), gpu, "consume"), "up")
            # Down: the tensor just uploaded is in the server's memory cache.
            timed(tensor_program(base, gpu, "echo"), "down")
            if not keep:
                for flow in samples:
                    samples[flow].clear()
                report.details.pop("tensor_roundtrip_attempts", None)
                report.details.pop("tensor_up_attempts", None)
                report.details.pop("tensor_down_attempts", None)
    report.details["tensor"] = {
        "mib": mib,
        "kind": "tensor" if gpu else "bytes",
        **{flow: summary(s) for flow, s in samples.items()},
    }
    for flow, s in samples.items():
        p50 = summary(s)["p50"]
        report.figure(f"tensor.{flow}.p50", p50, "ms")
        if flow != "roundtrip":
            report.figure(f"tensor.{flow}.rate", nbytes / 1e6 / (p50 / 1e3), "MB/s")


def run_overlap(args: argparse.Namespace, report: Report, info: dict[str, Any]) -> None:
    gpu = is_gpu(args, info)
    gpus = max(1, int(info.get("gpu_count") or 0))
    if gpu:
        limit = gpus * 1000.0 / args.gpu_ms
    else:
        capacity = int((info.get("load") or {}).get("request_capacity") or 1)
        limit = capacity * 1000.0 / args.cpu_ms
        print("overlap: no GPU: the GPU part is skipped; limit is workers x 1000 / cpu_ms")
    spec = ("overlap", (args.cpu_ms, args.gpu_ms, gpu))
    program = _program_by_name(*spec)  # type: ignore[arg-type]
    with Client(args.url) as client:
        for _ in range(2):
            check(client.execute(program))
    levels = {}
    for clients in args.overlap_clients:
        level = closed_loop(
            args.url, spec, clients, args.seconds, 1.0, args.processes, args.server_pid
        )
        level["share_of_limit"] = level["requests_per_s"] / limit
        levels[str(clients)] = level
        report.figure(f"overlap.rps.c{clients}", level["requests_per_s"], "req/s")
        report.figure(f"overlap.share.c{clients}", level["share_of_limit"], "of limit")
    report.details["overlap"] = {"limit_per_s": limit, "gpu": gpu, "levels": levels}


def run_copy(args: argparse.Namespace, report: Report, info: dict[str, Any]) -> None:
    if not is_gpu(args, info) or info.get("stub"):
        print("copy: skipped (needs a GPU server)")
        return
    program = module_program(COPY_SOURCE, [("copy_bandwidth", [args.copy_mib, 100], False)])
    with Client(args.url) as client:
        timing = check(client.execute(program))["r"]
    median = timing["latency_ms_median"]
    report.details["copy"] = {"mib": args.copy_mib, **timing}
    report.figure("copy.median", median, "ms")
    # A copy reads and writes every byte: 2 x size per call.
    report.figure("copy.bandwidth", 2 * (args.copy_mib << 20) / 1e9 / (median / 1e3), "GB/s")


WORKLOADS = {
    "null": run_null,
    "open-loop": run_open_loop,
    "tensor": run_tensor,
    "overlap": run_overlap,
    "copy": run_copy,
}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workloads", nargs="+", choices=[*WORKLOADS, "all"])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--label", default="", help="free text recorded in the JSON")
    parser.add_argument("--output", help="JSON path (default bench/results/ref_driver.json)")
    parser.add_argument(
        "--mode",
        choices=["auto", "gpu", "cpu"],
        default="auto",
        help="gpu: tensors and GPU work; cpu: bytes, no GPU part; auto: from /health gpu_count",
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="each closed/open-loop level")
    parser.add_argument("--warmup-seconds", type=float, default=1.0)
    parser.add_argument("--max-seconds", type=float, default=20.0, help="cap on sequential")
    parser.add_argument("--warmup", type=int, default=10, help="sequential warm-up requests")
    parser.add_argument("--sequential", type=int, default=200)
    parser.add_argument("--clients", type=_ints, default=[1, 8, 32, 64])
    parser.add_argument("--processes", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)))
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="null: repeat the sequential phase and the levels this many times, interleaved",
    )
    parser.add_argument(
        "--server-pid",
        type=int,
        help="the server's pid (on this machine): each closed-loop level also records the CPU "
        "its main thread, its process tree and the machine spent",
    )
    parser.add_argument("--rates", type=_floats, default=[50.0, 100.0, 150.0])
    parser.add_argument("--open-loop-threads", type=int, default=64)
    parser.add_argument("--tensor-mib", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--cpu-ms", type=float, default=50.0)
    parser.add_argument("--gpu-ms", type=float, default=10.0)
    parser.add_argument("--overlap-clients", type=_ints, default=[8, 16])
    parser.add_argument("--copy-mib", type=int, default=1024)
    args = parser.parse_args(argv)
    names = list(WORKLOADS) if "all" in args.workloads else args.workloads

    info = health(args.url)
    print(
        f"ref_driver: reference client {getattr(kcoral, '__version__', '?')} against "
        f"{args.url} (gpu_count {info.get('gpu_count')}{', stub' if info.get('stub') else ''})"
        f"{' [' + args.label + ']' if args.label else ''}",
        flush=True,
    )
    report = Report()
    failed = []
    for name in names:
        try:
            WORKLOADS[name](args, report, info)
        except Exception as e:
            failed.append(name)
            report.details.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
            print(f"!! {name} failed: {type(e).__name__}: {e}", flush=True)
    output = Path(args.output or _ROOT / "bench" / "results" / "ref_driver.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(
        json.dumps(
            {
                "label": args.label,
                "url": args.url,
                "client": f"kcoral {getattr(kcoral, '__version__', '?')} (reference)",
                "health": info,
                "workloads": names,
                "figures": report.figures,
                "units": report.units,
                "details": report.details,
                "failed": failed,
                "python": platform.python_version(),
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            },
            indent=2,
        )
    )
    print(f"ref_driver: wrote {output}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
