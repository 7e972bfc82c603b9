"""
Where the close of a CUPTI activity session goes (issue 33's cost target):
the 10 + 100 iteration benchmark of bench/trusted_timing.py's cost() with
other activity buffer sizes and CUPTI flush periods, and the time spent in
kcoral's own buffer callback.  Prints one line per variant; writes JSON to
$OUT/cupti_close.json when OUT is set.  GPU only.

    . .gpu/activate.sh && python3 bench/probes/cupti_close.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    import torch

    from kcoral.worker import gpu_builtins
    from kcoral.worker.devices import make_backend, prepare_backend
    from kcoral.worker.gpu_builtins import activity, timing
    from kcoral.worker.gpu_builtins.timing import EventTimer

    prepare_backend("gpu", tensor_api="torch")
    backend = make_backend("gpu", tensor_api="torch")
    gpu_builtins.use_backend(backend)
    x = torch.randn(2048, 2048, device="cuda")
    y = torch.zeros_like(x)

    def kernel(a: Any, b: Any) -> None:
        torch.matmul(a, a, out=b)

    trace = activity.activity_trace()
    assert trace is not None
    spent = {"callback_ms": 0.0, "records": 0, "buffers": 0}
    original = activity.ActivityTrace._completed

    def counted(self: Any, activities: list[Any]) -> None:
        started = time.perf_counter()
        original(self, activities)
        spent["callback_ms"] += (time.perf_counter() - started) * 1000.0
        spent["records"] += len(activities)
        spent["buffers"] += 1

    activity.ActivityTrace._completed = counted  # type: ignore[method-assign]
    original_session = activity.ActivityTrace.session
    period = {"ms": 0}

    def session(self: Any, driver: Any) -> Any:
        if period["ms"]:
            self.cupti.activity_flush_period(period["ms"])
        return original_session(self, driver)

    activity.ActivityTrace.session = session  # type: ignore[method-assign]

    def events() -> None:
        timer = EventTimer(backend, True)
        timer.run(kernel, (x, y), 10)
        timer.run(kernel, (x, y), 100)

    def bench() -> None:
        gpu_builtins.benchmark(kernel, x, y, {"warmup": 10, "repeat": 100})

    bench()
    rows = []
    default_switch = sys.getswitchinterval()
    variants = [(8 << 20, 0, default_switch), (8 << 20, 0, 0.0001), (16 << 10, 0, 0.0001)]
    variants += [(8 << 20, 0, default_switch)]
    for buffer_bytes, flush_ms, switch in variants:
        if True:
            activity.BUFFER_BYTES = buffer_bytes
            period["ms"] = flush_ms
            sys.setswitchinterval(switch)
            bench()  # buffers of the new size
            walls: dict[str, list[float]] = {"events": [], "activity": []}
            closes, callbacks, records, buffers = [], [], [], []
            for _ in range(5):
                torch.cuda.synchronize()
                started = time.perf_counter()
                events()
                walls["events"].append((time.perf_counter() - started) * 1000.0)
                spent.update(callback_ms=0.0, records=0, buffers=0)
                torch.cuda.synchronize()
                started = time.perf_counter()
                bench()
                walls["activity"].append((time.perf_counter() - started) * 1000.0)
                closes.append(timing.LAST_PHASES.get("session_close", 0.0))
                callbacks.append(spent["callback_ms"])
                records.append(spent["records"])
                buffers.append(spent["buffers"])
            trace.cupti.activity_flush_period(0)
            row = {
                "buffer_bytes": buffer_bytes,
                "flush_period_ms": flush_ms,
                "switch_interval_s": switch,
                "events_ms": statistics.median(walls["events"]),
                "activity_ms": statistics.median(walls["activity"]),
                "session_close_ms": statistics.median(closes),
                "callback_ms": statistics.median(callbacks),
                "records": statistics.median(records),
                "buffers": statistics.median(buffers),
                "phases_ms": dict(timing.LAST_PHASES),
            }
            row["ratio"] = row["activity_ms"] / row["events_ms"]
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "phases_ms"}), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "cupti_close.json").write_text(json.dumps(rows, indent=1))
    sys.stdout.flush()
    os._exit(0)  # CUPTI's exit handlers abort this process (bench/README.md)


if __name__ == "__main__":
    raise SystemExit(main())
