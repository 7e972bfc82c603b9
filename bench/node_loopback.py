#!/usr/bin/env python3
"""
What a joined node's loopback hop costs (issue 37, node side).

A node that joins a pool (C{kcoral server --join}) runs each job by POSTing
it to its own C{/execute} on loopback (kcoral/server/join/local.py), so a
job takes exactly the path a client's request takes.  This measures, on a
CPU node with a null program, one request at a time on one keep-alive
connection:

  - C{health_ms}: C{GET /health} on loopback, the HTTP round trip with a
    trivial handler (an upper bound on what calling the handler in process
    would save);
  - C{execute_ms}: C{POST /execute} of the null program on loopback (what a
    client next to the node would see);
  - C{pool_ms}: the whole pool path without the gateway's client side: a job
    published on NATS (L{kcoral.testing.pool.PoolStandIn}) until its result
    is posted back: pull, claim, loopback /execute, result POST.

Prints p50/p99 of each and writes C{bench/results/node_loopback.json} (or
C{--output}).  Needs nats-server (Debian: C{apt-get install nats-server}).

    python3 bench/node_loopback.py --requests 300
"""

from __future__ import annotations

import argparse
import json
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument(
        "--output", default=str(Path(__file__).parent / "results" / "node_loopback.json")
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp, NatsServer(node_ids=("bench-node",)) as nats:
        with PoolStandIn(nats) as pool:
            node = ServerProcess(
                [
                    "--device",
                    "cpu",
                    "--sandbox",
                    "none",
                    "--log-dir",
                    "",
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
            finally:
                node.stop()
    summary = {
        "requests": args.requests,
        "health_ms": common.describe(health),
        "execute_ms": common.describe(execute),
        "pool_ms": common.describe(pooled),
    }
    for key in ("health_ms", "execute_ms", "pool_ms"):
        stats = summary[key]
        assert isinstance(stats, dict)
        print(f"{key:11s} p50 {stats['p50']:7.3f}  p99 {stats['p99']:7.3f}")
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
