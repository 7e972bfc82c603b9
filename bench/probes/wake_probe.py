#!/usr/bin/env python3
"""
What waking a blocked process costs on this host: a one-byte ping-pong over
two pipes between two processes, the answering side either blocked in
C{read} (woken by the kernel) or spinning on a non-blocking read, and the
asking side the same.  With C{--busy N}, N more processes spin on the CPU
meanwhile (the overlap workload keeps several workers busy).

A lease hand-over crosses two such wakes (the parent's reactor reading the
release, the next worker reading its grant): this says what each costs.

    python3 bench/probes/wake_probe.py [--rounds 5000] [--busy 0,6]

Prints the one-way latency (half the round trip) p50 / p90 per mode and
writes C{--output} (JSON).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time
from pathlib import Path


def _read_one(fd: int, spin: bool) -> None:
    if not spin:
        os.read(fd, 1)
        return
    while True:
        try:
            if os.read(fd, 1):
                return
        except BlockingIOError:
            pass


def _answer(inbox: int, outbox: int, spin: bool, rounds: int) -> None:
    os.set_blocking(inbox, not spin)
    for _ in range(rounds):
        _read_one(inbox, spin)
        os.write(outbox, b"x")


def _busy(stop: float) -> None:
    while time.time() < stop:
        pass


def one_way_us(spin_answer: bool, spin_ask: bool, rounds: int) -> list[float]:
    to_child, from_parent = os.pipe()
    to_parent, from_child = os.pipe()
    child = multiprocessing.Process(
        target=_answer, args=(to_child, from_child, spin_answer, rounds)
    )
    child.start()
    os.set_blocking(to_parent, not spin_ask)
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        os.write(from_parent, b"x")
        _read_one(to_parent, spin_ask)
        samples.append((time.perf_counter() - started) * 1e6 / 2)
        # Let both sides fall asleep between rounds, as a hand-over finds them.
        time.sleep(0.002)
    child.join()
    for fd in (to_child, from_parent, to_parent, from_child):
        os.close(fd)
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument(
        "--busy", default="0,6", help="comma-separated counts of spinning processes"
    )
    parser.add_argument("--output", type=Path, default=Path("bench/results/wake_probe.json"))
    args = parser.parse_args(argv)
    results = []
    for busy in [int(b) for b in args.busy.split(",") if b.strip()]:
        spinners = [
            multiprocessing.Process(target=_busy, args=(time.time() + 3600,)) for _ in range(busy)
        ]
        for p in spinners:
            p.start()
        try:
            for spin_answer, spin_ask in ((False, False), (True, False), (True, True)):
                samples = sorted(one_way_us(spin_answer, spin_ask, args.rounds))
                row = {
                    "busy": busy,
                    "answer": "spin" if spin_answer else "block",
                    "ask": "spin" if spin_ask else "block",
                    "p50_us": statistics.median(samples),
                    "p90_us": samples[len(samples) * 9 // 10],
                    "mean_us": statistics.fmean(samples),
                }
                results.append(row)
                print(
                    f"busy {busy:>2}, answer {row['answer']:<5}, ask {row['ask']:<5}: one way "
                    f"p50 {row['p50_us']:7.1f} us, p90 {row['p90_us']:7.1f} us"
                )
        finally:
            for p in spinners:
                p.terminate()
                p.join()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps({"benchmark": "wake_probe", "cpus": os.cpu_count(), "rows": results}, indent=2)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
