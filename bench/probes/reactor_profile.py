"""
Where the reactor's time goes: null programs from many clients, with the
server's main thread (the reactor) measured from outside.

It starts a server (C{--flags}, default a CPU server in reuse mode without a
sandbox), warms it up, then sends C{--requests} null programs from
C{--clients} keep-alive connections while it reads the CPU time of the
reactor thread and of the whole server process from C{/proc} and, with
C{--py-spy}, samples the reactor thread with py-spy (C{--gil}: only samples
holding the GIL count, so waiting for it is not charged to the code that
waits). Each sample is charged to the nearest kcoral, Twisted or Klein frame
(standard-library frames count for their caller) and that frame's file gives
the row of the table.

    python3 bench/probes/reactor_profile.py --clients 64 --requests 2000 --py-spy

No timing is asserted; the figures and the table print, and the JSON goes to
C{bench/results/reactor_profile.json}.
"""

from __future__ import annotations

import argparse
import collections
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
import common  # noqa: E402

from kcoral.testing.live_server import ServerProcess  # noqa: E402

SOURCE = "def noop():\n    return None\n"
PROGRAM = common.module_program(SOURCE, [("noop", [], False)])

DEFAULT_FLAGS = (
    "--device cpu --num-workers 2 --sandbox none --log-dir '' --max-requests-per-worker 0"
)

#: (row, path fragments): the first row whose fragment is in a frame's file.
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    (
        "logging (events, console, access log)",
        ("twisted/logger/", "kcoral/server/observe/logs.py", "kcoral/server/observe/logwriter.py"),
    ),
    ("multipart request parsing", ("kcoral/wire/multipart.py", "kcoral/ipc/uploads.py")),
    ("program JSON and validation", ("kcoral/wire/program.py",)),
    ("response rendering", ("kcoral/wire/render.py", "kcoral/wire/values.py")),
    (
        "worker channel (messages to and from workers)",
        (
            "kcoral/wire/channel.py",
            "kcoral/server/workers/workerproc.py",
            "kcoral/server/workers/workerprotocol.py",
            "kcoral/server/workers/runningjob.py",
            "kcoral/server/workers/processes.py",
            "twisted/internet/process.py",
        ),
    ),
    (
        "admission, pool, lease, cache, metrics",
        (
            "kcoral/server/http/app.py",
            "kcoral/server/workers/pool.py",
            "kcoral/server/leases/lease.py",
            "kcoral/server/cache.py",
            "kcoral/server/service.py",
            "kcoral/server/observe/metrics.py",
            "kcoral/server/observe/status.py",
            "kcoral/server/workers/scratch.py",
            "kcoral/server/sandbox/",
        ),
    ),
    (
        "HTTP (twisted.web, Klein, kcoral.server.http site, channel, request)",
        (
            "twisted/web/",
            "klein/",
            "kcoral/server/http/site.py",
            "kcoral/server/http/channel.py",
            "kcoral/server/http/request.py",
            "kcoral/server/http/refusals.py",
            "kcoral/server/http/accept.py",
        ),
    ),
    ("reactor, sockets, Deferreds", ("twisted/",)),
    ("other kcoral", ("kcoral/",)),
]


