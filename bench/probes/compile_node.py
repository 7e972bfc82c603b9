#!/usr/bin/env python3
"""
The CPU compile node against nvcc itself (issue 38), in one run.

The same saxpy kernel each time (its name made unique where a cold compile
is wanted), C{builtin.compile_cuda_binary} with C{-O3} for C{--arch}:

 - **nvcc alone**: C{nvcc -cubin -arch=ARCH -O3} on a unique source,
   C{--requests} times one after the other (p50), then C{--cores} at once
   (compiles/s);
 - **kcoral**, once per C{--modes} entry (C{--sandbox bubblewrap} and
   C{--sandbox none}), each a fresh server (C{--device cpu --num-workers
   CORES}, default flags otherwise, a fresh compile cache): a null program
   on fresh workers (p50), a cold compile of a unique source (p50), a cache
   hit (the same source again, p50), and cold compiles/s from C{--cores}
   clients;
 - **the reference server** (C{--ref-python}, optionally C{--ref-site} for
   its C{PYTHONPATH}) on a CPU, for the compile path it offers: an uploaded
   Python function that runs nvcc and returns the image (its CPU workers
   have no compile builtin and no compile cache), with its default flags
   and C{--sandbox none}: null program, cold compile, compiles/s.

Prints the table (with the issue's targets: cold p50 within 1.1x nvcc under
bubblewrap; cache hit p50 within 2x the null program; compiles/s at
C{cores} clients at least 0.9 x cores / nvcc p50) and writes
C{bench/results/compile_node.json} (or C{--output}).  Nothing is asserted.

    python3 bench/probes/compile_node.py
    python3 bench/probes/compile_node.py --ref-python ~/.cache/kcoral-tests/refserver-0.1.1/bin/python
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/

import common  # noqa: E402

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
    from concurrent.futures import ThreadPoolExecutor

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise SystemExit("no nvcc on PATH")
    with tempfile.TemporaryDirectory(prefix="kcoral-bench-nvcc-") as tmp:
        nvcc_once(nvcc, args.arch, tmp)  # page cache
        times = [nvcc_once(nvcc, args.arch, tmp) for _ in range(args.requests)]
        count = args.cores * args.rounds
        started = time.perf_counter()
        with ThreadPoolExecutor(args.cores) as pool:
            list(pool.map(lambda _: nvcc_once(nvcc, args.arch, tmp), range(count)))
        rate = count / (time.perf_counter() - started)
    return {"cold": common.describe(times), "rate": rate}


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
    from kcoral.server.sandbox.bubblewrap import BubblewrapSandbox

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
        if shutil.which("bwrap"):
            sandbox = BubblewrapSandbox([])
            for i, (label, tail) in enumerate(
                [
                    ("bubblewrap sandbox start (/bin/true)", ["/bin/true"]),
                    (
                        "bubblewrap + python + plugin scan",
                        [py, "-c", "import kcoral.compilers as c; c.backends()"],
                    ),
                ]
            ):
                times = []
                for j in range(n):
                    work = sandbox.prepare_seat(Path(tmp) / f"seat-{i}-{j}")
                    executable, argv, benv = sandbox.run_command(tail, work)
                    times.append(timed(argv, benv, executable=executable))
                pieces[label] = common.describe(times)
    return pieces


# -- a server -----------------------------------------------------------------


def measure_server(
    host: str, port: int, args: argparse.Namespace, program: Any, hits: bool
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
            result = measure_server("127.0.0.1", server.port, args, compile_program, True)
        finally:
            server.stop()
    result["flags"] = " ".join(flags[:-2])
    return result


def measure_reference(args: argparse.Namespace) -> dict[str, Any]:
    from kcoral.testing.live_server import free_port, request

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "KCORAL_"))}
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
                result = measure_server("127.0.0.1", port, args, harness_program, False)
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
        return f"{r['null']['p50']:.1f} ms"

    head = ["figure", *(f"`--sandbox {c}`" if c != "reference" else "reference" for c in columns)]
    head.append("nvcc alone")
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    rows = [
        ("cold compile, unique source, p50", "cold", f"{floor:.0f} ms"),
        ("cache hit (same source again), p50", "hit", "—"),
        (f"cold compiles/s at {cores} clients", "rate", f"{nvcc['rate']:.2f}"),
        ("null program, p50", "null", "—"),
    ]
    for label, key, alone in rows:
        lines.append("| " + " | ".join([label, *(cell(c, key) for c in columns), alone]) + " |")
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
    parser.add_argument("--ref-python", help="the reference server's interpreter")
    parser.add_argument("--ref-site", help="PYTHONPATH holding the reference package")
    parser.add_argument("--spawn-timeout", type=float, default=180.0)
    parser.add_argument("--label", default="")
    parser.add_argument("--output", default=str(common.RESULTS / "compile_node.json"))
    args = parser.parse_args()

    pieces = measure_pieces(args)
    for label, stats in pieces.items():
        print(f"{label}: p50 {stats['p50']:.3f} ms")
    results: dict[str, Any] = {"nvcc": measure_nvcc(args)}
    print(f"nvcc alone: {common.fmt(results['nvcc']['cold'])}; {results['nvcc']['rate']:.2f}/s")
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
