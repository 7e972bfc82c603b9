"""
Fresh-worker workloads (issue 14) through the reference client only.

    PYTHONPATH=<reference install> python3 bench/fresh_load.py --url URL [--label L]

Meant for a server in fresh mode (`--max-requests-per-worker 1`: a new
process per request); bench/run_fresh_gpu.sh runs it against kcoral (sandbox
none and bubblewrap) and the reference server.  It imports the reference
client through bench/ref_driver.py (which refuses this checkout's package)
and reuses its closed and open loops:

- `null8`: null programs from 8 clients, closed loop: requests/s and p50
  (issue target: at least 6/s per GPU, 4.5x the reference);
- `open3`: null programs arriving at 3/s with fixed spacing, latency from
  each scheduled arrival: p50 and p99 (targets: 15 ms and 50 ms, i.e. no
  request waits for a replacement);
- `copy`: device-to-device copies of `--copy-mib` timed one by one with CUDA
  events inside a request (torch): median and coefficient of variation,
  first on an idle server, then while `--churn-clients` clients send null
  programs around it, so workers are replaced (contexts created and
  destroyed) during the measurement (target: median within 2 % of idle,
  CV under 2 %).

Before the first workload it waits (up to `--spares-wait` s) until every
warm spare /health lists is ready (kcoral; the reference has none).  Prints
one line per figure and writes the JSON (`--output`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ref_driver  # noqa: E402  (imports the reference client)
from ref_driver import (  # noqa: E402
    Client,
    Report,
    check,
    closed_loop,
    module_program,
    null_program,
    open_loop_level,
)

#: Each copy timed alone with CUDA events (the server's benchmark builtin
#: reports no spread, and both servers run torch in their workers).
COPY_SOURCE = """
def copy_spread(mib, repeat):
    import statistics
    import torch

    src = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeat)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeat)]
    for i in range(repeat):
        starts[i].record()
        dst.copy_(src)
        ends[i].record()
    torch.cuda.synchronize()
    ms = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    mean = statistics.fmean(ms)
    return {
        "n": repeat,
        "median_ms": statistics.median(ms),
        "mean_ms": mean,
        "cv_pct": statistics.pstdev(ms) / mean * 100.0,
        "max_ms": max(ms),
        "min_ms": min(ms),
    }
"""


def wait_for_spares(url: str, limit: float) -> dict[str, Any]:
    """Poll /health until every listed spare is ready (or C{limit} s pass)."""
    deadline = time.time() + limit
    while True:
        with Client(url) as client:
            info = client.health()
        spares = info.get("spares") or []
        if all(s.get("state") == "ready" for s in spares) or time.time() >= deadline:
            return {"spares": len(spares), "ready": sum(s.get("state") == "ready" for s in spares)}
        time.sleep(0.5)


def copy_runs(url: str, mib: int, repeat: int, runs: int) -> list[dict[str, Any]]:
    program = module_program(COPY_SOURCE, [("copy_spread", [mib, repeat], False)])
    out = []
    with Client(url) as client:
        for _ in range(runs):
            out.append(check(client.execute(program))["r"])
    return out


def pooled(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Median of the runs' medians, and of their CVs (each run one request)."""
    return {
        "runs": len(runs),
        "median_ms": statistics.median(r["median_ms"] for r in runs),
        "cv_pct": statistics.median(r["cv_pct"] for r in runs),
        "cv_pct_max": max(r["cv_pct"] for r in runs),
        "max_ms": max(r["max_ms"] for r in runs),
    }


def churn(url: str, clients: int, stop: threading.Event, counts: list[int]) -> None:
    """Null programs back to back from C{clients} threads until C{stop}."""
    program = null_program()

    def loop() -> None:
        with Client(url) as client:
            while not stop.is_set():
                check(client.execute(program))
                counts.append(1)

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    stop.wait()
    for t in threads:
        t.join(timeout=60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--label", default="")
    parser.add_argument("--output", default="bench/results/fresh_load.json")
    parser.add_argument("--workloads", default="null8,open3,copy")
    parser.add_argument("--seconds", type=float, default=10.0, help="the closed loop")
    parser.add_argument("--open-seconds", type=float, default=20.0)
    parser.add_argument("--rate", type=float, default=3.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--copy-mib", type=int, default=1024)
    parser.add_argument("--copy-repeat", type=int, default=400)
    parser.add_argument("--copy-runs", type=int, default=5)
    parser.add_argument("--churn-clients", type=int, default=7)
    parser.add_argument("--spares-wait", type=float, default=60.0)
    args = parser.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]

    report = Report()
    details: dict[str, Any] = {"label": args.label, "url": args.url}
    print(f"fresh_load: {args.url} [{args.label}] {workloads}", flush=True)
    details["spares_at_start"] = wait_for_spares(args.url, args.spares_wait)
    failed = []
    for name in workloads:
        try:
            if name == "null8":
                level = closed_loop(
                    args.url, ("null", 0.0), args.clients, args.seconds, 1.0, args.processes
                )
                details["null8"] = level
                report.figure(f"null.c{args.clients}.rps", level["requests_per_s"], "req/s")
                lat = level.get("latency_ms") or {}
                if "p50" in lat:
                    report.figure(f"null.c{args.clients}.p50", lat["p50"], "ms")
                details["spares_after_null8"] = wait_for_spares(args.url, args.spares_wait)
            elif name == "open3":
                level = open_loop_level(
                    args.url, null_program(), args.rate, args.open_seconds, threads=16
                )
                details["open3"] = level
                report.figure(f"open.r{args.rate:g}.p50", level["latency_ms"]["p50"], "ms")
                report.figure(f"open.r{args.rate:g}.p99", level["latency_ms"]["p99"], "ms")
                details["spares_after_open3"] = wait_for_spares(args.url, args.spares_wait)
            elif name == "copy":
                idle = pooled(copy_runs(args.url, args.copy_mib, args.copy_repeat, args.copy_runs))
                stop, counts = threading.Event(), []
                background = threading.Thread(
                    target=churn, args=(args.url, args.churn_clients, stop, counts), daemon=True
                )
                background.start()
                time.sleep(2.0)  # replacements under way
                try:
                    busy = pooled(
                        copy_runs(args.url, args.copy_mib, args.copy_repeat, args.copy_runs)
                    )
                finally:
                    stop.set()
                    background.join(timeout=120)
                details["copy"] = {"idle": idle, "churn": busy, "churn_requests": len(counts)}
                report.figure("copy.idle.median", idle["median_ms"], "ms")
                report.figure("copy.idle.cv", idle["cv_pct"], "%")
                report.figure("copy.churn.median", busy["median_ms"], "ms")
                report.figure("copy.churn.cv", busy["cv_pct"], "%")
                report.figure(
                    "copy.churn.vs_idle", busy["median_ms"] / idle["median_ms"] - 1.0, "ratio-1"
                )
                report.figure("copy.churn.requests", float(len(counts)), "req")
            else:
                raise ValueError(f"unknown workload {name!r}")
        except Exception as e:  # one workload's failure is reported, the rest run
            failed.append(name)
            details.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
            print(f"!! {name}: {type(e).__name__}: {e}", flush=True)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "label": args.label,
        "reference_client": getattr(ref_driver.kcoral, "__version__", "?"),
        "figures": report.figures,
        "units": report.units,
        "details": details,
        "failed": failed,
    }
    out.write_text(json.dumps(body, indent=2, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
