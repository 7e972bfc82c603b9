#!/usr/bin/env python3
"""
Worker templates on a real GPU: start a GPU server with ``--worker-start
fork`` (and, for comparison, ``spawn``) under bubblewrap and under none,
with ``--tensor-api torch``, run a few CUDA programs through it (torch and
PyCUDA), and print per-worker start times from the server's own log
(``worker_ready``'s ``start_ms``: from the fork or spawn to the worker's
ready message, which includes its CUDA context under the lease) and the
templates' import time (server start to ``template_ready``).

On the GPU machine (a checkout with the GPU venv active)::

    python3 bench/probes/template_check.py                      # both sandboxes, fork and spawn
    python3 bench/probes/template_check.py --sandboxes none --starts fork
    python3 bench/probes/template_check.py --cpu --workers 2   # a CPU dry run of the plumbing

Writes ``bench/results/template_check.json``.  About 1-2 minutes.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kcoral.testing.live_server import ServerProcess  # noqa: E402

TORCH = (
    "import os, torch\n"
    "def f(n):\n"
    "    x = torch.arange(n, device='cuda', dtype=torch.float32)\n"
    "    return [float((x * 2).sum().item()), os.getpid(), torch.cuda.device_count()]\n"
)

PYCUDA = (
    "import os\n"
    "import numpy as np\n"
    "import pycuda.driver as drv\n"
    "import pycuda.gpuarray as ga\n"
    "def f(n):\n"
    "    x = ga.to_gpu(np.arange(n, dtype=np.float32))\n"
    "    return [float(ga.sum(x * 2).get()), os.getpid(), drv.Device.count()]\n"
)


CPU = "import os\ndef f(n):\n    return [float(n), os.getpid(), 0]\n"


def program(source: str, n: int) -> dict[str, Any]:
    return {
        "instructions": [
            {"op": "upload", "id": "m", "kind": "module", "source": source},
            {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
            {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": [n]},
            {"op": "return", "key": "out", "value": {"$ref": "r"}},
        ]
    }


def events(log_dir: str) -> list[dict[str, Any]]:
    found = []
    for path in glob.glob(os.path.join(log_dir, "runs", "*", "events.jsonl")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    found.append(json.loads(line))
                except ValueError:
                    pass
    return found


def describe(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {
        "n": len(ordered),
        "min": ordered[0],
        "p50": statistics.median(ordered),
        "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "max": ordered[-1],
    }


def one(sandbox: str, start: str, args: argparse.Namespace) -> dict[str, Any]:
    log_dir = tempfile.mkdtemp(prefix="kcoral-template-check-")
    if args.cpu:
        flags = ["--device", "cpu", "--num-workers", str(args.workers), "--sandbox", sandbox]
    else:
        flags = ["--device", "gpu", "--gpus", str(args.gpu), "--sandbox", sandbox]
        flags += ["--workers-per-gpu", str(args.workers), "--tensor-api", "torch"]
    flags += ["--worker-start", start, "--log-dir", log_dir, "--no-log-console"]
    began = time.monotonic()
    server = ServerProcess(flags).start(timeout=args.spawn_timeout)
    up_s = time.monotonic() - began
    result: dict[str, Any] = {"sandbox": sandbox, "start": start, "server_up_s": up_s}
    try:
        health = server.health()
        result["worker_start"] = health.get("worker_start")
        result["templates"] = health.get("templates")
        outcomes = []
        walls = []
        for i in range(args.requests):
            source = CPU if args.cpu else TORCH if i % 2 == 0 else PYCUDA
            t = time.monotonic()
            body = server.execute(program(source, 1024 + i)).json()
            walls.append((time.monotonic() - t) * 1000.0)
            ok = body.get("status") == "COMPLETED"
            outcomes.append(ok)
            if not ok and len(result.setdefault("errors", [])) < 3:
                result["errors"].append(
                    {"error": body.get("error"), "stderr": str(body.get("stderr"))[-2000:]}
                )
        result["completed"] = sum(outcomes)
        result["requests"] = len(outcomes)
        result["wall_ms"] = describe(walls)
        time.sleep(2.0)  # the last replacements
    finally:
        server.stop()
    seen = events(log_dir)
    ready = [e for e in seen if e.get("event") == "worker_ready"]
    by_kind: dict[str, list[float]] = {}
    for e in ready:
        if isinstance(e.get("start_ms"), (int, float)):
            by_kind.setdefault(str(e.get("made")), []).append(float(e["start_ms"]))
    result["worker_start_ms"] = {k: describe(v) for k, v in by_kind.items()}
    templates = [e for e in seen if e.get("event") == "template_ready"]
    result["template_ready"] = [e.get("template") for e in templates]
    result["template_failed"] = [
        {"template": e.get("template"), "reason": str(e.get("reason"))[-2000:]}
        for e in seen
        if e.get("event") in ("template_failed", "worker_start_fallback")
    ]
    shutil.rmtree(log_dir, ignore_errors=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sandboxes", default="bubblewrap,none")
    parser.add_argument("--starts", default="fork,spawn")
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--cpu", action="store_true", help="a CPU dry run of the plumbing")
    parser.add_argument("--spawn-timeout", type=float, default=180.0)
    parser.add_argument("--output", default="bench/results/template_check.json")
    args = parser.parse_args()
    runs = []
    for sandbox in args.sandboxes.split(","):
        for start in args.starts.split(","):
            try:
                run = one(sandbox, start, args)
            except Exception as e:  # report and go on with the next
                run = {"sandbox": sandbox, "start": start, "failed": f"{type(e).__name__}: {e}"}
            runs.append(run)
            starts = run.get("worker_start_ms", {})
            print(
                f"{sandbox:10s} {start:5s} health={run.get('worker_start')} "
                f"templates={run.get('templates')} completed={run.get('completed')}/"
                f"{run.get('requests')} up={run.get('server_up_s', 0):.1f}s "
                f"wall_p50={run.get('wall_ms', {}).get('p50', float('nan')):.0f}ms",
                flush=True,
            )
            for made, stats in starts.items():
                print(
                    f"    worker start ({made}): n={stats['n']} min={stats['min']:.0f} "
                    f"p50={stats['p50']:.0f} p90={stats['p90']:.0f} max={stats['max']:.0f} ms",
                    flush=True,
                )
            for key in ("failed", "errors", "template_failed"):
                if run.get(key):
                    print(f"    {key}: {json.dumps(run[key])[:3000]}", flush=True)
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump({"runs": runs}, f, indent=2)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
