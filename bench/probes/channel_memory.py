"""
Server memory and C{/health} latency while programs flood the control
channel (issue 32, "channel memory").

C{--workers} (4) programs at once each write, on their worker's fd 4, an
outcome frame whose JSON header is C{--zeros} (40 million) zeros long
(about 80 MB of dense JSON, what the old server decoded into about 0.8 GB
per worker); meanwhile a thread asks C{/health} every 50 ms.  Then the
same number of honest programs return C{--text-mib} (6) MiB strings at
once.  Records the server process's peak RSS over its baseline (sampled
every 5 ms), the slowest C{/health}, and each answer's status.

Spawns a bubblewrap CPU server by default (attack programs only run under
the sandbox)::

    .venv/bin/python bench/probes/channel_memory.py
    .venv/bin/python bench/probes/channel_memory.py --spawn "--device cpu --sandbox bubblewrap \
        --log-dir '' --num-workers 8 --max-channel-bytes 268435456" --workers 8
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/

import common  # noqa: E402
from result_memory import Sampler  # noqa: E402

from tests.reliability.test_channel_memory import DENSE_OUTCOME

DEFAULT_SPAWN = "--device cpu --sandbox bubblewrap --log-dir '' --num-workers 4"


TEXT = "def text(n):\n    return 'y' * n\n"


class HealthProbe:
    """Asks C{/health} every C{interval} seconds in a thread; keeps each latency."""

    def __init__(self, host: str, port: int, interval: float = 0.05) -> None:
        self.host, self.port, self.interval = host, port, interval
        self.latencies_ms: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        conn = common.Connection(self.host, self.port, timeout=60)
        while not self._stop.is_set():
            try:
                self.latencies_ms.append(conn.request("GET", "/health").wall_ms)
            except OSError:
                self.failures += 1
                conn.close()
            time.sleep(self.interval)
        conn.close()

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def phase(host: str, port: int, pid: int, workers: int, program: dict[str, Any]) -> dict[str, Any]:
    def one(_: int) -> common.Reply:
        conn = common.Connection(host, port, timeout=600)
        try:
            return conn.execute(program)
        finally:
            conn.close()

    sampler = Sampler(pid)
    started = time.perf_counter()
    with sampler, HealthProbe(host, port) as probe, ThreadPoolExecutor(workers) as pool:
        replies = list(pool.map(one, range(workers)))
    wall = time.perf_counter() - started
    statuses: dict[str, int] = {}
    for reply in replies:
        kind = (reply.result.get("error") or {}).get("kind") if reply.status != 200 else "ok"
        key = f"{reply.status} {kind}"
        statuses[key] = statuses.get(key, 0) + 1
    return {
        "wall_s": wall,
        "statuses": statuses,
        "peak_rss_mib": sampler.peak_kib / 1024,
        "health_max_ms": max(probe.latencies_ms, default=None),
        "health_p50_ms": common.percentile(probe.latencies_ms, 50) if probe.latencies_ms else None,
        "health_probes": len(probe.latencies_ms),
        "health_failures": probe.failures,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_server_args(parser, "channel_memory")
    parser.add_argument("--pid", type=int, help="the server's pid (with --url)")
    parser.add_argument("--workers", type=int, default=4, help="programs at once")
    parser.add_argument("--zeros", type=int, default=40_000_000, help="zeros in each frame")
    parser.add_argument("--text-mib", type=int, default=6, help="MiB of each honest result")
    args = parser.parse_args(argv)
    if args.spawn is None and args.url == common.DEFAULT_URL and args.pid is None:
        args.spawn = DEFAULT_SPAWN
    with common.server_from_args(args) as (host, port, description):
        pid = args.pid or _server_pid(port)
        if pid is None:
            sys.stderr.write("cannot find the server's pid: give --pid\n")
            return 2
        baseline = _rss_mib(pid)
        dense = phase(
            host,
            port,
            pid,
            args.workers,
            common.module_program(DENSE_OUTCOME, [("send", [args.zeros], False)]),
        )
        honest = phase(
            host,
            port,
            pid,
            args.workers,
            common.module_program(TEXT, [("text", [args.text_mib << 20], False)]),
        )
        result = {
            "server": description,
            "label": args.label,
            "workers": args.workers,
            "zeros": args.zeros,
            "baseline_rss_mib": baseline,
            "dense": {**dense, "grown_mib": dense["peak_rss_mib"] - baseline},
            "honest": {**honest, "grown_mib": honest["peak_rss_mib"] - baseline},
            "info": common.server_info(host, port),
        }
    for name in ("dense", "honest"):
        r = result[name]
        print(
            f"{name}: {r['statuses']} in {r['wall_s']:.1f} s; server grew {r['grown_mib']:.0f} MiB "
            f"over {baseline:.0f}; /health max {r['health_max_ms']:.0f} ms "
            f"(p50 {r['health_p50_ms']:.1f} ms, {r['health_probes']} probes, "
            f"{r['health_failures']} failed)"
        )
    common.write_result(args.output, result)
    return 0


def _rss_mib(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / (1 << 20)


def _server_pid(port: int) -> int | None:
    """The pid of the process listening on C{port} (our spawned server)."""
    import psutil

    for conn in psutil.net_connections("tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == "LISTEN" and conn.pid:
            return int(conn.pid)
    return None


if __name__ == "__main__":
    sys.exit(main())
