"""
Where does a CUPTI activity session's close go: CUPTI's own flush, or
cupti-python turning the buffer into Python objects?  (Issue 33's cost.)

Each variant runs in a fresh process with torch's CUDA initialised and
times a benchmark-shaped workload (a 2048 matmul, an L2 flush by a 256 MiB
``zero_`` and a device synchronize each iteration, 110 iterations) inside
one activity session (kernels, memcpy, memset), then the forced flush that
ends it:

- ``python``: cupti-python's callbacks; the completed callback only counts
  the records it is given;
- ``kcoral``: cupti-python's callbacks with kcoral's own ``ActivityTrace``;
- ``ctypes``: libcupti's ``cuptiActivityRegisterCallbacks`` called through
  ctypes; the completed callback walks the buffer with
  ``cuptiActivityGetNextRecord`` and reads each record's kind, start, end
  (and a kernel's name) at offsets measured from the CUPTI header with the
  C compiler; its records are checked against cupti-python's.

    python3 bench/probes/cupti_ctypes.py

Prints one line a variant and writes ``bench/results/cupti_ctypes.json``.
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

ROUNDS = 5
ITERATIONS = 110

OFFSETS_C = r"""
#include <stddef.h>
#include <stdio.h>
#include <cupti_activity.h>
int main(void) {
  printf("%zu %zu %zu %zu %zu %zu %zu %zu\n",
    offsetof(CUpti_ActivityKernel10, start), offsetof(CUpti_ActivityKernel10, end),
    offsetof(CUpti_ActivityKernel10, name),
    offsetof(CUpti_ActivityMemcpy6, start), offsetof(CUpti_ActivityMemcpy6, bytes),
    offsetof(CUpti_ActivityMemset4, start), offsetof(CUpti_ActivityMemset4, bytes),
    offsetof(CUpti_ActivityMemcpyPtoP4, start));
  return 0;
}
"""


def offsets() -> list[int]:
    include = [
        p
        for p in (
            "/usr/local/cuda/extras/CUPTI/include",
            "/usr/local/cuda/include",
            "/usr/local/cuda/targets/x86_64-linux/include",
        )
        if os.path.isdir(p)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp, "o.c")
        source.write_text(OFFSETS_C)
        flags = [f"-I{p}" for p in include]
        subprocess.run(["cc", *flags, "-o", str(Path(tmp, "o")), str(source)], check=True)
        out = subprocess.run([str(Path(tmp, "o"))], capture_output=True, text=True, check=True)
    return [int(x) for x in out.stdout.split()]


def libcupti_path() -> str:
    for line in Path("/proc/self/maps").read_text().splitlines():
        if "libcupti" in line:
            return line.split()[-1]
    raise RuntimeError("libcupti not mapped")


def workload(torch: Any) -> Any:
    x = torch.randn(2048, 2048, device="cuda")
    out = torch.empty_like(x)
    scrub = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def run(n: int) -> None:
        for _ in range(n):
            scrub.zero_()
            torch.cuda.synchronize()
            torch.matmul(x, x, out=out)
            torch.cuda.synchronize()

    return run


class CtypesTrace:
    """Activity records through libcupti's C API, parsed at fixed offsets."""

    def __init__(self, lib: ctypes.CDLL, table: list[int]) -> None:
        self.lib = lib
        k_start, k_end, k_name, c_start, c_bytes, s_start, s_bytes, p_start = table
        assert k_start == c_start == s_start == p_start, table
        self.start = k_start
        self.k_name = k_name
        self.c_bytes = c_bytes
        self.s_bytes = s_bytes
        self.records: list[tuple[int, int, str]] = []
        self.buffers: dict[int, Any] = {}
        self.size = 8 << 20
        request = ctypes.CFUNCTYPE(
            None,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.POINTER(ctypes.c_size_t),
        )
        complete = ctypes.CFUNCTYPE(
            None,
            ctypes.c_void_p,
            ctypes.c_uint32,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_size_t,
        )
        self._request = request(self._requested)
        self._complete = complete(self._completed)
        lib.cuptiActivityGetNextRecord.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.POINTER(ctypes.c_void_p),
        ]
        lib.cuptiActivityFlushAll.argtypes = [ctypes.c_uint32]
        lib.cuptiActivityEnable.argtypes = [ctypes.c_int]
        lib.cuptiActivityDisable.argtypes = [ctypes.c_int]
        status = lib.cuptiActivityRegisterCallbacks(self._request, self._complete)
        assert status == 0, status

    def _requested(self, buffer: Any, size: Any, most: Any) -> None:
        block = ctypes.create_string_buffer(self.size)
        address = ctypes.addressof(block)
        self.buffers[address] = block
        buffer[0] = address
        size[0] = self.size
        most[0] = 0

    def _completed(self, _ctx: Any, _stream: int, buffer: int, _size: int, valid: int) -> None:
        block = self.buffers.pop(buffer, None)
        if block is None or not valid:
            return
        view = memoryview(block)
        record = ctypes.c_void_p(None)
        nxt = self.lib.cuptiActivityGetNextRecord
        from_bytes = int.from_bytes
        append = self.records.append
        start = self.start
        while nxt(buffer, valid, ctypes.byref(record)) == 0:
            at = record.value - buffer
            kind = from_bytes(view[at : at + 4], "little")
            begin = from_bytes(view[at + start : at + start + 8], "little")
            end = from_bytes(view[at + start + 8 : at + start + 16], "little")
            if kind == 10:  # CONCURRENT_KERNEL
                name_ptr = from_bytes(view[at + self.k_name : at + self.k_name + 8], "little")
                label = "kernel:" + ctypes.string_at(name_ptr).decode(errors="replace")
            elif kind == 1:
                copied = from_bytes(view[at + self.c_bytes : at + self.c_bytes + 8], "little")
                label = f"memcpy:{copied}"
            elif kind == 2:
                written = from_bytes(view[at + self.s_bytes : at + self.s_bytes + 8], "little")
                label = f"memset:{written}"
            else:
                label = f"kind{kind}"
            append((begin, end, label))


