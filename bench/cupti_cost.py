"""
What the CUPTI driver watch costs a GPU worker, per call: a driver call
(C{cuCtxSynchronize}) before any subscription, after this process
subscribed (the domain switched off), and inside L{DriverWatch.leasing}
(switched on); and one enable/disable pair, what every lazily leased module
import pays.

    python3 bench/cupti_cost.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from kcoral.worker.devices import make_backend, prepare_backend  # noqa: E402


def per_call_us(fn, calls: int) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) * 1e6 / calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--output", default=str(common.RESULTS / "cupti_cost.json"))
    args = parser.parse_args(argv)
    prepare_backend("gpu")
    backend = make_backend("gpu")
    import pycuda.driver as drv

    from kcoral.worker.cuptiwatch import driver_watch

    result = {"synchronize_unsubscribed_us": per_call_us(drv.Context.synchronize, args.calls)}
    watch = driver_watch()
    if watch is None:
        print("no CUPTI here")
        return 1
    result["synchronize_subscribed_off_us"] = per_call_us(drv.Context.synchronize, args.calls)

    def pair() -> None:
        with watch.leasing(lambda: None):
            pass

    result["leasing_enter_exit_us"] = per_call_us(pair, args.calls)
    with watch.leasing(lambda: None):
        result["synchronize_inside_leasing_us"] = per_call_us(drv.Context.synchronize, args.calls)
    result["synchronize_after_us"] = per_call_us(drv.Context.synchronize, args.calls)
    for key, value in result.items():
        print(f"{key:<34} {value:8.2f} us")
    common.write_result(args.output, result)
    backend.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
