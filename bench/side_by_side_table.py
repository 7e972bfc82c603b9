"""
The side-by-side table: ref_driver.py's JSON for the stub floor, kcoral and
the reference, one row per figure, with the ratios and issue 15's targets.

    python3 bench/side_by_side_table.py STUB.json KCORAL.json REFERENCE.json [--output T.json]

A missing or failed file leaves its column empty. Standard library only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

#: Figures the stub has no floor for (it answers without running anything).
NO_FLOOR = ("overlap.", "copy.")


def load(path: str) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {"figures": {}, "units": {}}


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def targets(ours: dict[str, float], ref: dict[str, float], floor: dict[str, float]) -> list:
    """Issue 15's targets: (what, value, goal, met) with None where a figure is missing."""
    rows = []

    def add(what: str, value: float | None, goal: str, ok: Any) -> None:
        rows.append((what, value, goal, None if value is None else bool(ok(value))))

    add(
        "null rps at 8 clients, kcoral / reference",
        ratio(ours.get("null.rps.c8"), ref.get("null.rps.c8")),
        ">= 2",
        lambda v: v >= 2,
    )
    levels = {int(k[len("null.rps.c") :]): v for k, v in ours.items() if k.startswith("null.rps.c")}
    # The busiest level: 64 clients in the full run, fewer in a short one.
    top = max(levels, default=64)
    add(
        f"null rps at {top} clients / kcoral's peak",
        ratio(levels.get(top), max(levels.values(), default=None)),
        ">= 0.9",
        lambda v: v >= 0.9,
    )
    add(
        "  the same, per round (median of rounds)",
        ours.get(f"null.round_peak_share.c{top}"),
        ">= 0.9",
        lambda v: v >= 0.9,
    )
    add(
        "null sequential p50, kcoral / reference",
        ratio(ours.get("null.sequential.p50"), ref.get("null.sequential.p50")),
        "<= 0.6",
        lambda v: v <= 0.6,
    )
    add(
        "64 MiB round trip, kcoral / floor",
        ratio(ours.get("tensor.roundtrip.p50"), floor.get("tensor.roundtrip.p50")),
        "<= 1.5",
        lambda v: v <= 1.5,
    )
    add(
        "64 MiB round trip, reference / kcoral",
        ratio(ref.get("tensor.roundtrip.p50"), ours.get("tensor.roundtrip.p50")),
        ">= 5",
        lambda v: v >= 5,
    )
    shares = [v for k, v in ours.items() if k.startswith("overlap.share.")]
    add(
        "overlap, share of the GPU-bound limit",
        max(shares) if shares else None,
        ">= 0.9",
        lambda v: v >= 0.9,
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stub")
    parser.add_argument("kcoral")
    parser.add_argument("reference")
    parser.add_argument("--output", help="write the table as JSON here too")
    args = parser.parse_args(argv)
    runs = {name: load(getattr(args, name)) for name in ("stub", "kcoral", "reference")}
    floor, ours, ref = (runs[n]["figures"] for n in ("stub", "kcoral", "reference"))
    units: dict[str, str] = {}
    for run in runs.values():
        units.update(run.get("units") or {})
    names = list(dict.fromkeys([*ours, *ref, *floor]))
    header = f"{'figure':<28} {'unit':<8} {'floor':>10} {'kcoral':>10} {'reference':>10} {'kc/ref':>8} {'kc/floor':>9}"
    print(header)
    print("-" * len(header))
    rows = []
    for name in names:
        f, o, r = floor.get(name), ours.get(name), ref.get(name)
        if name.startswith(NO_FLOOR):
            # The stub does no GPU work: its overlap figures are no floor.
            f = None
        row = {
            "figure": name,
            "unit": units.get(name, ""),
            "floor": f,
            "kcoral": o,
            "reference": r,
            "kcoral_over_reference": ratio(o, r),
            "kcoral_over_floor": ratio(o, f),
        }
        rows.append(row)
        print(
            f"{name:<28} {row['unit']:<8} {fmt(f):>10} {fmt(o):>10} {fmt(r):>10} "
            f"{fmt(row['kcoral_over_reference']):>8} {fmt(row['kcoral_over_floor']):>9}"
        )
    print()
    print("targets (issue 15):")
    goals = targets(ours, ref, floor)
    for what, value, goal, met in goals:
        verdict = "n/a" if met is None else ("met" if met else "MISSED")
        print(f"  {what:<42} {fmt(value):>8}  goal {goal:<7} {verdict}")
    for name, run in runs.items():
        if run.get("failed"):
            print(
                f"!! {name}: failed workloads {run['failed']}: {run.get('details', {}).get('errors')}"
            )
    if args.output:
        Path(args.output).write_text(
            json.dumps(
                {
                    "rows": rows,
                    "targets": [
                        {"what": w, "value": v, "goal": g, "met": m} for w, v, g, m in goals
                    ],
                    "labels": {n: r.get("label") for n, r in runs.items()},
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