def child(variant: str, table: list[int]) -> dict[str, Any]:
    import torch
    from cupti import cupti

    from kcoral.worker.gpu_builtins.activity import ActivityTrace

    torch.ones(1, device="cuda").sum().item()
    run = workload(torch)
    run(3)
    kinds = [
        cupti.ActivityKind.CONCURRENT_KERNEL,
        cupti.ActivityKind.MEMCPY,
        cupti.ActivityKind.MEMSET,
        cupti.ActivityKind.MEMCPY2,
    ]
    counted = {"records": 0}
    lib = None
    trace: Any = None
    if variant == "python":

        def requested() -> tuple[int, int]:
            return 8 << 20, 0

        def completed(activities: list[Any]) -> None:
            counted["records"] += len(activities)

        cupti.activity_register_callbacks(requested, completed)
    elif variant == "kcoral":
        trace = ActivityTrace(cupti)
        cupti.activity_register_callbacks(trace._requested, trace._completed)
    else:
        cupti.activity_enable(kinds[0])  # loads libcupti and initialises it
        cupti.activity_disable(kinds[0])
        lib = ctypes.CDLL(libcupti_path())
        trace = CtypesTrace(lib, table)
    rounds = []
    sample: list[Any] = []
    for _ in range(ROUNDS):
        if trace is not None:
            trace.gpu = [] if variant == "kcoral" else None
            if variant == "ctypes":
                trace.records = []
        counted["records"] = 0
        t0 = time.perf_counter()
        for kind in kinds:
            if lib is not None:
                assert lib.cuptiActivityEnable(int(kind)) == 0
            else:
                cupti.activity_enable(kind)
        t1 = time.perf_counter()
        run(ITERATIONS)
        t2 = time.perf_counter()
        if lib is not None:
            assert lib.cuptiActivityFlushAll(1) == 0
        else:
            cupti.activity_flush_all(1)
        t3 = time.perf_counter()
        for kind in reversed(kinds):
            if lib is not None:
                lib.cuptiActivityDisable(int(kind))
            else:
                cupti.activity_disable(kind)
        t4 = time.perf_counter()
        if variant == "kcoral":
            records = trace.gpu
        elif variant == "ctypes":
            records = trace.records
        else:
            records = [None] * counted["records"]
        sample = records[:6] if variant != "python" else []
        labels: dict[str, int] = {}
        for r in records:
            if r is not None:
                key = r[2].split("(")[0][:40]
                labels[key] = labels.get(key, 0) + 1
        rounds.append(
            {
                "enable_ms": (t1 - t0) * 1e3,
                "loop_ms": (t2 - t1) * 1e3,
                "flush_ms": (t3 - t2) * 1e3,
                "disable_ms": (t4 - t3) * 1e3,
                "records": len(records),
                "labels": labels,
            }
        )
    return {
        "variant": variant,
        "rounds": rounds,
        "flush_ms_median": statistics.median(r["flush_ms"] for r in rounds[1:]),
        "loop_ms_median": statistics.median(r["loop_ms"] for r in rounds[1:]),
        "sample": [list(s) for s in sample],
    }


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        table = json.loads(sys.argv[3])
        print(json.dumps(child(sys.argv[2], table)))
        return
    table = offsets()
    print(
        "offsets (kernel start, end, name; memcpy start, bytes; memset start, bytes; p2p start):",
        table,
    )
    results = []
    for variant in ("python", "kcoral", "ctypes", "python", "kcoral", "ctypes"):
        out = subprocess.run(
            [sys.executable, __file__, "--child", variant, json.dumps(table)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if out.returncode != 0:
            print(variant, "failed:", out.stderr[-2000:])
            continue
        result = json.loads(out.stdout.strip().splitlines()[-1])
        results.append(result)
        print(
            f"{variant:7s} flush {result['flush_ms_median']:.2f} ms, loop {result['loop_ms_median']:.1f} ms, "
            f"records {result['rounds'][-1]['records']} {result['rounds'][-1]['labels']}"
        )
        if result["sample"]:
            print("   ", result["sample"][:3])
    path = Path(__file__).resolve().parents[1] / "results" / "cupti_ctypes.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"offsets": table, "results": results}, indent=1))


if __name__ == "__main__":
    main()
