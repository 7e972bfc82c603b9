#!/usr/bin/env python3
"""
The CPU compile node against nvcc itself (issue 38), in one run.

The same saxpy kernel each time (its name made unique where a cold compile
is wanted), C{builtin.compile_cuda_binary} with C{-O3} for C{--arch}:

 - **nvcc alone**: C{nvcc -cubin -arch=ARCH -O3} on a unique source,
   C{--requests} times one after the other (p50), then C{--cores} at once
   (compiles/s);
 - **nvcc in a compile's sandbox**, the same two figures, in each shape
   the server has used: C{netns} (a network namespace of its own, the
   server's nvcc compiles before the compile sandbox and its other
   backends' still), C{compile-sh} (the host's network namespace behind
   the filter that refuses every socket, no C{/proc}, the filter opened by
   a shell that execs bwrap) and C{compile} (the same, the filter's
   descriptor mapped by the spawn, no shell: what the server runs now);
   the same command line as the server's (the nvcc backend's);
 - **kcoral**, once per C{--modes} entry (C{--sandbox bubblewrap} and
   C{--sandbox none}), each a fresh server (C{--device cpu --num-workers
   CORES}, default flags otherwise, a fresh compile cache): a null program
   on fresh workers (p50), a cold compile of a unique source (p50), a cache
   hit (the same source again, p50), and cold compiles/s from C{--cores}
   clients (under bubblewrap the server runs these compile-only programs
   itself, without a worker: docs/compilers.md, "Compile-only programs");
 - **the reference server** (C{--ref-site DIR}, installed there from
   C{.ref/*.whl} when it is not, run by C{--ref-python}, default this
   Python) on a CPU, for the compile path it offers: an uploaded Python
   function that runs nvcc and returns the image (its CPU workers have no
   compile builtin and no compile cache), with its default flags and
   C{--sandbox none}: null program, cold compile, compiles/s.

Each compiles/s phase also records the machine's CPU time per compile
(C{/proc/stat}: every process, so only on an otherwise idle machine) and,
for a server, its own process's CPU time per compile (the reactor's share).

Prints the table (with the issue's targets: cold p50 within 1.1x nvcc under
bubblewrap; cache hit p50 within 2x the null program; compiles/s at
C{cores} clients at least 0.9 x cores / nvcc p50, or where nvcc alone
cannot reach that, within 10 % of nvcc alone at the same concurrency) and writes
C{bench/results/compile_node.json} (or C{--output}).  Nothing is asserted.

    python3 bench/compile_node.py
    python3 bench/compile_node.py --ref-python ~/.cache/kcoral-tests/refserver-0.1.1/bin/python
    . .gpu/activate.sh && python3 bench/compile_node.py --ref-site /opt/kcoral-ref
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/

import common  # noqa: E402
import psutil  # noqa: E402

KERNEL = """__global__ void NAME(int n, float a, const float *x, float *y) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}
"""
NULL = common.module_program("def noop():\n    return None\n", [("noop", [], False)])

#: The reference's CPU compile path: uploaded Python that runs nvcc.
HARNESS = """
import os
import subprocess
import tempfile


def build(source, arch):
    with tempfile.TemporaryDirectory() as d:
        src, out = os.path.join(d, "kernel.cu"), os.path.join(d, "kernel.cubin")
        with open(src, "w") as f:
            f.write(source)
        subprocess.run(
            ["nvcc", "-cubin", "-arch=" + arch, "-O3", "-o", out, src],
            check=True, capture_output=True,
        )
        with open(out, "rb") as f:
            return f.read()
