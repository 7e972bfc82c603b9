"""
Where a worker's time goes: the engine run in this process, no server.

It makes the backend a worker would (C{--device gpu} on the GPU machine,
C{cpu} elsewhere) and a lease that counts its holds, runs C{--runs} null
programs and the overlap program's shape (a C{cpu_only} run, then a GPU run)
through L{kcoral.worker.engine.Engine.run}, and prints the wall time per run,
the time the lease was held per run, and cProfile's heaviest calls.  The
parent's side (HTTP, channel, arbiter) is not in these numbers; compare
with C{null_program.py}'s C{elapsed_ms} to see the channel's share.

    python3 bench/probes/worker_profile.py --device gpu --runs 300

With C{--first N} it also measures what a fresh worker's only program costs:
N children forked from this process (imports done, CUDA not initialised,
as from a worker template) each make the backend (their context) and run
one retiring null program, timed and profiled; the median and the slowest
child's profile are printed.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
import common  # noqa: E402

from kcoral.wire.channel import Execute  # noqa: E402
from kcoral.worker.builtins import registry_for  # noqa: E402
from kcoral.worker.devices import make_backend, prepare_backend  # noqa: E402
from kcoral.worker.engine import Engine  # noqa: E402

NULL = common.module_program("def noop():\n    return None\n", [("noop", [], False)])
OVERLAP_SOURCE = """
import time

def cpu_work():
    end = time.perf_counter() + 0.002
    while time.perf_counter() < end:
        pass

def gpu_work():
    try:
        import torch
    except ImportError:
        return None
    if torch.cuda.is_available():
        torch.cuda._sleep(100000)
        torch.cuda.synchronize()
    return "done"
