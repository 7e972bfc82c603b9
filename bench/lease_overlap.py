"""
Prove from a server's own log that no GPU work overlapped another holder's.

    python bench/lease_overlap.py logs/runs/<run>/events.jsonl [more files...]

The lease arbiter logs every grant (`lease_granted`) and release
(`lease_released`) in the order it makes them, with the GPU ids, the holder,
its pid and the lease `mode`; workers log every CUDA context creation and
teardown (`context_create_started`/`_finished`,
`context_teardown_started`/`_finished`).  All are logged on the reactor
thread, so the file's line order is the order they happened in.  Replaying
them per GPU, each of these is an overlap:

- `exclusive`: an exclusive grant of a GPU another holder holds exclusively
  (two measurements at once);
- `maintenance`: an exclusive grant while maintenance holds (context
  creations/teardowns) are open, or a maintenance grant while another holder
  holds the GPU exclusively;
- `context`: a context creation or teardown that starts while another
  holder holds the GPU exclusively, or an exclusive grant to another holder
  while one is in progress;
- `context_outside_hold` (several front ends, `--front-ends N`): the lease
  events are in the first front end's log only, and another front end's
  log has its workers' context events; each of those must lie inside a
  hold (maintenance or exclusive) of its own worker, by the events' times.
  Pass every front end's `events.jsonl` at once.

A holder is its worker id and pid (a seat's worker id outlives its
processes).  Logs without `mode` (older servers) are read as exclusive.
It also charges the time between events to what the GPU was doing
(exclusive hold, context creation, teardown, another maintenance hold such
as a retired worker's exit, idle): where a fresh-worker run's GPU time goes.
Prints a summary per GPU and writes bench/results/lease_overlap.json; exits 1
when an overlap is found.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

_CONTEXT_STARTED = {"context_create_started": "create", "context_teardown_started": "teardown"}
_CONTEXT_FINISHED = {"context_create_finished": "create", "context_teardown_finished": "teardown"}


def _who(event: dict[str, Any], key: str) -> tuple[Any, Any]:
    return (event.get(key), event.get("pid"))


def seconds(timestamp: Any) -> float | None:
    """An event's time in seconds: events.jsonl has UTC ISO-8601 text (ms)."""
    if isinstance(timestamp, (int, float)):
        return float(timestamp)
    if isinstance(timestamp, str):
        try:
            return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return round(ordered[middle], 3)
    return round((ordered[middle - 1] + ordered[middle]) / 2, 3)


def _name(who: tuple[Any, Any]) -> Any:
    name, pid = who
    return name if pid is None else f"{name} (pid {pid})"


class _Gpu:
    """One GPU's replayed state and counts."""

    def __init__(self) -> None:
        self.exclusive: tuple[Any, Any] | None = None
        self.maintainers: set[tuple[Any, Any]] = set()
        #: Context operations in progress: worker -> kind.
        self.contexts: dict[tuple[Any, Any], str] = {}
        self.grants = 0
        self.maintenance_grants = 0
        self.requests: set[str] = set()
        self.created = 0
        self.torn_down = 0
        #: Seconds with at least one creation (teardown) in progress, and
        #: since when the current such stretch runs.
        self.busy = {"create": 0.0, "teardown": 0.0}
        self.busy_since: dict[str, float | None] = {"create": None, "teardown": None}
        self.durations: dict[str, list[float]] = {"create": [], "teardown": []}
        #: Seconds the GPU spent in each L{_Gpu.phase}, between its first
        #: event and its last.
        self.occupancy: dict[str, float] = {}
        self.last_seen: float | None = None

    def phase(self) -> str:
        """
        What the GPU does now: a measurement (C{exclusive}), a context being
        made or destroyed, a maintenance hold with neither (a retired worker's
        exit awaited, a hold not yet given back), or nothing.
        """
        if self.exclusive is not None:
            return "exclusive"
        if self.running("create"):
            return "creating"
        if self.running("teardown"):
            return "tearing_down"
        if self.maintainers:
            return "maintenance_other"
        return "idle"

    def advance(self, now: float | None) -> None:
        """Charge the time since the last event to the phase it was in."""
        if now is None:
            return
        if self.last_seen is not None and now > self.last_seen:
            phase = self.phase()
            self.occupancy[phase] = self.occupancy.get(phase, 0.0) + now - self.last_seen
        self.last_seen = now

    def running(self, kind: str) -> int:
        return sum(1 for k in self.contexts.values() if k == kind)

    def count_finished(self, kind: str, event: dict[str, Any]) -> None:
        """Count a finished context creation or teardown, and its duration."""
        if kind == "create":
            self.created += 1
        else:
            self.torn_down += 1
        if isinstance(event.get("duration_ms"), (int, float)):
            self.durations[kind].append(float(event["duration_ms"]))