"""


def kernel(name: str) -> str:
    return 'extern "C" ' + KERNEL.replace("NAME", name)


def compile_program(name: str, arch: str) -> dict[str, Any]:
    return {
        "instructions": [
            {
                "op": "upload",
                "kind": "module",
                "id": "src",
                "language": "cuda",
                "source": kernel(name),
            },
            {"op": "get_function", "id": "fn", "module": {"$ref": "src"}, "name": name},
            {
                "op": "run",
                "id": "image",
                "fn": "builtin.compile_cuda_binary",
                "args": [{"$ref": "fn"}, {"arch": arch, "extra_cuda_cflags": ["-O3"]}],
            },
            {"op": "return", "key": "image", "value": {"$ref": "image"}},
        ]
    }


def harness_program(name: str, arch: str) -> dict[str, Any]:
    return common.module_program(HARNESS, [("build", [kernel(name), arch], False)])


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


def checked(reply: common.Reply) -> float:
    if reply.outcome != "COMPLETED":
        raise RuntimeError(f"{reply.outcome}: {reply.describe_error()}")
    return reply.wall_ms


# -- CPU time -----------------------------------------------------------------


def machine_cpu_ms() -> float:
    """The machine's busy CPU time so far, ms (C{/proc/stat}: all but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    busy = sum(fields) - fields[3] - fields[4]
    return busy * 1e3 / os.sysconf("SC_CLK_TCK")


def process_cpu_ms(pid: int | None) -> float:
    """A process's own CPU time so far (user and system, not its children), ms."""
    if pid is None:
        return 0.0
    times = psutil.Process(pid).cpu_times()
    return (times.user + times.system) * 1e3


class CpuMeter:
    """CPU time per compile over a phase: the machine's, and one process's own."""

    def __init__(self, pid: int | None = None) -> None:
        self.pid = pid
        self.machine = machine_cpu_ms()
        self.process = process_cpu_ms(pid)

    def per(self, count: int) -> dict[str, float]:
        out = {"machine_ms": (machine_cpu_ms() - self.machine) / count}
        if self.pid is not None:
            out["process_ms"] = (process_cpu_ms(self.pid) - self.process) / count
        return out


def at_once(count: int, workers: int, one: Any) -> tuple[float, dict[str, float]]:
    """C{count} calls of C{one()} from C{workers} threads: calls/s and CPU per call."""
    from concurrent.futures import ThreadPoolExecutor

    meter = CpuMeter()
    started = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda _: one(), range(count)))
    rate = count / (time.perf_counter() - started)
    return rate, meter.per(count)


# -- nvcc alone ---------------------------------------------------------------


def nvcc_once(nvcc: str, arch: str, tmp: str) -> float:
    d = tempfile.mkdtemp(dir=tmp)
    src, out = os.path.join(d, "kernel.cu"), os.path.join(d, "kernel.cubin")
    with open(src, "w") as f:
        f.write(kernel(unique("saxpy")))
    started = time.perf_counter()
    subprocess.run([nvcc, "-cubin", f"-arch={arch}", "-O3", "-o", out, src], check=True)
    elapsed = (time.perf_counter() - started) * 1e3
    shutil.rmtree(d)
    return elapsed


def measure_nvcc(args: argparse.Namespace) -> dict[str, Any]:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise SystemExit("no nvcc on PATH")
    with tempfile.TemporaryDirectory(prefix="kcoral-bench-nvcc-") as tmp:
        nvcc_once(nvcc, args.arch, tmp)  # page cache
        times = [nvcc_once(nvcc, args.arch, tmp) for _ in range(args.requests)]
        rate, cpu = at_once(
            args.cores * args.rounds, args.cores, lambda: nvcc_once(nvcc, args.arch, tmp)
        )
    return {"cold": common.describe(times), "rate": rate, "cpu": cpu}


# -- nvcc in a compile's sandbox ------------------------------------------------

#: The shapes of a compile's sandbox (L{measure_sandboxes}).
SHAPES = {
    "netns": "a network namespace of its own, /proc, a worker's seat "
    "(the Python compile's; nvcc's before)",
    "compile-sh": "the host's network namespace, every socket refused, no /proc, "
    "a seat with only tmp, the filter opened by a shell that execs bwrap (nvcc's before)",
    "compile": "the same, the filter's descriptor mapped by the spawn: no shell (nvcc's now)",
}


