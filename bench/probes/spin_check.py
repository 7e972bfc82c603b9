"""
How long the overlap workload's "10 ms" GPU part really takes, outside any
server: bench/ref_driver.py's C{gpu_work} (a calibrated C{torch.cuda._sleep}
and a synchronize), timed by CUDA events (the kernel alone) and by the host
clock (launch to synchronize return).  Against a server's lease holds
(bench/probes/overlap_gaps.py) this splits a hold into kernel, host and server time.

    PYTHONPATH=<reference install> python3 bench/probes/spin_check.py [--ms 10] [--runs 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
import ref_driver  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ms", type=float, default=10.0)
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args(argv)
    import torch

    namespace: dict = {}
    exec(ref_driver.OVERLAP_SOURCE, namespace)
    gpu_work = namespace["gpu_work"]
    gpu_work(args.ms)  # calibrates
    rate = torch.cuda._kcoral_bench_cycles_per_ms
    kernel, host = [], []
    for _ in range(args.runs):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        started = time.perf_counter()
        start.record()
        torch.cuda._sleep(int(args.ms * rate))
        stop.record()
        torch.cuda.synchronize()
        host.append((time.perf_counter() - started) * 1e3)
        kernel.append(start.elapsed_time(stop))
    print(f"calibrated {rate:.0f} cycles/ms; asked {args.ms} ms")
    print(f"kernel (events) p50 {statistics.median(kernel):.3f} ms, max {max(kernel):.3f}")
    print(f"host (launch to synchronize) p50 {statistics.median(host):.3f} ms, max {max(host):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
