#!/usr/bin/env python3
"""
Where a GPU hold's time goes beyond its kernel: the overlap workload (a
C{cpu_only} busy-wait, then one calibrated C{torch.cuda._sleep} kernel and a
synchronize, as C{ref_driver.py overlap} sends it), with the worker's own
host clock stamped at each step.  The uploaded module wraps the worker's
lease messages (a program may do anything in its worker; this one stamps
when a grant arrived and when a release left), and its GPU function stamps
its entry, its launch's return and its synchronize's return.  Ordered on
the GPU by grant, each request's hold and the hand-over to the next split
into:

- C{grant_to_launch}: the grant read in the worker until the kernel's
  launch returned (the engine running the function, the launch);
- C{kernel}: launch to synchronize, the GPU work itself;
- C{sync_to_release}: the synchronize returning until the release left the
  worker (the function returning, the engine's drain, the next instruction);
- C{release_to_grant}: the release leaving one worker until the next
  holder read its grant (the parent reading the release, the arbiter, the
  grant's delivery): the GPU is unheld and someone waits;
- C{server_hold_extra}: the server's own C{lease_held_ms} beyond the
  worker's grant-to-release span (the reactor's delay in reading the
  release, and in sending the grant).

    python3 bench/handover_probe.py --url http://127.0.0.1:8000 --clients 8 --seconds 8

Prints p10 / p50 / p90 / mean of each and writes C{--output} (JSON).  The
worker's clock is the host's wall clock.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from spin_source import CALIBRATED_SLEEP, CPU_WORK  # noqa: E402

SOURCE = (
    '''
import os
import time


def _stamps():
    """Wrap this worker's lease messages once; the stamps outlive a program."""
    import kcoral.worker.lease as lease

    stamps = getattr(lease, "_handover_probe", None)
    if stamps is not None:
        return stamps
    stamps = {"granted": None, "released": None}
    read, write = lease.read_message, lease.write_message

    def read_message(stream):
        message = read(stream)
        if type(message).__name__ == "LeaseGranted":
            stamps["granted"] = time.time()
        return message

    def write_message(stream, message):
        if type(message).__name__ == "LeaseRelease":
            stamps["released"] = time.time()
        write(stream, message)

    lease.read_message, lease.write_message = read_message, write_message
    lease._handover_probe = stamps
    return stamps

def gpu_stamped(ms):
    """One spin kernel of about ms milliseconds, and the worker's stamps."""
    entered = time.time()
    stamps = _stamps()
    granted, released_before = stamps["granted"], stamps["released"]
    import torch

    torch.cuda._sleep(int(ms * _cycles_per_ms(torch)))
    launched = time.time()
    torch.cuda.synchronize()
    synced = time.time()
    return [os.getpid(), granted or 0.0, released_before or 0.0, entered, launched, synced]