class SandboxedNvcc:
    """
    nvcc's command line as the server builds it (the nvcc backend's), run
    in a fresh seat of a bubblewrap sandbox of either shape, filters and all.
    """

    def __init__(self, tmp: str, arch: str) -> None:
        from kcoral.compilers import get_backend
        from kcoral.server.sandbox.bubblewrap import BubblewrapSandbox
        from kcoral.server.sandbox.seccomp import COMPILE_FILTER, write_filter

        self.tmp, self.arch = Path(tmp), arch
        self.backend = get_backend("nvcc")
        self.sandbox = BubblewrapSandbox(
            [],
            seccomp_path=write_filter(tmp),
            compile_seccomp_path=write_filter(tmp, COMPILE_FILTER, sockets=False),
        )
        self.count = 0

    def command(
        self, shape: str, tail: list[str] | None = None
    ) -> tuple[Path, str, list[str], dict[str, str]]:
        self.count += 1
        seat = self.tmp / f"seat-{self.count}"
        if shape == "netns":
            work = self.sandbox.prepare_seat(seat)
        else:
            work = self.sandbox.prepare_compile_seat(seat)
        inside = self.sandbox.worker_path(work)
        argv, env = self.backend.command(
            f"{inside}/kernel.cu", f"{inside}/kernel.cubin", self.arch, ("-O3",), inside
        )
        (work / "kernel.cu").write_text(kernel(unique("saxpy")))
        if shape == "netns":
            executable, full, benv = self.sandbox.run_command(tail or argv, work, env=env)
        else:
            executable, full, benv = self.sandbox.compile_command(
                tail or argv, work, env, filter_fd=shape == "compile"
            )
        return seat, executable, full, benv

    def run(self, shape: str, tail: list[str] | None = None) -> float:
        """One compile (or C{tail} instead of nvcc) in a fresh sandbox; its wall time, ms."""
        from kcoral.server.sandbox.bubblewrap import SECCOMP_FD

        seat, executable, argv, env = self.command(shape, tail)
        started = time.perf_counter()
        if shape == "compile" and self.sandbox.compile_filter is not None:
            # As the server's spawn hands it: the filter opened for this
            # compile alone.  The server maps it onto SECCOMP_FD in the
            # child; here bwrap is told the descriptor's own number, since
            # a fixed number in this threaded process could be another
            # thread's pipe.
            fd = os.open(self.sandbox.compile_filter, os.O_RDONLY | os.O_CLOEXEC)
            try:
                argv = list(argv)
                at = argv.index("--seccomp") + 1
                assert argv[at] == str(SECCOMP_FD), argv[: at + 1]
                argv[at] = str(fd)
                subprocess.run(
                    argv,
                    executable=executable,
                    env=env,
                    check=True,
                    capture_output=True,
                    pass_fds=(fd,),
                )
            finally:
                os.close(fd)
        else:
            subprocess.run(argv, executable=executable, env=env, check=True, capture_output=True)
        elapsed = (time.perf_counter() - started) * 1e3
        if tail is None and not (seat / "work" / "kernel.cubin").is_file():
            raise RuntimeError(f"nvcc in the {shape} sandbox wrote no image")
        shutil.rmtree(seat)
        return elapsed


def measure_sandboxes(args: argparse.Namespace) -> dict[str, Any]:
    """
    nvcc in a compile's sandbox of each shape (L{SHAPES}): the sandbox's
    start (C{/bin/true}) and nvcc one at a time, interleaved, then nvcc
    C{--cores} at once.
    """
    if shutil.which("bwrap") is None:
        return {}
    with tempfile.TemporaryDirectory(prefix="kcoral-bench-sandboxes-") as tmp:
        runner = SandboxedNvcc(tmp, args.arch)
        starts: dict[str, list[float]] = {shape: [] for shape in SHAPES}
        cold: dict[str, list[float]] = {shape: [] for shape in SHAPES}
        for shape in SHAPES:
            runner.run(shape)  # page cache
        for _ in range(args.requests):
            for shape in SHAPES:
                starts[shape].append(runner.run(shape, ["/bin/true"]))
                cold[shape].append(runner.run(shape))
        results: dict[str, Any] = {}
        for shape in SHAPES:
            rate, cpu = at_once(
                args.cores * args.rounds, args.cores, lambda shape=shape: runner.run(shape)
            )
            results[shape] = {
                "what": SHAPES[shape],
                "start": common.describe(starts[shape]),
                "cold": common.describe(cold[shape]),
                "rate": rate,
                "cpu": cpu,
            }
    return results


# -- the pieces -------------------------------------------------------------------


def timed(argv: list[str], env: dict[str, str] | None = None, **kw: Any) -> float:
    started = time.perf_counter()
    subprocess.run(argv, env=env, check=True, capture_output=True, **kw)
    return (time.perf_counter() - started) * 1e3


