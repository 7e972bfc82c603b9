"""
Prove from a server's own log that no two holders ever held one GPU at once.

    python bench/lease_overlap.py logs/runs/<run>/events.jsonl [more files...]

The lease arbiter logs every grant (`lease_granted`) and release
(`lease_released`) in the order it makes them, with the GPU ids and the
holder.  Replaying those events per GPU, a grant of a GPU that is still held
is an overlap.  Prints a summary per GPU and writes
bench/results/lease_overlap.json; exits 1 when an overlap is found.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def check(paths: list[Path]) -> dict[str, Any]:
    """Replay the lease events of C{paths} (in order) and report overlaps."""
    holders: dict[int, Any] = {}
    grants: dict[int, int] = {}
    requests: dict[int, set[str]] = {}
    overlaps: list[dict[str, Any]] = []
    for path in paths:
        for line in path.read_text().splitlines():
            event = json.loads(line)
            name = event.get("event")
            if name not in ("lease_granted", "lease_released"):
                continue
            holder = event.get("holder")
            for gpu in event.get("gpu_ids", []):
                if name == "lease_granted":
                    if gpu in holders:
                        overlaps.append(
                            {
                                "gpu": gpu,
                                "held_by": holders[gpu],
                                "granted_to": holder,
                                "timestamp": event.get("timestamp"),
                            }
                        )
                    holders[gpu] = holder
                    grants[gpu] = grants.get(gpu, 0) + 1
                    if event.get("request_id"):
                        requests.setdefault(gpu, set()).add(event["request_id"])
                else:
                    holders.pop(gpu, None)
    return {
        "files": [str(p) for p in paths],
        "gpus": {
            str(gpu): {"grants": count, "requests": len(requests.get(gpu, ()))}
            for gpu, count in sorted(grants.items())
        },
        "overlaps": overlaps,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("events", nargs="+", type=Path, help="events.jsonl files, oldest first")
    parser.add_argument("--output", type=Path, default=Path("bench/results/lease_overlap.json"))
    args = parser.parse_args()
    report = check(args.events)
    for gpu, facts in report["gpus"].items():
        print(f"GPU {gpu}: {facts['grants']} grants for {facts['requests']} requests")
    print(f"overlaps: {len(report['overlaps'])}")
    for overlap in report["overlaps"][:10]:
        print(f"  {overlap}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    return 1 if report["overlaps"] else 0


if __name__ == "__main__":
    sys.exit(main())