"""
OVERLAP = common.module_program(OVERLAP_SOURCE, [("cpu_work", [], True), ("gpu_work", [], False)])


class TimedLease:
    """A lease that is always granted at once and adds up how long it is held."""

    def __init__(self) -> None:
        self.held = False
        self.holds = 0
        self.held_s = 0.0
        self._since = 0.0

    def acquire(self) -> None:
        if not self.held:
            self.held = True
            self.holds += 1
            self._since = time.perf_counter()

    def release(self) -> None:
        if self.held:
            self.held = False
            self.held_s += time.perf_counter() - self._since


def measure(engine: Engine, lease: TimedLease, program: dict, runs: int) -> dict[str, Any]:
    text = json.dumps(program)
    workspace = tempfile.mkdtemp(prefix="kcoral-worker-profile-")
    for _ in range(10):
        engine.run(Execute(text, workspace))
    engine.settle()
    lease.holds, lease.held_s = 0, 0.0
    walls, answers, settles = [], [], []
    for _ in range(runs):
        started = time.perf_counter()
        outcome = engine.run(Execute(text, workspace))
        answered = time.perf_counter()
        # What the worker does once the outcome is sent (a reused worker's
        # restore and collection): a sequential client's next request waits.
        engine.settle()
        settled = time.perf_counter()
        walls.append((settled - started) * 1e3)
        answers.append((answered - started) * 1e3)
        settles.append((settled - answered) * 1e3)
        if outcome.status != "COMPLETED":
            raise RuntimeError(f"program failed: {outcome.error}")
    holds, held_s = lease.holds, lease.held_s
    collections = []
    for _ in range(20):
        started = time.perf_counter()
        gc.collect()
        collections.append((time.perf_counter() - started) * 1e3)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(min(runs, 100)):
        engine.run(Execute(text, workspace))
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("cumulative").print_stats(18)
    # The leaves: what the time is actually spent in (a driver call, a syscall).
    stats.sort_stats("tottime").print_stats(14)
    return {
        "wall_ms": common.describe(walls),
        "answer_ms": common.describe(answers),
        "settle_ms": common.describe(settles),
        "full_collection_ms": common.describe(collections),
        # Objects a full collection walks (the frozen ones excluded).
        "unfrozen_objects": len(gc.get_objects()),
        "holds_per_run": holds / runs,
        "held_ms_per_run": held_s * 1e3 / runs,
        "profile": out.getvalue(),
    }


def first_runs(device: str, count: int) -> dict[str, Any]:
    """Fork C{count} children; each makes its backend and runs one retiring null program."""
    import os

    text = json.dumps(NULL)
    rows = []
    for _ in range(count):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            try:
                started = time.perf_counter()
                backend = make_backend(device)
                made = time.perf_counter()
                lease = TimedLease()
                engine = Engine(backend, lease, registry_for(backend), stream_returns=True)
                workspace = tempfile.mkdtemp(prefix="kcoral-worker-profile-")
                profiler = cProfile.Profile()
                profiler.enable()
                run_started = time.perf_counter()
                outcome = engine.run(Execute(text, workspace), retiring=True)
                ran = time.perf_counter()
                profiler.disable()
                out = io.StringIO()
                pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(22)
                row = {
                    "backend_ms": (made - started) * 1e3,
                    "run_ms": (ran - run_started) * 1e3,
                    "status": outcome.status,
                    "profile": out.getvalue(),
                }
                os.write(write_end, json.dumps(row).encode())
            except BaseException:
                import traceback

                os.write(write_end, json.dumps({"error": traceback.format_exc()}).encode())
            finally:
                os._exit(0)
        os.close(write_end)
        data = b""
        while chunk := os.read(read_end, 1 << 20):
            data += chunk
        os.close(read_end)
        os.waitpid(pid, 0)
        row = json.loads(data) if data else {"error": "the child wrote nothing"}
        if "error" in row:
            raise RuntimeError(f"a fresh child failed:\n{row['error']}")
        rows.append(row)
    slowest = max(rows, key=lambda r: r["run_ms"])
    return {
        "backend_ms": common.describe([r["backend_ms"] for r in rows]),
        "run_ms": common.describe([r["run_ms"] for r in rows]),
        "statuses": sorted({r["status"] for r in rows}),
        "slowest_profile": slowest["profile"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--label", default="")
    parser.add_argument(
        "--first", type=int, default=0, help="fresh children, one retiring program each"
    )
    parser.add_argument("--output", default=str(common.RESULTS / "worker_profile.json"))
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"benchmark": "worker_profile", "label": args.label}
    if args.first:
        # The template's imports, CUDA never initialised: the children fork
        # from an untouched parent, as workers from a template.
        from kcoral.worker.template import preload

        preload(args.device, "auto")
        gc.collect()
        gc.freeze()
        first = first_runs(args.device, args.first)
        result["first"] = {k: v for k, v in first.items() if k != "slowest_profile"}
        print(
            f"first program of a fresh worker: backend {common.fmt(first['backend_ms'])}; "
            f"run {common.fmt(first['run_ms'])}; {first['statuses']}"
        )
        print(first["slowest_profile"])
    prepare_backend(args.device)
    backend = make_backend(args.device)
    lease = TimedLease()
    engine = Engine(
        backend, lease, registry_for(backend), stream_returns=True, freeze_after_first_settle=True
    )
    gc.collect()
    gc.freeze()
    for name, program in (("null", NULL), ("overlap_shape", OVERLAP)):
        figures = measure(engine, lease, program, args.runs)
        result[name] = {k: v for k, v in figures.items() if k != "profile"}
        print(
            f"{name}: {common.fmt(figures['wall_ms'])}; lease held "
            f"{figures['held_ms_per_run']:.3f} ms in {figures['holds_per_run']:.2f} holds per run"
        )
        print(
            f"  until the outcome {common.fmt(figures['answer_ms'])}; settle after it "
            f"{common.fmt(figures['settle_ms'])}; a full collection "
            f"{common.fmt(figures['full_collection_ms'])} over "
            f"{figures['unfrozen_objects']} unfrozen objects"
        )
        print(figures["profile"])
    common.write_result(args.output, result)
    # Its context popped, as a worker does at exit (PyCUDA aborts otherwise).
    getattr(backend, "close", lambda: None)()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