def measure_pieces(args: argparse.Namespace) -> dict[str, Any]:
    """
    The suspects of issue 38, each alone: what the old paths paid per
    request and the new ones pay once (or not at all).
    """
    from kcoral.compilers.cache import CompileCache, cache_key

    nvcc = shutil.which("nvcc") or "nvcc"
    n = args.requests
    py = sys.executable
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(common.ROOT), env.get("PYTHONPATH")]))
    pieces: dict[str, Any] = {
        "nvcc --version": common.describe([timed([nvcc, "--version"]) for _ in range(n)]),
        "python start": common.describe([timed([py, "-c", "pass"]) for _ in range(n)]),
        "python + import kcoral.compilers": common.describe(
            [timed([py, "-c", "import kcoral.compilers"], env) for _ in range(n)]
        ),
        "python + plugin scan (backends())": common.describe(
            [timed([py, "-c", "import kcoral.compilers as c; c.backends()"], env) for _ in range(n)]
        ),
    }
    with tempfile.TemporaryDirectory(prefix="kcoral-bench-pieces-") as tmp:
        image = os.urandom(16 * 1024)
        cache = CompileCache(os.path.join(tmp, "cache"))
        source = kernel("saxpy")
        versions = {"nvcc": "13.0.88", "cuda": "13.0"}
        started = time.perf_counter()
        for _ in range(1000):
            key = cache_key(source, args.arch, ("-O3",), "nvcc", versions)
        pieces["cache key (sha256 of the request)"] = {
            "n": 1000,
            "p50": (time.perf_counter() - started),
        }
        cache.put(key, image, 0.2)
        started = time.perf_counter()
        for _ in range(1000):
            cache.read(key)
        pieces["cache read (16 KiB image, sha256 checked)"] = {
            "n": 1000,
            "p50": (time.perf_counter() - started),
        }
    return pieces


# -- a server -----------------------------------------------------------------


def measure_server(
    host: str, port: int, args: argparse.Namespace, program: Any, hits: bool, pid: int | None
) -> dict[str, Any]:
    conn = common.Connection(host, port)
    try:
        for _ in range(2):
            checked(conn.execute(NULL))
        null = [checked(conn.execute(NULL)) for _ in range(args.requests)]
        checked(conn.execute(program(unique("warm"), args.arch)))
        cold = [
            checked(conn.execute(program(unique("saxpy"), args.arch))) for _ in range(args.requests)
        ]
        hit: list[float] = []
        if hits:
            same = program(unique("saxpy"), args.arch)
            checked(conn.execute(same))
            hit = [checked(conn.execute(same)) for _ in range(args.requests)]
    finally:
        conn.close()
    count = args.cores * args.rounds
    meter = CpuMeter(pid)
    _, seconds = common.run_concurrent(
        host,
        port,
        args.cores,
        count,
        lambda c, _i: checked(c.execute(program(unique("saxpy"), args.arch))),
    )
    return {
        "null": common.describe(null),
        "cold": common.describe(cold),
        "hit": common.describe(hit),
        "rate": count / seconds,
        "cpu": meter.per(count),
    }


