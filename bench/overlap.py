#!/usr/bin/env python3
"""
Does CPU work overlap GPU work across workers?  Throughput of a 50 ms CPU +
10 ms GPU request against the GPU-bound limit.

Each request uploads one module and runs two of its functions:

 1. C{cpu_work(50)} through a C{get_function} declared C{"cpu_only": true}:
    a 50 ms busy-wait on the host.  The worker gives the GPU lease up for it
    (protocol §6.4), so other workers may use the GPU meanwhile;
 2. C{gpu_work(10)}: holds the GPU for 10 ms.  It launches the backend's
    one-thread spin kernel (C{GpuBackend.spin_function()}, which waits on
    C{%globaltimer}) and synchronizes; if the backend has none it falls back
    to C{torch.cuda._sleep} in a loop.

With the lease released during the CPU part, a GPU serves at most
C{1000 / gpu_ms} = 100 requests/s whatever the CPU part costs, as long as
enough workers are busy on their CPU part.  The script reports requests/s at
each C{--concurrency} and the ratio to that limit, plus the server's
C{lease_wait_ms} / C{lease_held_ms}.

On a server without a GPU (C{/health} C{gpu_count} 0) the GPU part is
skipped (the request runs the CPU part only, and C{cpu_only} has no effect
there); the ratio is then against the CPU limit C{capacity x 1000 / cpu_ms}.

Writes C{bench/results/overlap.json} (or C{--output}).

Example::

    python3 bench/overlap.py --url http://127.0.0.1:8000 --concurrency 8,16
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from spin_source import CPU_WORK  # noqa: E402

SOURCE = (
    '''
import time


def gpu_work(ms):
    """Hold the GPU for about ms milliseconds; return how."""
    from kcoral.worker.runtime import current_backend

    backend = current_backend()
    spin_function = getattr(backend, "spin_function", None)
    spin = spin_function() if spin_function is not None else None
    if spin is not None:
        import numpy as np
        import pycuda.driver as drv

        spin(np.uint64(int(ms * 1e6)), block=(1, 1, 1), grid=(1, 1))
        drv.Context.synchronize()
        return "spin_kernel"
    import torch

    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        torch.cuda._sleep(20000)
        torch.cuda.synchronize()
    return "torch_sleep"


def noop(ms):
    return "skipped"
'''
    + CPU_WORK
)


def program(cpu_ms: float, gpu_ms: float, gpu: bool) -> dict:
    return common.module_program(
        SOURCE,
        [("cpu_work", [cpu_ms], True), ("gpu_work" if gpu else "noop", [gpu_ms], False)],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_server_args(parser, "overlap")
    parser.add_argument("--cpu-ms", type=float, default=50.0)
    parser.add_argument("--gpu-ms", type=float, default=10.0)
    parser.add_argument("--concurrency", default="8,16", help="comma-separated concurrency levels")
    parser.add_argument(
        "--requests", "-n", type=int, default=300, help="requests per concurrency level"
    )
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument(
        "--single", type=int, default=5, help="sequential requests before the levels"
    )
    parser.add_argument(
        "--max-seconds", type=float, default=30.0, help="cap on each level's duration"
    )
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]

    with common.server_from_args(args) as (host, port, where):
        info = common.server_info(host, port)
        gpus = int(info["gpu_count"] or 0)
        capacity = int(info["request_capacity"] or 1)
        if gpus:
            limit = gpus * 1000.0 / args.gpu_ms
            limit_name = f"GPU-bound limit {gpus} x 1000/{args.gpu_ms:g} ms"
        else:
            limit = capacity * 1000.0 / args.cpu_ms
            limit_name = f"CPU-bound limit {capacity} workers x 1000/{args.cpu_ms:g} ms"
            print(
                "server has no GPU (gpu_count 0): skipping the GPU part, running the "
                f"{args.cpu_ms:g} ms CPU part only"
            )
        print(
            f"overlap against {where}: {args.cpu_ms:g} ms cpu_only + {args.gpu_ms:g} ms GPU per request"
        )
        prog = program(args.cpu_ms, args.gpu_ms, bool(gpus))

        def one(conn: common.Connection, _i: int) -> dict:
            reply = conn.execute(prog)
            if reply.outcome != "COMPLETED":
                raise RuntimeError(
                    f"overlap program answered {reply.outcome}: {reply.describe_error()}"
                )
            r = reply.result
            return {
                "wall_ms": reply.wall_ms,
                "queue_ms": float(r["queue_ms"]),
                "elapsed_ms": float(r["elapsed_ms"]),
                "lease_wait_ms": float(r["lease_wait_ms"]),
                "lease_held_ms": float(r["lease_held_ms"]),
                "gpu_method": r["results"]["out"].get("value"),
            }

        common.run_concurrent(
            host, port, min(8, max(args.warmup, 1)), args.warmup, one, args.max_seconds
        )
        single, _ = common.run_concurrent(host, port, 1, 5, one, args.max_seconds)
        method = single[0]["gpu_method"] if single else None
        print(
            f"single request: wall {statistics.median(s['wall_ms'] for s in single):.1f} ms, "
            f"lease held {statistics.median(s['lease_held_ms'] for s in single):.1f} ms (GPU work: {method})"
        )

        runs = []
        for c in levels:
            samples, seconds = common.run_concurrent(
                host, port, c, args.requests, one, args.max_seconds
            )
            rate = len(samples) / seconds
            entry = {
                "concurrency": c,
                "requests": len(samples),
                "seconds": seconds,
                "requests_per_second": rate,
                "ratio_to_limit": rate / limit,
                **{
                    k: common.describe([s[k] for s in samples])
                    for k in ("wall_ms", "queue_ms", "elapsed_ms", "lease_wait_ms", "lease_held_ms")
                },
            }
            runs.append(entry)
            print(
                f"concurrency {c:>3}: {len(samples)} requests in {seconds:.2f} s = {rate:.1f} req/s, "
                f"{rate / limit * 100:.1f}% of the {limit_name} = {limit:.0f} req/s"
            )
            print(f"    wall        {common.fmt(entry['wall_ms'])}")
            print(f"    lease_wait  {common.fmt(entry['lease_wait_ms'])}")
            print(f"    lease_held  {common.fmt(entry['lease_held_ms'])}")

        common.write_result(
            args.output,
            {
                "benchmark": "overlap",
                "label": args.label,
                "server": where,
                "server_info": info,
                "cpu_ms": args.cpu_ms,
                "gpu_ms": args.gpu_ms,
                "gpu_part": method if gpus else "skipped (no GPU)",
                "limit_requests_per_second": limit,
                "limit": limit_name,
                "single": {
                    k: common.describe([s[k] for s in single]) for k in ("wall_ms", "lease_held_ms")
                },
                "runs": runs,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
