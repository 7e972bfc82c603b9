"""
How requests held a GPU, from a server's own log: the hold of each
exclusive grant (C{lease_released}'s C{held_ms}) and the hand-over gap, the
time from a release to the next exclusive grant of the same GPU when that
grant had waited (someone was in line, so the GPU sat unheld only for the
server's own reasons).

    python bench/probes/overlap_gaps.py logs/runs/<run>/events.jsonl

With a GPU-bound workload (bench/ref_driver.py overlap) the requests per
second are at most 1000 / (hold + gap) per GPU: this says which of the two
keeps a run below the kernel-time bound.  Prints p50/mean of both and the
share of the logged span each covers; writes C{--output} (JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
from lease_overlap import seconds  # noqa: E402


def analyse(lines: list[dict[str, Any]]) -> dict[str, Any]:
    holds: list[float] = []
    gaps: list[float] = []
    released_at: dict[int, float] = {}
    first = last = None
    for event in lines:
        name = event.get("event") or event.get("kcoral_event")
        if (
            name not in ("lease_granted", "lease_released")
            or event.get("mode", "exclusive") != "exclusive"
        ):
            continue
        now = seconds(event.get("timestamp"))
        if now is None:
            continue
        first = now if first is None else first
        last = now
        for gpu in event.get("gpu_ids") or []:
            if name == "lease_released":
                holds.append(float(event.get("held_ms") or 0.0))
                released_at[gpu] = now
            elif float(event.get("wait_ms") or 0.0) > 0.0 and gpu in released_at:
                gaps.append((now - released_at[gpu]) * 1000.0)
    span_ms = ((last or 0.0) - (first or 0.0)) * 1000.0

    def describe(values: list[float]) -> dict[str, float]:
        if not values:
            return {"n": 0}
        return {
            "n": len(values),
            "p50": statistics.median(values),
            "mean": statistics.fmean(values),
            "total_ms": sum(values),
            "share_of_span": sum(values) / span_ms if span_ms else 0.0,
        }

    return {"span_ms": span_ms, "hold_ms": describe(holds), "handover_gap_ms": describe(gaps)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("events", nargs="+", type=Path)
    parser.add_argument("--output", type=Path, default=Path("bench/results/overlap_gaps.json"))
    args = parser.parse_args(argv)
    lines = []
    for path in args.events:
        with path.open() as f:
            lines.extend(json.loads(line) for line in f if line.strip())
    result = analyse(lines)
    for key in ("hold_ms", "handover_gap_ms"):
        figures = result[key]
        if figures["n"]:
            print(
                f"{key:<16} n={figures['n']} p50 {figures['p50']:.3f} ms, mean "
                f"{figures['mean']:.3f} ms, {figures['share_of_span']:.1%} of the span"
            )
        else:
            print(f"{key:<16} none")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