def measure_kcoral(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    from kcoral.testing.live_server import ServerProcess

    with tempfile.TemporaryDirectory(prefix="kcoral-bench-compile-") as tmp:
        flags = ["--device", "cpu", "--num-workers", str(args.cores), "--sandbox", mode]
        flags += ["--log-dir", "", "--disk-cache-dir", os.path.join(tmp, "files")]
        flags += shlex.split(args.server_flags)
        log = Path(tmp) / "server.log"
        server = ServerProcess(flags, log_path=log)
        try:
            server.start(timeout=args.spawn_timeout)
        except RuntimeError:
            sys.stderr.write(log.read_text(errors="replace")[-3000:])
            raise
        try:
            pid = server.process.pid if server.process is not None else None
            result = measure_server("127.0.0.1", server.port, args, compile_program, True, pid)
        finally:
            server.stop()
    result["flags"] = " ".join(flags[:-2])
    return result


def ensure_reference_site(site: str) -> None:
    """The reference 0.1.1 in C{site}, installed from C{.ref/*.whl} unless it is there."""
    if os.path.isdir(os.path.join(site, "kcoral")):
        return
    wheels = sorted(str(p) for p in (common.ROOT / ".ref").glob("*.whl"))
    if not wheels:
        raise SystemExit(
            f"no reference in {site} and no .ref/*.whl to install it from "
            "(mkdir -p .ref && cp ../shared/ref/wheels/*.whl .ref/, then carry .ref)"
        )
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
    subprocess.run([*pip, "--no-compile", "--target", site, *wheels], check=True)


def measure_reference(args: argparse.Namespace) -> dict[str, Any]:
    from kcoral.testing.live_server import free_port, request

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "KCORAL_"))}
    env["TVM_FFI_DISABLE_TORCH_C_DLPACK"] = "1"  # (as the reference's own recipe runs it)
    python = [args.ref_python, "-P", "-s"]
    if args.ref_site:
        env["PYTHONPATH"] = args.ref_site
    else:
        python = [args.ref_python, "-I"]
    flags = ["--device", "cpu", "--num-workers", str(args.cores), "--sandbox", "none"]
    with tempfile.TemporaryDirectory(prefix="kcoral-bench-ref-") as tmp:
        argv = [*python, "-m", "kcoral", "server", *flags, "--log-dir", os.path.join(tmp, "logs")]
        argv += ["--host", "127.0.0.1", "--port", str(port)]
        with open(os.path.join(tmp, "server.log"), "wb") as log:
            process = subprocess.Popen(argv, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                deadline = time.monotonic() + args.spawn_timeout
                while True:
                    if process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("the reference server did not start")
                    try:
                        if request(port, "GET", "/health", timeout=2).status == 200:
                            break
                    except OSError:
                        pass
                    time.sleep(0.2)
                result = measure_server(
                    "127.0.0.1", port, args, harness_program, False, process.pid
                )
            finally:
                process.terminate()
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
    result["flags"] = " ".join(flags) + " (its compile path: uploaded Python running nvcc)"
    return result


# -- the table ------------------------------------------------------------------


def table(results: dict[str, Any], cores: int) -> str:
    nvcc = results["nvcc"]
    floor = nvcc["cold"]["p50"]
    ideal = cores / (floor / 1e3)
    columns = [k for k in ("bubblewrap", "none", "reference") if k in results]

    def cell(name: str, row: str) -> str:
        r = results[name]
        if row == "cold":
            return f"{r['cold']['p50']:.0f} ms ({r['cold']['p50'] / floor:.2f}x nvcc)"
        if row == "hit":
            if not r["hit"].get("n"):
                return "— (no compile cache)"
            return f"{r['hit']['p50']:.1f} ms ({r['hit']['p50'] / r['null']['p50']:.2f}x null)"
        if row == "rate":
            return f"{r['rate']:.2f} ({r['rate'] / ideal:.2f} of {ideal:.2f})"
        if row == "cpu":
            return f"{r['cpu']['machine_ms']:.0f} ms"
        if row == "parent":
            return f"{r['cpu'].get('process_ms', float('nan')):.1f} ms"
        return f"{r['null']['p50']:.1f} ms"

    head = ["figure", *(f"`--sandbox {c}`" if c != "reference" else "reference" for c in columns)]
    head.append("nvcc alone")
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    rows = [
        ("cold compile, unique source, p50", "cold", f"{floor:.0f} ms"),
        ("cache hit (same source again), p50", "hit", "—"),
        (f"cold compiles/s at {cores} clients", "rate", f"{nvcc['rate']:.2f}"),
        ("null program, p50", "null", "—"),
        (
            f"machine CPU per cold compile at {cores} clients",
            "cpu",
            f"{nvcc['cpu']['machine_ms']:.0f} ms",
        ),
        ("the server process's own CPU per cold compile", "parent", "—"),
    ]
    for label, key, alone in rows:
        lines.append("| " + " | ".join([label, *(cell(c, key) for c in columns), alone]) + " |")
    lines.append("")
    sandboxes = results.get("sandboxes") or {}
    if sandboxes:
        lines.append(
            f"| nvcc's command line | sandbox start (/bin/true), p50 | cold compile, p50 "
            f"| compiles/s, {cores} at once | machine CPU per compile |"
        )
        lines.append("| --- | --- | --- | --- | --- |")
        lines.append(
            f"| alone | — | {floor:.0f} ms | {nvcc['rate']:.2f} ({nvcc['rate'] / ideal:.2f}) "
            f"| {nvcc['cpu']['machine_ms']:.0f} ms |"
        )
        for shape, r in sandboxes.items():
            lines.append(
                f"| sandbox `{shape}`: {r['what']} | {r['start']['p50']:.1f} ms "
                f"| {r['cold']['p50']:.0f} ms ({r['cold']['p50'] / floor:.2f}x) "
                f"| {r['rate']:.2f} ({r['rate'] / ideal:.2f}) | {r['cpu']['machine_ms']:.0f} ms |"
            )
        lines.append("")
    lines.append("targets (issue 38):")
    if "bubblewrap" in results:
        b = results["bubblewrap"]
        ratio = b["cold"]["p50"] / floor
        lines.append(f"  cold p50 under bubblewrap / nvcc: {ratio:.2f} (target <= 1.10)")
    for c in ("bubblewrap", "none"):
        if c in results:
            r = results[c]
            lines.append(
                f"  cache hit p50 / null p50, {c}: {r['hit']['p50'] / r['null']['p50']:.2f} "
                "(target <= 2.00)"
            )
            lines.append(
                f"  compiles/s / (cores / nvcc p50), {c}: {r['rate'] / ideal:.2f} (target >= 0.90)"
            )
            lines.append(
                f"  compiles/s / nvcc alone {cores} at once, {c}: {r['rate'] / nvcc['rate']:.2f} "
                "(target >= 0.90 where nvcc alone is below the formula)"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--requests", type=int, default=8, help="requests per p50 figure")
    parser.add_argument("--rounds", type=int, default=4, help="compiles per client for compiles/s")
    parser.add_argument(
        "--cores", type=int, default=os.cpu_count() or 1, help="clients and workers"
    )
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--modes", default="bubblewrap,none", help="kcoral sandbox modes")
    parser.add_argument("--server-flags", default="", help="more kcoral server flags")
    parser.add_argument(
        "--ref-python",
        help="the reference server's interpreter (default with --ref-site: this one)",
    )
    parser.add_argument(
        "--ref-site",
        help="PYTHONPATH holding the reference package (installed from .ref/*.whl if missing)",
    )
    parser.add_argument("--spawn-timeout", type=float, default=180.0)
    parser.add_argument("--label", default="")
    parser.add_argument("--output", default=str(common.RESULTS / "compile_node.json"))
    args = parser.parse_args()
    if args.ref_site:
        ensure_reference_site(args.ref_site)  # (before anything is measured)
        args.ref_python = args.ref_python or sys.executable

    pieces = measure_pieces(args)
    for label, stats in pieces.items():
        print(f"{label}: p50 {stats['p50']:.3f} ms")
    results: dict[str, Any] = {"nvcc": measure_nvcc(args)}
    print(f"nvcc alone: {common.fmt(results['nvcc']['cold'])}; {results['nvcc']['rate']:.2f}/s")
    results["sandboxes"] = measure_sandboxes(args)
    for shape, r in results["sandboxes"].items():
        print(f"nvcc in the {shape} sandbox: {common.fmt(r['cold'])}; {r['rate']:.2f}/s")
        print(f"  sandbox start {common.fmt(r['start'])}")
    for mode in [m for m in args.modes.split(",") if m]:
        results[mode] = measure_kcoral(mode, args)
        r = results[mode]
        print(f"kcoral --sandbox {mode}: cold {common.fmt(r['cold'])}")
        print(f"  hit {common.fmt(r['hit'])}; null {common.fmt(r['null'])}; {r['rate']:.2f}/s")
    if args.ref_python:
        results["reference"] = measure_reference(args)
        r = results["reference"]
        print(f"reference: cold {common.fmt(r['cold'])}; null {common.fmt(r['null'])}")
    text = table(results, args.cores)
    print()
    print(text)
    common.write_result(
        args.output,
        {
            "benchmark": "compile_node",
            "label": args.label,
            "cores": args.cores,
            "arch": args.arch,
            "requests": args.requests,
            "results": results,
            "pieces": pieces,
            "table": text,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
