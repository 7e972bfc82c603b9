"""
Peak memory of the server process while it returns one large result.

A program makes C{--size-mib} (200) MiB of bytes inside its worker and
returns them; the benchmark reads the response (at full speed, or at
C{--read-mibps}) and records the server process's resident memory: before
the request, its peak during the request (the kernel's high-water mark
C{VmHWM}, reset just before the request through C{/proc/PID/clear_refs};
also sampled every 5 ms from C{VmRSS}), and after.  The workers' memory is
not counted: the question is what the server itself holds for a result
(issue 18 measured about 594 MB of peak for a 200 MB result, nearly three
copies).

CPU only: it spawns its own server (C{--spawn}, a CPU server without a
sandbox by default), or measures a running one given C{--url} and
C{--pid}.  Prints the numbers and writes
C{bench/results/result_memory.json}::

    .venv/bin/python bench/result_memory.py
    .venv/bin/python bench/result_memory.py --size-mib 200 --repeat 3 --read-mibps 100
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import shlex
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import common

DEFAULT_SPAWN = (
    "--device cpu --num-workers 1 --sandbox none --log-dir '' "
    "--max-response-bytes 1073741824 --max-requests-per-worker 0"
)

SOURCE = "def make(n):\n    return b'\\x5a' * n\n"


def status_kib(pid: int, key: str) -> int | None:
    """A C{kB} field of C{/proc/PID/status} (C{VmRSS}, C{VmHWM}), in KiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak(pid: int) -> bool:
    """Reset the process's C{VmHWM} to its current RSS (Linux 4.0+)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class Sampler:
    """Samples C{VmRSS} every C{interval} seconds in a thread; keeps the maximum."""

    def __init__(self, pid: int, interval: float = 0.005) -> None:
        self.pid, self.interval = pid, interval
        self.peak_kib = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = status_kib(self.pid, "VmRSS")
            if rss is not None:
                self.peak_kib = max(self.peak_kib, rss)
                self.samples += 1
            time.sleep(self.interval)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def fetch(host: str, port: int, size: int, read_mibps: float) -> dict[str, Any]:
    """Run the program; read its response in 1 MiB pieces, hashing, never keeping it."""
    program = common.module_program(SOURCE, [("make", [size], True)])
    content_type, body = common.multipart_body(program)
    connection = http.client.HTTPConnection(host, port, timeout=600)
    started = time.perf_counter()
    try:
        connection.request("POST", "/execute", body=body, headers={"Content-Type": content_type})
        response = connection.getresponse()
        digest = hashlib.sha256()
        received = 0
        first_byte = None
        while True:
            piece = response.read(1 << 20)
            if not piece:
                break
            if first_byte is None:
                first_byte = time.perf_counter() - started
            digest.update(piece)
            received += len(piece)
            if read_mibps > 0:
                # Pace the reads: the client is slower than the server.
                due = started + (received / (1 << 20)) / read_mibps
                time.sleep(max(0.0, due - time.perf_counter()))
        return {
            "http_status": response.status,
            "response_bytes": received,
            "first_byte_s": first_byte,
            "wall_s": time.perf_counter() - started,
        }
    finally:
        connection.close()


@contextlib.contextmanager
def server(args: argparse.Namespace) -> Iterator[tuple[str, int, int, str]]:
    """Yield C{(host, port, server pid, description)}."""
    if args.url is not None:
        if args.pid is None:
            raise SystemExit("--url needs --pid (the server process to measure)")
        parsed = urllib.parse.urlsplit(args.url)
        yield parsed.hostname or "127.0.0.1", parsed.port or 80, args.pid, args.url
        return
    from kcoral.testing.live_server import ServerProcess

    process = ServerProcess(shlex.split(args.spawn))
    process.start(timeout=180)
    try:
        assert process.process is not None
        yield "127.0.0.1", process.port, process.process.pid, f"spawned: {args.spawn}"
    finally:
        process.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=200, help="result size (MiB)")
    parser.add_argument("--repeat", type=int, default=3, help="measured requests")
    parser.add_argument(
        "--read-mibps", type=float, default=0.0, help="pace the client's reads (0: full speed)"
    )
    parser.add_argument("--spawn", default=DEFAULT_SPAWN, help="flags of the server to start")
    parser.add_argument("--url", help="measure a running server instead (needs --pid)")
    parser.add_argument("--pid", type=int, help="the running server's process id")
    parser.add_argument("--label", default="", help="free text recorded in the JSON")
    parser.add_argument("--output", default=str(common.RESULTS / "result_memory.json"))
    args = parser.parse_args(argv)
    if not Path("/proc/self/status").exists():
        raise SystemExit("needs Linux /proc")

    size = args.size_mib << 20
    runs = []
    with server(args) as (host, port, pid, where):
        print(f"server pid {pid} ({where}); result {args.size_mib} MiB, {args.repeat} requests")
        # Unrecorded warm-up with a small result: imports, the worker's first run.
        warm = fetch(host, port, 1 << 20, 0.0)
        if warm["http_status"] != 200:
            raise SystemExit(f"warm-up answered HTTP {warm['http_status']}")
        for n in range(args.repeat):
            time.sleep(0.5)
            before = status_kib(pid, "VmRSS") or 0
            hwm_reset = reset_peak(pid)
            with Sampler(pid) as sampler:
                outcome = fetch(host, port, size, args.read_mibps)
            hwm = status_kib(pid, "VmHWM") if hwm_reset else None
            time.sleep(0.5)
            after = status_kib(pid, "VmRSS") or 0
            if outcome["http_status"] != 200 or outcome["response_bytes"] < size:
                raise SystemExit(f"request {n}: {outcome}")
            peak_kib = max(hwm or 0, sampler.peak_kib)
            run = {
                **outcome,
                "rss_before_mib": before / 1024,
                "peak_rss_mib": peak_kib / 1024,
                "peak_hwm_mib": None if hwm is None else hwm / 1024,
                "peak_sampled_mib": sampler.peak_kib / 1024,
                "samples": sampler.samples,
                "peak_over_before_mib": (peak_kib - before) / 1024,
                "peak_over_result": (peak_kib - before) / 1024 / args.size_mib,
                "rss_after_mib": after / 1024,
            }
            runs.append(run)
            print(
                f"  request {n}: RSS before {run['rss_before_mib']:.0f} MiB, peak "
                f"{run['peak_rss_mib']:.0f} MiB (+{run['peak_over_before_mib']:.0f} MiB = "
                f"{run['peak_over_result']:.2f}x the result), after "
                f"{run['rss_after_mib']:.0f} MiB; {outcome['wall_s']:.2f} s"
            )
    worst = max(runs, key=lambda r: r["peak_over_before_mib"])
    print(
        f"peak RSS of the server: {worst['peak_rss_mib']:.0f} MiB "
        f"(+{worst['peak_over_before_mib']:.0f} MiB over {worst['rss_before_mib']:.0f} MiB "
        f"before, {worst['peak_over_result']:.2f}x a {args.size_mib} MiB result)"
    )
    common.write_result(
        args.output,
        {
            "benchmark": "result_memory",
            "label": args.label,
            "server": where,
            "size_mib": args.size_mib,
            "read_mibps": args.read_mibps or None,
            "peak_rss_mib": worst["peak_rss_mib"],
            "peak_over_before_mib": worst["peak_over_before_mib"],
            "runs": runs,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