def thread_cpu(pid: int, tid: int | None = None) -> float:
    """CPU seconds (user + system) of a process, or of one of its threads."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def categorize(stack: str) -> str:
    frames = stack.split(";")
    leaf = frames[-1]
    if "epollreactor.py" in leaf and "doPoll" in leaf:
        return "idle (waiting in epoll)"
    for frame in reversed(frames):
        for row, fragments in CATEGORIES:
            if any(f in frame for f in fragments):
                return row
    return "other (interpreter, standard library)"


def profile_table(raw: str, main_marker: str = "_run_module_as_main") -> dict[str, Any]:
    """Rows of the reactor thread's samples from py-spy's raw output."""
    rows: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack.startswith(main_marker):
            continue
        rows[categorize(stack)] += int(count)
        total += int(count)
    return {"samples": total, "rows": dict(rows.most_common())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flags", default=DEFAULT_FLAGS, help="the server's flags")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--max-seconds", type=float, default=30.0)
    parser.add_argument("--py-spy", action="store_true", help="sample the reactor with py-spy")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--no-gil", action="store_true", help="count samples not holding the GIL")
    parser.add_argument("--raw", help="keep py-spy's raw samples in this file")
    parser.add_argument("--label", default="")
    parser.add_argument("--output", default=str(common.RESULTS / "reactor_profile.json"))
    args = parser.parse_args(argv)

    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if args.py_spy and not Path(spy).exists():
        raise SystemExit("py-spy not found (pip install py-spy)")
    server = ServerProcess(shlex.split(args.flags)).start(timeout=120)
    try:
        assert server.process is not None
        pid = server.process.pid
        host, port = "127.0.0.1", server.port

        def one(conn: common.Connection, _i: int) -> float:
            reply = conn.execute(PROGRAM)
            if reply.outcome != "COMPLETED":
                raise RuntimeError(f"null program: {reply.describe_error()}")
            return reply.wall_ms

        common.run_concurrent(host, port, min(args.clients, 8), args.warmup, one, 30)
        spy_process = None
        raw_path = Path(args.raw or tempfile.mkstemp(prefix="reactor-profile-", suffix=".txt")[1])
        if args.py_spy:
            command = [
                spy,
                "record",
                "-p",
                str(pid),
                "-r",
                str(args.rate),
                "-f",
                "raw",
                "--nonblocking",
            ]
            command += ["-o", str(raw_path), "-d", str(int(args.max_seconds) + 5)]
            command += [] if args.no_gil else ["--gil"]
            spy_process = subprocess.Popen(
                command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
            )
            time.sleep(1.0)
        reactor0, process0 = thread_cpu(pid, pid), thread_cpu(pid)
        walls, seconds = common.run_concurrent(
            host, port, args.clients, args.requests, one, args.max_seconds
        )
        reactor1, process1 = thread_cpu(pid, pid), thread_cpu(pid)
        table = None
        if spy_process is not None:
            spy_process.send_signal(2)
            spy_process.wait(30)
            table = profile_table(raw_path.read_text()) if raw_path.exists() else None
        if not args.raw:
            raw_path.unlink(missing_ok=True)
    finally:
        server.stop()

    n = len(walls)
    result = {
        "benchmark": "reactor_profile",
        "label": args.label,
        "flags": args.flags,
        "clients": args.clients,
        "requests": n,
        "requests_per_s": n / seconds,
        "wall_ms": common.describe(walls),
        "reactor_cpu_ms_per_request": (reactor1 - reactor0) * 1e3 / max(n, 1),
        "reactor_busy_share": (reactor1 - reactor0) / seconds,
        "server_process_cpu_ms_per_request": (process1 - process0) * 1e3 / max(n, 1),
        "profile": table,
    }
    print(
        f"{n} null programs from {args.clients} clients in {seconds:.2f} s: "
        f"{result['requests_per_s']:.1f} req/s, wall {common.fmt(result['wall_ms'])}"
    )
    print(
        f"reactor thread: {result['reactor_cpu_ms_per_request']:.2f} ms CPU per request "
        f"(busy {100 * result['reactor_busy_share']:.0f} % of the time); server process "
        f"(all threads): {result['server_process_cpu_ms_per_request']:.2f} ms per request"
    )
    if table and table["samples"]:
        print(f"reactor samples{'' if args.no_gil else ' holding the GIL'}: {table['samples']}")
        per = result["reactor_cpu_ms_per_request"]
        busy = sum(v for k, v in table["rows"].items() if not k.startswith("idle"))
        for row, count in table["rows"].items():
            share = count / table["samples"]
            ms = "" if row.startswith("idle") or not busy else f"{per * count / busy:6.3f} ms"
            print(f"  {100 * share:5.1f} %  {ms:>9}  {row}")
    common.write_result(args.output, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
