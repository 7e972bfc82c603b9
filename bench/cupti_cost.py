"""
What the CUPTI driver watch costs a GPU worker, per call: a driver call
(C{cuCtxSynchronize}) before any subscription, after this process
subscribed (the domain switched off), inside L{DriverWatch.leasing} after
the first device call took the lease (the domain switched off from inside
the callback), and with the domain on throughout; one enable/disable pair,
what every lazily leased module import or run pays; and a lazily leased
block that makes one device call.

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
    # A device call takes the "lease" (nothing here), then the domain goes
    # off from inside the callback: what a lazily leased run's later calls cost.
    with watch.leasing(lambda: None):
        drv.mem_alloc(1 << 20).free()
        result["synchronize_after_lazy_grant_us"] = per_call_us(drv.Context.synchronize, args.calls)
    result["switch_off_refused"] = watch.switch_off_refused

    def lazy_run() -> None:
        with watch.leasing(lambda: None):
            drv.Context.synchronize()

    result["lazy_run_with_one_device_call_us"] = per_call_us(lazy_run, args.calls)
    # With the domain on throughout (what it costs where the switch-off is refused).
    watch._acquire, watch._granted = None, None
    watch.cupti.enable_domain(1, watch._subscriber, watch.cupti.CallbackDomain.DRIVER_API)
    watch._active = True
    try:
        result["synchronize_domain_on_us"] = per_call_us(drv.Context.synchronize, args.calls)
    finally:
        watch.cupti.enable_domain(0, watch._subscriber, watch.cupti.CallbackDomain.DRIVER_API)
        watch._active, watch._first = False, None
    result["synchronize_after_us"] = per_call_us(drv.Context.synchronize, args.calls)
    for key, value in result.items():
        print(f"{key:<34} {value:8.2f} us" if isinstance(value, float) else f"{key:<34} {value}")
    common.write_result(args.output, result)
    backend.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
