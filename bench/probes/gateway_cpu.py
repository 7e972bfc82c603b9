#!/usr/bin/env python3
"""
CPU per job of each process of a pool, batch after batch: does any of them
get dearer as jobs pile up?

Starts nats-server, a gateway and one CPU node (L{kcoral.testing.gateway}),
then sends C{--batches} batches of C{--batch} sequential null programs
through the gateway, and after each prints the batch's p50 and the CPU
(user + system, from C{/proc}) that the gateway, the node's main process
and nats-server spent per job, with a fixed pure-Python loop's time beside
it (the host's own speed drifts on a shared machine).

It found (2026-12-02, dev machine) that nats-server's CPU per job grew from
about 1.6 to 6 ms over 10,000 jobs, the gateway's p50 from 7.6 to 12.8 ms,
while the gateway watched the claims bucket from its current values (a
last-per-subject consumer on a bucket that keeps every job's key for a
day); with the watch on new claims only it stays at 0.7-1.2 ms
(bench/README.md, C{gateway.py}).

    python3 bench/probes/gateway_cpu.py [--batches 5] [--batch 2000] [--node-workers 2]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import common  # noqa: E402

from kcoral.testing.gateway import GatewayPool  # noqa: E402

NULL = common.module_program("def noop():\n    return None\n", [("noop", [], False)])


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _reference_ms() -> float:
    started = time.process_time()
    total = 0
    for i in range(3_000_000):
        total += i
    return (time.process_time() - started) * 1000.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2000)
    parser.add_argument("--node-workers", type=int, default=2)
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="kcoral-probe-gateway-cpu-"))
    pool = GatewayPool(
        tmp,
        ["node-0"],
        node_args=["--max-requests-per-worker", "0", "--sandbox", "none"],
    )
    pool.start()
    try:
        pool.node("node-0", seats=args.node_workers)
        assert pool.gateway is not None and pool.gateway.process is not None
        node = pool.nodes["node-0"].process
        assert node is not None and pool.nats.process is not None
        processes = {
            "gateway": psutil.Process(pool.gateway.process.pid),
            "node": psutil.Process(node.pid),
            "nats-server": psutil.Process(pool.nats.process.pid),
        }

        def one(conn: common.Connection, _i: int) -> float:
            reply = conn.execute(NULL)
            if reply.outcome != "COMPLETED":
                raise RuntimeError(f"{reply.outcome}: {reply.describe_error()}")
            return reply.wall_ms

        common.run_concurrent("127.0.0.1", pool.port, 1, 20, one)
        done = 0
        for _ in range(args.batches):
            reference = _reference_ms()
            before = {name: _cpu(p) for name, p in processes.items()}
            walls, _ = common.run_concurrent("127.0.0.1", pool.port, 1, args.batch, one)
            done += args.batch
            per_job = {
                name: (_cpu(p) - before[name]) * 1000.0 / args.batch
                for name, p in processes.items()
            }
            cpu = ", ".join(f"{name} {ms:.2f}" for name, ms in per_job.items())
            print(
                f"after {done} jobs: p50 {common.describe(walls)['p50']:.2f} ms; "
                f"CPU per job (ms): {cpu}; reference loop {reference:.0f} ms",
                flush=True,
            )
    finally:
        pool.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
