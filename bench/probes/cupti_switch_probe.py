"""
Can a CUPTI driver-API callback switch its own domain off once the lease is
taken, and does the subscription still see device calls afterwards?

A lazily leased block (kcoral.worker.cuptiwatch, C{leasing}) takes the lease
at its first device-touching driver call; to let the rest of the block run
at full speed the domain would have to go off right after.  Each variant
runs in a fresh process with torch's CUDA initialised, makes five lazily
"leased" rounds of torch work (counting the "acquires": one a round means
the first device call of each round was seen), times a torch launch after
the grant, and finally checks that a watch switched on afterwards still
sees torch's device calls:

- C{none}: the domain stays on until the block ends (kcoral's module import);
- C{enter}: switched off inside the entry callback of the first device call;
- C{exit}: switched off inside the exit callback of that call;
- C{thread}: switched off by another thread, woken by the callback.

    python3 bench/probes/cupti_switch_probe.py

Prints one line a variant and writes C{bench/results/cupti_switch_probe.json}.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

VARIANTS = ("none", "enter", "exit", "thread")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def child(variant: str) -> dict[str, Any]:
    import torch
    from cupti import cupti

    from kcoral.worker.cuptiwatch import HARMLESS_DRIVER_CALLS, RELEASE_PREFIXES

    torch.ones(1, device="cuda").sum().item()
    domain = cupti.CallbackDomain.DRIVER_API
    enter, leave = cupti.ApiCallbackSite.API_ENTER, cupti.ApiCallbackSite.API_EXIT
    state: dict[str, Any] = {"on": False, "pending": False, "off_at_exit": False}
    counts = {"acquired": 0, "seen": 0, "errors": 0}
    wake = threading.Event()
    subscriber: Any = None

    def off() -> None:
        try:
            cupti.enable_domain(0, subscriber, domain)
            state["on"] = False
        except Exception:
            counts["errors"] += 1

    def callback(_userdata: Any, _domain: Any, _cbid: Any, data: Any) -> None:
        name = str(data.function_name)
        if name in HARMLESS_DRIVER_CALLS or name.startswith(RELEASE_PREFIXES):
            return
        counts["seen"] += 1
        if data.callback_site == enter and state["pending"]:
            state["pending"] = False
            counts["acquired"] += 1
            if variant == "enter":
                off()
            elif variant == "exit":
                state["off_at_exit"] = True
            elif variant == "thread":
                wake.set()
        elif data.callback_site == leave and state["off_at_exit"]:
            state["off_at_exit"] = False
            off()

    subscriber = cupti.subscribe(callback, None)

    def helper() -> None:
        while True:
            wake.wait()
            wake.clear()
            off()

    threading.Thread(target=helper, daemon=True).start()

    def lazily(block: Any) -> Any:
        state["pending"] = True
        cupti.enable_domain(1, subscriber, domain)
        state["on"] = True
        try:
            return block()
        finally:
            if state["on"]:
                off()

    def work() -> None:
        torch.ones(1024, device="cuda").mul_(2).sum().item()

    def launches() -> float:
        torch.cuda._sleep(0)
        started = time.perf_counter()
        for _ in range(2000):
            torch.cuda._sleep(0)
        elapsed = (time.perf_counter() - started) * 1e6 / 2000
        torch.cuda.synchronize()
        return elapsed

    result: dict[str, Any] = {"variant": variant}
    for _ in range(5):
        lazily(work)
    result["acquired_in_5_rounds"] = counts["acquired"]

    def launch_after_grant() -> float:
        work()
        time.sleep(0.01)  # the helper thread's turn
        return launches()

    result["launch_after_grant_us"] = lazily(launch_after_grant)
    result["launch_unwatched_us"] = launches()
    before = counts["seen"]
    cupti.enable_domain(1, subscriber, domain)
    work()
    cupti.enable_domain(0, subscriber, domain)
    result["later_watch_sees_calls"] = counts["seen"] > before
    result["enable_errors"] = counts["errors"]
    return result


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2])))
        return 0
    results = []
    for variant in VARIANTS:
        done = subprocess.run(
            [sys.executable, __file__, "--child", variant],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            results.append({"variant": variant, "failed": done.stderr[-2000:]})
        else:
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]))
    out = Path(__file__).resolve().parents[1] / "results" / "cupti_switch_probe.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