def _overlap(kind: str, gpu: int, held_by: Any, by: Any, event: dict[str, Any]) -> dict[str, Any]:
    """One reported overlap: C{by} got the GPU (or used it) while C{held_by} held it."""
    return {
        "kind": kind,
        "gpu": gpu,
        "held_by": None if held_by is None else _name(held_by),
        "granted_to": _name(by),
        "event": event.get("event"),
        "timestamp": event.get("timestamp"),
    }


_LEASE_EVENTS = ("lease_granted", "lease_released")

#: Per (GPU, holder): its holds, C{[granted, released]} in seconds (C{None}
#: while not released).
Holds = dict[tuple[int, tuple[Any, Any]], list[list[float | None]]]


def _holds(events: list[dict[str, Any]]) -> Holds:
    """Every hold of every holder, from the lease events (either mode)."""
    holds: Holds = {}
    for event in events:
        name = event.get("event")
        if name not in _LEASE_EVENTS:
            continue
        when = seconds(event.get("timestamp"))
        for gpu in event.get("gpu_ids") or []:
            spans = holds.setdefault((gpu, _who(event, "holder")), [])
            if name == "lease_granted":
                spans.append([when, None])
            elif spans and spans[-1][1] is None:
                spans[-1][1] = when
    return holds


def _check_contained(
    event: dict[str, Any], holds: Holds, gpus: dict[int, _Gpu], overlaps: list[dict[str, Any]]
) -> None:
    """
    A context event logged by another front end: inside a hold of its own
    worker on that GPU, bounds included (the times are the same clock's, to
    the millisecond, and the grant is logged before the worker hears of it,
    the release after it said it was done), or it is reported.
    """
    name = event.get("event")
    if name not in _CONTEXT_STARTED and name not in _CONTEXT_FINISHED:
        return
    who = _who(event, "worker_id")
    when = seconds(event.get("timestamp"))
    for gpu in event.get("gpu_ids") or []:
        state = gpus.setdefault(gpu, _Gpu())
        if name in _CONTEXT_FINISHED:
            state.count_finished(_CONTEXT_FINISHED[name], event)
        inside = when is not None and any(
            start is not None and start <= when and (end is None or when <= end)
            for start, end in holds.get((gpu, who), [])
        )
        if not inside:
            overlaps.append(_overlap("context_outside_hold", gpu, None, who, event))


