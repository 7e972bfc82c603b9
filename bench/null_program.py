#!/usr/bin/env python3
"""
Per-request overhead of the server: latency and throughput of a null program.

The program uploads a two-line module, takes its function with
C{get_function}, runs it (it does nothing) and returns its C{None}.  Nothing
here touches a GPU, so what is measured is the server's own cost: HTTP,
multipart parsing, validation, dispatch to a worker, the worker's module
exec, result encoding and, with C{--max-requests-per-worker 1}, the worker
replacement that follows every request.

Phases:

 1. warm-up: a few requests, not recorded;
 2. sequential: C{--sequential} requests one at a time on one keep-alive
    connection (client wall clock p50/p99, and the server's C{queue_ms} and
    C{elapsed_ms} from each response; C{wall - queue - elapsed} is the
    HTTP/transport/parse share);
 3. concurrent: C{--requests} requests from C{--concurrency} threads, each
    with its own keep-alive connection; requests/s = completed / wall time.

Each phase stops issuing requests after C{--max-seconds}.  Prints a summary
and writes C{bench/results/null_program.json} (or C{--output}).

Examples::

    python3 bench/null_program.py --url http://127.0.0.1:8000 --label "max-requests 0"
    python3 bench/null_program.py --spawn "--device cpu --num-workers 2 --log-dir '' \\
        --sandbox none --max-requests-per-worker 0" --label "cpu, reuse"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

KEYS = ("wall_ms", "queue_ms", "elapsed_ms", "other_ms", "lease_wait_ms", "lease_held_ms")
SOURCE = "def noop():\n    return None\n"
PROGRAM = common.module_program(SOURCE, [("noop", [], False)])


def one(conn: common.Connection, _i: int) -> dict[str, float | str]:
    reply = conn.execute(PROGRAM)
    if reply.outcome != "COMPLETED":
        raise RuntimeError(f"null program answered {reply.outcome}: {reply.describe_error()}")
    r = reply.result
    return {
        "wall_ms": reply.wall_ms,
        "queue_ms": float(r["queue_ms"]),
        "elapsed_ms": float(r["elapsed_ms"]),
        "other_ms": reply.wall_ms - float(r["queue_ms"]) - float(r["elapsed_ms"]),
        "lease_wait_ms": float(r["lease_wait_ms"]),
        "lease_held_ms": float(r["lease_held_ms"]),
    }


def split(samples: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    return {key: common.describe([s[key] for s in samples]) for key in KEYS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_server_args(parser, "null_program")
    parser.add_argument("--warmup", type=int, default=8, help="unrecorded requests first")
    parser.add_argument("--sequential", type=int, default=100, help="requests one at a time")
    parser.add_argument(
        "--requests", "-n", type=int, default=400, help="requests of the concurrent phase"
    )
    parser.add_argument("--concurrency", "-c", type=int, default=8)
    parser.add_argument(
        "--max-seconds", type=float, default=45.0, help="cap on each phase's duration"
    )
    args = parser.parse_args(argv)

    with common.server_from_args(args) as (host, port, where):
        info = common.server_info(host, port)
        print(
            f"null program against {where} (gpu_count={info['gpu_count']}, capacity={info['request_capacity']})"
        )
        common.run_concurrent(
            host,
            port,
            min(args.concurrency, max(args.warmup, 1)),
            args.warmup,
            one,
            args.max_seconds,
        )

        sequential, seq_seconds = common.run_concurrent(
            host, port, 1, args.sequential, one, args.max_seconds
        )
        seq = split(sequential)
        print(
            f"sequential ({len(sequential)} requests, {len(sequential) / seq_seconds:.1f} req/s):"
        )
        for key in KEYS:
            print(f"  {key:<13} {common.fmt(seq[key])}")

        concurrent, seconds = common.run_concurrent(
            host, port, args.concurrency, args.requests, one, args.max_seconds
        )
        rate = len(concurrent) / seconds
        conc = split(concurrent)
        print(
            f"concurrency {args.concurrency}: {len(concurrent)} requests in {seconds:.2f} s = {rate:.1f} req/s"
        )
        for key in KEYS:
            print(f"  {key:<13} {common.fmt(conc[key])}")
        if len(concurrent) < args.requests:
            print(
                f"  (stopped after {args.max_seconds:.0f} s: {len(concurrent)} of {args.requests} requests ran)"
            )

        common.write_result(
            args.output,
            {
                "benchmark": "null_program",
                "label": args.label,
                "server": where,
                "server_info": info,
                "sequential": {
                    "requests": len(sequential),
                    "seconds": seq_seconds,
                    "requests_per_second": len(sequential) / seq_seconds,
                    **seq,
                },
                "concurrent": {
                    "concurrency": args.concurrency,
                    "requests": len(concurrent),
                    "requested": args.requests,
                    "seconds": seconds,
                    "requests_per_second": rate,
                    **conc,
                },
                "notes": "ms from the client wall clock; queue_ms/elapsed_ms from the response; "
                "other_ms = wall - queue - elapsed (HTTP, parsing, dispatch)",
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
