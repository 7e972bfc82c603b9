"""
Mixed single-GPU and two-GPU load on a two-GPU server.

    python3 bench/mixed_load.py --url http://127.0.0.1:8000 --log-dir LOGS

C{--requests} requests (default 200) from C{--concurrency} clients (default
16): three single-GPU programs for each C{options.gpu_count: 2} program.

 - single: uploads a 1 MiB float32 tensor and returns C{t + t} computed on
   its GPU;
 - two_gpu: uploads the same tensor, copies it from C{cuda:0} to C{cuda:1}
   with torch (asserting it landed on device 1) and returns it.

Every answer is checked byte for byte.  Prints and records throughput and
client wall-clock p50/p99 per kind, the servers' C{lease_wait_ms} /
C{lease_held_ms} per kind, the largest C{lease_depth} seen on each GPU in
C{/health} while the load ran, and, with C{--log-dir} (the server's), the
lease-overlap check of L{lease_overlap} over the server's own event log.
Exits 1 when a request failed or answered wrong bytes, or an overlap was found.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import lease_overlap  # noqa: E402

ELEMENTS = 1 << 18  # 1 MiB of float32

SINGLE = "def f(t):\n    return t + t\n"

TWO_GPU = (
    "import torch\n"
    "def f(t):\n"
    "    assert torch.cuda.device_count() == 2, torch.cuda.device_count()\n"
    "    y = torch.as_tensor(t, device='cuda:0').to('cuda:1')\n"
    "    assert y.device.index == 1, y.device\n"
    "    torch.cuda.synchronize(1)\n"
    "    return y.cpu()\n"
)


def program(source: str, digest: str, gpu_count: int | None) -> dict[str, Any]:
    instructions: list[dict[str, Any]] = [
        {
            "op": "upload",
            "id": "t",
            "kind": "tensor",
            "blob": digest,
            "dtype": "float32",
            "shape": [ELEMENTS],
        },
        {"op": "upload", "id": "m", "kind": "module", "source": source},
        {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
        {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": [{"$ref": "t"}]},
        {"op": "return", "key": "out", "value": {"$ref": "r"}},
    ]
    out: dict[str, Any] = {"instructions": instructions}
    if gpu_count is not None:
        out["options"] = {"gpu_count": gpu_count}
    return out


def verify(reply: common.Reply, expected: bytes, gpu_ids: list[int] | None) -> str | None:
    """Why C{reply} is wrong, or C{None}."""
    if reply.outcome != "COMPLETED":
        return f"{reply.outcome}: {reply.describe_error()}"
    node = reply.result.get("results", {}).get("out", {})
    part = reply.parts.get(node.get("part", ""))
    if part is None or hashlib.sha256(part).hexdigest() != node.get("sha256"):
        return "returned part missing or its SHA-256 does not match"
    if part != expected:
        return "returned bytes differ"
    if gpu_ids is not None and sorted(reply.result.get("gpu_ids") or []) != gpu_ids:
        return f"gpu_ids {reply.result.get('gpu_ids')}"
    return None


def _watch_health(host: str, port: int, stop: threading.Event, depths: dict[str, int]) -> None:
    """Keep the largest lease_depth per GPU seen in /health until C{stop}."""
    conn = common.Connection(host, port, timeout=10)
    try:
        while not stop.wait(0.1):
            try:
                health = conn.health()
            except OSError:
                continue
            for gpu in health.get("gpus") or []:
                key = str(gpu.get("gpu_id"))
                depths[key] = max(depths.get(key, 0), int(gpu.get("lease_depth") or 0))
    finally:
        conn.close()


def event_files(log_dir: Path) -> list[Path]:
    """The server's event files, oldest first (rotated C{.N} before the current one)."""
    files: list[Path] = []
    for run in sorted((log_dir / "runs").glob("*")):
        rotated = sorted(
            run.glob("events.jsonl.*"),
            key=lambda p: -int(p.suffix[1:]) if p.suffix[1:].isdigit() else 0,
        )
        files += rotated + [p for p in [run / "events.jsonl"] if p.exists()]
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_server_args(parser, "mixed_load")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--singles-per-two-gpu", type=int, default=3)
    parser.add_argument("--max-seconds", type=float, default=300.0)
    parser.add_argument("--log-dir", type=Path, help="the server's --log-dir (lease overlap check)")
    args = parser.parse_args(argv)

    data = np.arange(ELEMENTS, dtype=np.float32).tobytes()
    doubled = (np.arange(ELEMENTS, dtype=np.float32) * 2).tobytes()
    digest = hashlib.sha256(data).hexdigest()
    period = args.singles_per_two_gpu + 1
    programs = {
        "single": (program(SINGLE, digest, None), doubled, None),
        "two_gpu": (program(TWO_GPU, digest, 2), data, [0, 1]),
    }

    def one(conn: common.Connection, i: int) -> dict[str, Any]:
        kind = "two_gpu" if i % period == period - 1 else "single"
        prog, expected, gpu_ids = programs[kind]
        reply = conn.execute(prog, [data])
        return {
            "kind": kind,
            "wall_ms": reply.wall_ms,
            "error": verify(reply, expected, gpu_ids),
            "lease_wait_ms": reply.result.get("lease_wait_ms"),
            "lease_held_ms": reply.result.get("lease_held_ms"),
            "queue_ms": reply.result.get("queue_ms"),
        }

    with common.server_from_args(args) as (host, port, description):
        info = common.server_info(host, port)
        depths: dict[str, int] = {}
        stop = threading.Event()
        watcher = threading.Thread(target=_watch_health, args=(host, port, stop, depths))
        watcher.start()
        try:
            results, elapsed = common.run_concurrent(
                host, port, args.concurrency, args.requests, one, args.max_seconds
            )
        finally:
            stop.set()
            watcher.join()

    kinds: dict[str, Any] = {}
    for kind in ("single", "two_gpu"):
        rows = [r for r in results if r["kind"] == kind]
        errors = [r["error"] for r in rows if r["error"]]

        def stat(key: str, rows: list[dict[str, Any]] = rows) -> dict[str, float]:
            return common.describe([float(r[key]) for r in rows if r.get(key) is not None])

        kinds[kind] = {
            "answered": len(rows),
            "failed": len(errors),
            "first_errors": errors[:5],
            "throughput_per_s": len(rows) / elapsed if elapsed else 0.0,
            "wall_ms": common.describe([r["wall_ms"] for r in rows]),
            "queue_ms": stat("queue_ms"),
            "lease_wait_ms": stat("lease_wait_ms"),
            "lease_held_ms": stat("lease_held_ms"),
        }
    overlap = None
    if args.log_dir is not None:
        # Give the log writer a moment to flush the last events.
        time.sleep(1.0)
        files = event_files(args.log_dir)
        overlap = lease_overlap.check(files) if files else {"files": [], "overlaps": None}
    answered = len(results)
    failed = sum(k["failed"] for k in kinds.values())
    summary = {
        "label": args.label,
        "server": description,
        "server_info": info,
        "requests": args.requests,
        "answered": answered,
        "concurrency": args.concurrency,
        "elapsed_s": elapsed,
        "throughput_per_s": answered / elapsed if elapsed else 0.0,
        "kinds": kinds,
        "max_lease_depth_seen": depths,
        "lease_overlap": overlap,
    }
    print(
        f"{answered}/{args.requests} answered in {elapsed:.1f} s ({summary['throughput_per_s']:.2f}/s)"
    )
    for kind, k in kinds.items():
        print(
            f"  {kind}: {k['answered']} answered, {k['failed']} wrong; "
            f"{k['throughput_per_s']:.2f}/s; wall {common.fmt(k['wall_ms'])}"
        )
        print(f"    lease_wait {common.fmt(k['lease_wait_ms'])}")
        print(f"    lease_held {common.fmt(k['lease_held_ms'])}")
        for error in k["first_errors"]:
            print(f"    ! {error}")
    print(f"  largest lease_depth seen per GPU: {depths}")
    if overlap is not None:
        print(f"  lease overlap check: {overlap.get('gpus')} overlaps={overlap.get('overlaps')}")
    common.write_result(args.output, summary)
    bad_overlap = overlap is not None and overlap.get("overlaps") != []
    return 1 if failed or answered < args.requests or bad_overlap else 0


if __name__ == "__main__":
    sys.exit(main())