'''
    + CPU_WORK
    + CALIBRATED_SLEEP
)


def split(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """
    The phases of each hold and hand-over.  A worker's release of one request
    is reported by its next request (the stamp is taken after the function
    returns), so it is joined by worker and order.
    """
    by_worker: dict[int, list[dict[str, Any]]] = {}
    for sample in sorted(samples, key=lambda s: s["entered"]):
        by_worker.setdefault(sample["pid"], []).append(sample)
    for runs in by_worker.values():
        for earlier, later in zip(runs, runs[1:], strict=False):
            if later["released_before"] > earlier["synced"]:
                earlier["released"] = later["released_before"]
    # A grant stamp is this request's only when it came after the worker's
    # previous release (the first program of a worker installs the wrapper).
    held = [
        s
        for s in samples
        if "released" in s and s["released_before"] < s["granted"] <= s["launched"]
    ]
    rows: dict[str, list[float]] = {
        "grant_to_entry": [],
        "grant_to_launch": [],
        "kernel": [],
        "sync_to_release": [],
        "worker_hold": [],
        "server_hold_extra": [],
        "release_to_grant": [],
    }
    for s in held:
        rows["grant_to_entry"].append((s["entered"] - s["granted"]) * 1e3)
        rows["grant_to_launch"].append((s["launched"] - s["granted"]) * 1e3)
        rows["kernel"].append((s["synced"] - s["launched"]) * 1e3)
        rows["sync_to_release"].append((s["released"] - s["synced"]) * 1e3)
        worker_hold = (s["released"] - s["granted"]) * 1e3
        rows["worker_hold"].append(worker_hold)
        rows["server_hold_extra"].append(s["lease_held_ms"] - worker_hold)
    ordered = sorted(held, key=lambda s: s["granted"])
    for earlier, later in zip(ordered, ordered[1:], strict=False):
        gap = (later["granted"] - earlier["released"]) * 1e3
        if later["lease_wait_ms"] > gap and gap >= 0.0:
            # The next holder was in line when the GPU was given back.
            rows["release_to_grant"].append(gap)
    result: dict[str, Any] = {key: describe(values) for key, values in rows.items()}
    if len(ordered) > 1:
        span = (ordered[-1]["granted"] - ordered[0]["granted"]) * 1e3
        result["gpu_ms_per_request"] = span / (len(ordered) - 1)
    return result


def describe(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    return {
        "n": len(values),
        "p10": ordered[len(ordered) // 10],
        "p50": statistics.median(values),
        "p90": ordered[(len(ordered) * 9) // 10],
        "mean": statistics.fmean(values),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_server_args(parser, "handover_probe")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--cpu-ms", type=float, default=50.0)
    parser.add_argument("--gpu-ms", type=float, default=10.0)
    args = parser.parse_args(argv)
    program = common.module_program(
        SOURCE, [("cpu_work", [args.cpu_ms], True), ("gpu_stamped", [args.gpu_ms], False)]
    )
    fields = ("pid", "granted", "released_before", "entered", "launched", "synced")

    def one(conn: common.Connection, _i: int) -> dict[str, Any]:
        reply = conn.execute(program)
        if reply.outcome != "COMPLETED":
            raise RuntimeError(f"probe program answered {reply.outcome}: {reply.describe_error()}")
        value = reply.result["results"]["out"]["value"]  # an array of numbers
        sample = dict(zip(fields, (item["value"] for item in value), strict=True))
        sample["lease_held_ms"] = float(reply.result["lease_held_ms"])
        sample["lease_wait_ms"] = float(reply.result["lease_wait_ms"])
        return sample

    with common.server_from_args(args) as (host, port, where):
        common.run_concurrent(host, port, args.clients, 4 * args.clients, one, args.seconds)
        samples, seconds = common.run_concurrent(
            host, port, args.clients, 100_000, one, args.seconds
        )
    result = split(samples)
    result["requests_per_second"] = len(samples) / seconds
    result["share_of_gpu_bound"] = result["requests_per_second"] * args.gpu_ms / 1e3
    result["server"] = where
    result["label"] = args.label
    print(
        f"{len(samples)} requests, {result['requests_per_second']:.1f}/s, "
        f"{result['share_of_gpu_bound']:.3f} of the GPU bound, "
        f"{result.get('gpu_ms_per_request', 0.0):.3f} ms of GPU time per request"
    )
    for key in (
        "grant_to_entry",
        "grant_to_launch",
        "kernel",
        "sync_to_release",
        "worker_hold",
        "server_hold_extra",
        "release_to_grant",
    ):
        row = result[key]
        if row["n"]:
            print(
                f"{key:<18} n={row['n']:<5} p10 {row['p10']:7.3f}  p50 {row['p50']:7.3f}  "
                f"p90 {row['p90']:7.3f}  mean {row['mean']:7.3f} ms"
            )
        else:
            print(f"{key:<18} none")
    common.write_result(args.output, {"benchmark": "handover_probe", **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
