"""
The table of bench/run_fresh_gpu.sh: kcoral (sandbox none, bubblewrap) and
the reference server in fresh-worker mode, with ratios and issue 14's targets.

    python bench/fresh_table.py bench/results [--output bench/results/fresh_table.json]

Reads fresh_<server>.json (bench/fresh_load.py) and fresh_overlap_<server>.json
(bench/lease_overlap.py) from the directory; a missing file leaves its
column empty.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

SERVERS = ("none", "bubblewrap", "reference")

#: (figure, unit, target text, check on kcoral's value or None, higher is better)
ROWS: list[tuple[str, str, str, Any, bool]] = [
    ("null.c8.rps", "req/s", ">= 6/s and >= 4.5x ref", lambda v: v >= 6.0, True),
    ("null.c8.p50", "ms", "", None, False),
    ("open.r3.p50", "ms", "<= 15 ms", lambda v: v <= 15.0, False),
    ("open.r3.p99", "ms", "<= 50 ms", lambda v: v <= 50.0, False),
    ("copy.idle.median", "ms", "", None, False),
    ("copy.idle.cv", "%", "", None, False),
    ("copy.churn.median", "ms", "", None, False),
    ("copy.churn.cv", "%", "< 2 %", lambda v: v < 2.0, False),
    ("copy.churn.vs_idle", "ratio-1", "within 2 %", lambda v: abs(v) <= 0.02, False),
    ("copy.churn.requests", "req", "", None, True),
]


def _load(path: Path) -> dict[str, Any] | None:
    try:
        loaded: dict[str, Any] = json.loads(path.read_text())
        return loaded
    except (OSError, ValueError):
        return None


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" if abs(value) < 1 else f"{value:.2f}"


def build(directory: Path) -> dict[str, Any]:
    runs = {name: _load(directory / f"fresh_{name}.json") for name in SERVERS}
    overlaps = {name: _load(directory / f"fresh_overlap_{name}.json") for name in SERVERS[:2]}
    rows = []
    for figure, unit, target, ok, _higher in ROWS:
        values = {name: (run or {}).get("figures", {}).get(figure) for name, run in runs.items()}
        none, bwrap, ref = values["none"], values["bubblewrap"], values["reference"]
        row = {
            "figure": figure,
            "unit": unit,
            **values,
            "none_vs_ref": none / ref if none is not None and ref else None,
            "bwrap_vs_none": bwrap / none if bwrap is not None and none else None,
            "target": target,
            "met": None
            if ok is None or none is None or bwrap is None
            else bool(ok(none) and ok(bwrap)),
        }
        if figure == "null.c8.rps" and row["met"] is not None and row["none_vs_ref"] is not None:
            row["met"] = row["met"] and row["none_vs_ref"] >= 4.5
        rows.append(row)
    gpus = {}
    for name, report in overlaps.items():
        if report is not None:
            gpus[name] = {
                "overlaps": len(report.get("overlaps", [])),
                "per_gpu": report.get("gpus", {}),
            }
    return {
        "rows": rows,
        "lease_overlap": gpus,
        "failed": {n: (r or {}).get("failed") for n, r in runs.items()},
    }


def render(table: dict[str, Any]) -> str:
    lines = [
        f"{'figure':<22} {'unit':<8} {'none':>10} {'bwrap':>10} {'reference':>10} "
        f"{'none/ref':>9} {'bwrap/none':>10}  target (met)"
    ]
    for row in table["rows"]:
        met = "" if row["met"] is None else (" yes" if row["met"] else " NO")
        lines.append(
            f"{row['figure']:<22} {row['unit']:<8} {_fmt(row['none']):>10} "
            f"{_fmt(row['bubblewrap']):>10} {_fmt(row['reference']):>10} "
            f"{_fmt(row['none_vs_ref']):>9} {_fmt(row['bwrap_vs_none']):>10}  {row['target']}{met}"
        )
    for name, facts in table["lease_overlap"].items():
        lines.append(f"lease/context overlaps ({name}): {facts['overlaps']}")
        for gpu, per in facts["per_gpu"].items():
            lines.append(
                f"  GPU {gpu}: {per.get('contexts_created')} contexts created in "
                f"{per.get('create_busy_s')} s of creation = {per.get('creates_per_busy_s')} /s "
                f"(the measured bound); median create {per.get('create_ms_median')} ms, "
                f"teardown {per.get('teardown_ms_median')} ms"
            )
    failed = {n: f for n, f in table["failed"].items() if f}
    if failed:
        lines.append(f"failed workloads: {failed}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    table = build(args.directory)
    print(render(table))
    if args.output:
        args.output.write_text(json.dumps(table, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
