#!/usr/bin/env python3
"""
A joined node's pool path against direct /execute (issue 37, node side).

A node that joins a pool (C{kcoral server --join}) runs each job through
its server's execute pipeline in process (kcoral/server/join/runner.py):
no loopback HTTP request, the blobs it lacks streamed into its caches,
the result posted streamed from the worker's buffers.  This measures, on
a CPU node with a null program, one request at a time:

  - C{health_ms}: C{GET /health} on loopback, one HTTP round trip with a
    trivial handler (what the loopback hop the node no longer takes cost);
  - C{execute_ms}: C{POST /execute} of the null program on loopback, on
    one keep-alive connection (what a client next to the node sees);
  - C{pool_ms}: the whole pool path without the gateway's client side: a
    job published on NATS (L{kcoral.testing.pool.PoolStandIn}) until its
    result is posted back: pull, claim, the in-process pipeline, result
    POST (the stand-in's own NATS client and HTTP server included);
  - C{node_ms}: the node's own part of it, claim to result posted (the
    C{elapsed_ms} of its C{join_job_finished} events), split into
    C{node_answer_ms} (the in-process pipeline: seat, worker, rendering)
    and C{node_post_ms} (the result POST to the stand-in).

Prints p50/p99 of each and C{pool_ms} p50 less C{execute_ms} p50, and
writes C{bench/results/node_loopback.json} (or C{--output}).  Needs
nats-server (C{--nats-server PATH}, else the one on C{PATH}; Debian:
C{apt-get install nats-server}).

    python3 bench/node_loopback.py --requests 300
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

from kcoral.testing.live_server import ServerProcess  # noqa: E402
from kcoral.testing.nats import NatsServer  # noqa: E402
from kcoral.testing.pool import PoolStandIn  # noqa: E402

SOURCE = "def noop():\n    return None\n"
PROGRAM = common.module_program(SOURCE, [("noop", [], False)])


def node_times(log_dir: Path, jobs: set[str]) -> dict[str, list[float]]:
    """
    The C{elapsed_ms}, C{answer_ms} and C{post_ms} of the node's
    C{join_job_finished} events of C{jobs}.
    """
    (run,) = (log_dir / "runs").iterdir()
    found: dict[str, list[float]] = {"elapsed_ms": [], "answer_ms": [], "post_ms": []}
    for line in (run / "events.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event.get("event") == "join_job_finished" and event.get("job") in jobs:
            for key, values in found.items():
                values.append(float(event[key]))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--nats-server", help="the nats-server executable [default: on PATH]")
    parser.add_argument(
        "--output", default=str(Path(__file__).parent / "results" / "node_loopback.json")
    )
    args = parser.parse_args()
    if args.nats_server:
        os.environ["PATH"] = (
            str(Path(args.nats_server).resolve().parent) + os.pathsep + os.environ["PATH"]
        )

    with tempfile.TemporaryDirectory() as tmp, NatsServer(node_ids=("bench-node",)) as nats:
        log_dir = Path(tmp) / "logs"
        with PoolStandIn(nats) as pool:
            node = ServerProcess(
                [
                    "--device",
                    "cpu",
                    "--sandbox",
                    "none",
                    "--log-dir",
                    str(log_dir),
                    "--disk-cache-dir",
                    "",
                    "--num-workers",
                    "1",
                    "--max-requests-per-worker",
                    "0",
                    "--join",
                    nats.url,
                    "--node-id",
                    "bench-node",
                    "--credentials",
                    str(nats.credentials_file("bench-node")),
                ],
                log_path=Path(tmp) / "node.log",
            ).start()
            try:
                compat = pool.wait_presence("bench-node").compat
                conn = common.Connection("127.0.0.1", node.port)
                health: list[float] = []
                execute: list[float] = []
                for i in range(args.warmup + args.requests):
                    started = time.perf_counter()
                    conn.health()
                    elapsed = (time.perf_counter() - started) * 1000.0
                    reply = conn.execute(PROGRAM)
                    if reply.outcome != "COMPLETED":
                        raise RuntimeError(reply.describe_error())
                    if i >= args.warmup:
                        health.append(elapsed)
                        execute.append(reply.wall_ms)
                conn.close()
                pooled: list[float] = []
                measured: set[str] = set()
                text = json.dumps(PROGRAM)
                for i in range(args.warmup + args.requests):
                    started = time.perf_counter()
                    job = pool.publish(text, compat)
                    result = pool.wait_result(job.job)
                    elapsed = (time.perf_counter() - started) * 1000.0
                    if result.status != 200:
                        raise RuntimeError(result.body[:200])
                    if i >= args.warmup:
                        pooled.append(elapsed)
                        measured.add(job.job)
            finally:
                node.stop()
            own = node_times(log_dir, measured)
    summary: dict[str, object] = {
        "requests": args.requests,
        "path": "in-process",
        "health_ms": common.describe(health),
        "execute_ms": common.describe(execute),
        "pool_ms": common.describe(pooled),
        "node_ms": common.describe(own["elapsed_ms"]),
        "node_answer_ms": common.describe(own["answer_ms"]),
        "node_post_ms": common.describe(own["post_ms"]),
    }
    for key in ("health_ms", "execute_ms", "pool_ms", "node_ms", "node_answer_ms", "node_post_ms"):
        stats = summary[key]
        assert isinstance(stats, dict)
        print(f"{key:14s} p50 {stats['p50']:7.3f}  p99 {stats['p99']:7.3f}")
    pool_p50 = summary["pool_ms"]["p50"]  # type: ignore[index]
    execute_p50 = summary["execute_ms"]["p50"]  # type: ignore[index]
    summary["pool_over_execute_p50_ms"] = round(pool_p50 - execute_p50, 3)
    print(f"pool path over direct /execute: {summary['pool_over_execute_p50_ms']:+.3f} ms p50")
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