def check(paths: list[Path]) -> dict[str, Any]:
    """Replay the lease and context events of C{paths} (in order) and report overlaps."""
    gpus: dict[int, _Gpu] = {}
    overlaps: list[dict[str, Any]] = []

    def overlap(kind: str, gpu: int, held_by: Any, by: Any, event: dict[str, Any]) -> None:
        overlaps.append(_overlap(kind, gpu, held_by, by, event))

    logs = [(path, [json.loads(line) for line in path.read_text().splitlines()]) for path in paths]
    # The files that have lease events: the lease arbiter's (with several
    # front ends, the first's).  Another front end's file has only its own
    # workers' context events: each must lie inside a hold of its own.
    lease_logs = [
        events for _path, events in logs if any(e.get("event") in _LEASE_EVENTS for e in events)
    ]
    holds = _holds([e for events in lease_logs for e in events]) if lease_logs else None
    for _path, events in logs:
        if holds is not None and not any(events is other for other in lease_logs):
            for event in events:
                _check_contained(event, holds, gpus, overlaps)
            continue
        for event in events:
            name = event.get("event")
            for gpu in event.get("gpu_ids") or []:
                state = gpus.setdefault(gpu, _Gpu())
                state.advance(seconds(event.get("timestamp")))
                if name in ("lease_granted", "lease_released"):
                    who = _who(event, "holder")
                    maintenance = event.get("mode") == "maintenance"
                    if name == "lease_released":
                        if maintenance:
                            state.maintainers.discard(who)
                        elif state.exclusive == who:
                            state.exclusive = None
                        continue
                    if maintenance:
                        state.maintenance_grants += 1
                        if state.exclusive is not None and state.exclusive != who:
                            overlap("maintenance", gpu, state.exclusive, who, event)
                        state.maintainers.add(who)
                        continue
                    state.grants += 1
                    if event.get("request_id"):
                        state.requests.add(event["request_id"])
                    if state.exclusive is not None:
                        overlap("exclusive", gpu, state.exclusive, who, event)
                    others = state.maintainers - {who}
                    if others:
                        overlap("maintenance", gpu, sorted(others, key=str)[0], who, event)
                    busy = [w for w in state.contexts if w != who]
                    if busy:
                        overlap("context", gpu, busy[0], who, event)
                    state.exclusive = who
                elif name in _CONTEXT_STARTED:
                    who = _who(event, "worker_id")
                    kind = _CONTEXT_STARTED[name]
                    if state.exclusive is not None and state.exclusive != who:
                        overlap("context", gpu, state.exclusive, who, event)
                    if not state.running(kind):
                        state.busy_since[kind] = seconds(event.get("timestamp"))
                    state.contexts[who] = kind
                elif name in _CONTEXT_FINISHED:
                    who = _who(event, "worker_id")
                    kind = _CONTEXT_FINISHED[name]
                    state.contexts.pop(who, None)
                    since = state.busy_since[kind]
                    now = seconds(event.get("timestamp"))
                    if not state.running(kind) and since is not None and now is not None:
                        state.busy[kind] += now - since
                        state.busy_since[kind] = None
                    state.count_finished(kind, event)
    return {
        "files": [str(p) for p in paths],
        "gpus": {
            str(gpu): {
                "grants": state.grants,
                "requests": len(state.requests),
                "maintenance_grants": state.maintenance_grants,
                "contexts_created": state.created,
                "contexts_torn_down": state.torn_down,
                # The measured bound: contexts made per second of the time
                # the GPU spent creating (batches count once).
                "create_busy_s": round(state.busy["create"], 3),
                "creates_per_busy_s": round(state.created / state.busy["create"], 2)
                if state.busy["create"] > 0
                else None,
                "teardown_busy_s": round(state.busy["teardown"], 3),
                "create_ms_median": _median(state.durations["create"]),
                "teardown_ms_median": _median(state.durations["teardown"]),
                "occupancy_s": {k: round(v, 3) for k, v in sorted(state.occupancy.items())},
            }
            for gpu, state in sorted(gpus.items())
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
        print(
            f"GPU {gpu}: {facts['grants']} exclusive grants for {facts['requests']} requests, "
            f"{facts['maintenance_grants']} maintenance grants, "
            f"{facts['contexts_created']} contexts created, "
            f"{facts['contexts_torn_down']} torn down; creating {facts['create_busy_s']} s "
            f"({facts['creates_per_busy_s']} contexts/s), median create "
            f"{facts['create_ms_median']} ms, teardown {facts['teardown_ms_median']} ms"
        )
        spent = facts["occupancy_s"]
        total = sum(spent.values()) or 1.0
        print(
            f"GPU {gpu} time by phase: "
            + ", ".join(f"{k} {v:.2f} s ({100 * v / total:.0f} %)" for k, v in spent.items())
        )
    print(f"overlaps: {len(report['overlaps'])}")
    for found in report["overlaps"][:10]:
        print(f"  {found}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    return 1 if report["overlaps"] else 0


if __name__ == "__main__":
    sys.exit(main())
