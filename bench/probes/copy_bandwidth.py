#!/usr/bin/env python3
"""
Device-to-device copy bandwidth of a 1 GiB buffer, timed with CUDA events.

Three measurements, all of the same copy (C{cuMemcpyDtoDAsync} of the whole
buffer on the default stream):

 - C{direct}: a start and an end event around each copy, straight PyCUDA;
 - C{builtin_benchmark}: the same copy timed by
   C{kcoral.worker.gpu_builtins.benchmark} (C{flush_l2} off, the buffer is
   far larger than L2 anyway), to compare its numbers with the direct ones;
 - C{while_warming}: C{direct} again while other processes repeatedly warm a
   worker (create a L{GpuBackend}: context, torch import and init), to show
   that warming a worker does not disturb a measurement in progress.

Bandwidth counts bytes read plus bytes written (2 x size / time), the usual
convention for a copy.  Prints a summary and writes JSON to
C{bench/results/copy_bandwidth.json} (or C{--output}).

Run from the project root: C{python3 bench/probes/copy_bandwidth.py}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

#: What a warming worker does: a fresh process that imports, creates the
#: CUDA context (and torch's state under "auto"/"torch") and exits.
WARM = "from kcoral.worker.gpu import GpuBackend; GpuBackend(0, tensor_api={api!r}).close()"


def summarize(spans_ms: list[float], nbytes: int) -> dict[str, float | int]:
    """Bandwidth statistics (GB/s, read + write) of per-copy times."""
    rates = [2 * nbytes / (ms * 1e-3) / 1e9 for ms in spans_ms]
    mean = statistics.fmean(rates)
    return {
        "samples": len(rates),
        "gbps_median": statistics.median(rates),
        "gbps_mean": mean,
        "gbps_min": min(rates),
        "gbps_max": max(rates),
        "cv": statistics.pstdev(rates) / mean if len(rates) > 1 else 0.0,
        "gbps_p1": sorted(rates)[len(rates) // 100],
        "ms_median": statistics.median(spans_ms),
    }


def time_copies(drv, dst, src, nbytes: int, repeats: int) -> list[float]:
    """Each copy's span in ms, from a pair of events around it."""
    events = [(drv.Event(), drv.Event()) for _ in range(repeats)]
    for start, end in events:
        start.record()
        drv.memcpy_dtod_async(dst, src, nbytes)
        end.record()
    events[-1][1].synchronize()
    return [end.time_since(start) for start, end in events]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--warm-workers", type=int, default=2)
    parser.add_argument("--warm-seconds", type=float, default=8.0)
    parser.add_argument("--tensor-api", default="auto")
    parser.add_argument("--output", default=str(ROOT / "bench" / "results" / "copy_bandwidth.json"))
    args = parser.parse_args(argv)

    import pycuda.driver as drv

    from kcoral.worker import gpu_builtins
    from kcoral.worker.gpu import GpuBackend

    backend = GpuBackend(0, tensor_api="pycuda")
    gpu_builtins.use_backend(backend)
    nbytes = args.size_mib << 20
    src = drv.mem_alloc(nbytes)
    dst = drv.mem_alloc(nbytes)
    drv.memset_d32(src, 0x3F800000, nbytes // 4)

    time_copies(drv, dst, src, nbytes, args.warmup)
    direct = time_copies(drv, dst, src, nbytes, args.repeats)

    def copy() -> None:
        drv.memcpy_dtod_async(dst, src, nbytes)

    bench = gpu_builtins.benchmark(
        copy, {"warmup": args.warmup, "repeat": args.repeats, "flush_l2": False}
    )
    bench_rate = 2 * nbytes / (bench["latency_ms_median"] * 1e-3) / 1e9

    warming: dict[str, object] = {}
    if args.warm_workers > 0:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        code = WARM.format(api=args.tensor_api)

        def spawn() -> subprocess.Popen:
            return subprocess.Popen([sys.executable, "-c", code], env=env)

        procs = [spawn() for _ in range(args.warm_workers)]
        spans: list[float] = []
        cycles = failures = 0
        begin = time.monotonic()
        while procs:
            spans.extend(time_copies(drv, dst, src, nbytes, 20))
            for i, p in enumerate(procs):
                if p.poll() is None:
                    continue
                cycles += 1
                failures += p.returncode != 0
                if time.monotonic() - begin < args.warm_seconds:
                    procs[i] = spawn()
                else:
                    procs[i] = None
            procs = [p for p in procs if p is not None]
        elapsed = time.monotonic() - begin
        quiet = statistics.median(2 * nbytes / (ms * 1e-3) / 1e9 for ms in direct)
        slow = sum(2 * nbytes / (ms * 1e-3) / 1e9 < 0.95 * quiet for ms in spans)
        warming = {
            "slow_fraction": slow / len(spans),
            "workers": args.warm_workers,
            "warm_cycles": cycles,
            "warm_failures": failures,
            "seconds": elapsed,
            **summarize(spans, nbytes),
        }

    result = {
        "device": backend.device_name(),
        "arch": backend.arch,
        "size_bytes": nbytes,
        "convention": "GB/s = 2 * size / time (read + write), 1 GB = 1e9 bytes",
        "direct": summarize(direct, nbytes),
        "builtin_benchmark": {
            "gbps_median": bench_rate,
            "latency_ms_median": bench["latency_ms_median"],
            "cv": bench["cv"],
            "repeat": bench["repeat"],
            "warmup": bench["warmup"],
            "stable": bench["stable"],
        },
        "while_warming": warming,
        "versions": backend.versions(),
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    d = result["direct"]
    print(f"device-to-device copy, {args.size_mib} MiB, {backend.device_name()}")
    print(f"  direct events      : {d['gbps_median']:.1f} GB/s median, CV {d['cv'] * 100:.2f}%")
    print(f"  builtin.benchmark  : {bench_rate:.1f} GB/s median, CV {bench['cv'] * 100:.2f}%")
    if warming:
        print(
            f"  while warming {warming['workers']} worker(s) ({warming['warm_cycles']} warm-ups): "
            f"{warming['gbps_median']:.1f} GB/s median, CV {warming['cv'] * 100:.2f}%, "
            f"{warming['slow_fraction'] * 100:.2f}% of copies >5% slower than quiet"
        )
    print(f"  wrote {out}")
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
