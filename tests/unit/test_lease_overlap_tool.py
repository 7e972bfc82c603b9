"""
Tests for bench/lease_overlap.py: replaying lease events finds overlaps.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location(
        "lease_overlap", ROOT / "bench" / "lease_overlap.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(tmp_path: Path, events: list[dict]) -> Path:
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def test_clean_log_has_no_overlap(tmp_path: Path) -> None:
    """Grant, release, grant to another holder: no overlap, counts per GPU."""
    path = _write(
        tmp_path,
        [
            {"event": "lease_granted", "gpu_ids": [0], "holder": "gpu0/w0", "request_id": "a"},
            {"event": "lease_released", "gpu_ids": [0], "holder": "gpu0/w0", "request_id": "a"},
            {"event": "lease_granted", "gpu_ids": [0, 1], "holder": "gpu0/w1", "request_id": "b"},
            {"event": "lease_released", "gpu_ids": [0, 1], "holder": "gpu0/w1", "request_id": "b"},
        ],
    )
    report = _tool().check([path])
    assert report["overlaps"] == []
    counts = {gpu: (f["grants"], f["requests"]) for gpu, f in report["gpus"].items()}
    assert counts == {"0": (2, 2), "1": (1, 1)}


def test_grant_of_a_held_gpu_is_an_overlap(tmp_path: Path) -> None:
    """A second grant before the release is reported."""
    path = _write(
        tmp_path,
        [
            {"event": "lease_granted", "gpu_ids": [1], "holder": "x", "request_id": "a"},
            {"event": "lease_granted", "gpu_ids": [1], "holder": "y", "request_id": "b"},
        ],
    )
    (overlap,) = _tool().check([path])["overlaps"]
    assert (overlap["gpu"], overlap["held_by"], overlap["granted_to"]) == (1, "x", "y")


def _lease(name: str, holder: str, pid: int, mode: str = "exclusive", gpu: int = 0) -> dict:
    event = {"event": name, "gpu_ids": [gpu], "holder": holder, "pid": pid, "mode": mode}
    if mode == "exclusive":
        event["request_id"] = f"r-{holder}"
    return event


def _context(name: str, worker: str, pid: int, gpu: int = 0) -> dict:
    return {"event": name, "gpu_ids": [gpu], "worker_id": worker, "pid": pid}


def _kinds(tmp_path: Path, events: list[dict]) -> list[str]:
    return [o["kind"] for o in _tool().check([_write(tmp_path, events)])["overlaps"]]


def test_batched_contexts_between_requests_are_clean(tmp_path: Path) -> None:
    """Creations and teardowns batched under maintenance holds, between requests: no overlap."""
    events = [
        _lease("lease_granted", "gpu0/w0", 10),
        _lease("lease_released", "gpu0/w0", 10),
        _lease("lease_granted", "gpu0/s1", 11, "maintenance"),
        _context("context_create_started", "gpu0/s1", 11),
        _lease("lease_granted", "gpu0/w0", 10, "maintenance"),
        _context("context_teardown_started", "gpu0/w0", 10),
        _context("context_teardown_finished", "gpu0/w0", 10),
        _lease("lease_released", "gpu0/w0", 10, "maintenance"),
        _context("context_create_finished", "gpu0/s1", 11),
        _lease("lease_released", "gpu0/s1", 11, "maintenance"),
        _lease("lease_granted", "gpu0/w0", 12),
        _lease("lease_released", "gpu0/w0", 12),
    ]
    report = _tool().check([_write(tmp_path, events)])
    assert report["overlaps"] == []
    facts = report["gpus"]["0"]
    assert (facts["contexts_created"], facts["contexts_torn_down"]) == (1, 1)
    assert facts["maintenance_grants"] == 2


def test_own_exclusive_hold_covers_its_teardown(tmp_path: Path) -> None:
    """A worker killed while holding its GPU tears down under its own hold."""
    events = [
        _lease("lease_granted", "gpu0/w0", 10),
        _context("context_teardown_started", "gpu0/w0", 10),
        _context("context_teardown_finished", "gpu0/w0", 10),
        _lease("lease_released", "gpu0/w0", 10),
    ]
    assert _kinds(tmp_path, events) == []


def test_context_beside_a_measurement(tmp_path: Path) -> None:
    """A creation that starts while another worker holds the GPU is an overlap."""
    events = [
        _lease("lease_granted", "gpu0/w0", 10),
        _context("context_create_started", "gpu0/w1", 11),
    ]
    assert _kinds(tmp_path, events) == ["context"]


def test_measurement_during_a_teardown(tmp_path: Path) -> None:
    """An exclusive grant while another worker's teardown is in progress is an overlap."""
    events = [
        _context("context_teardown_started", "gpu0/w1", 11),
        _lease("lease_granted", "gpu0/w0", 10),
    ]
    assert _kinds(tmp_path, events) == ["context"]


def test_same_seat_other_process(tmp_path: Path) -> None:
    """A seat's new process is another holder than its old one (told apart by pid)."""
    events = [
        _lease("lease_granted", "gpu0/w0", 10),
        _context("context_create_started", "gpu0/w0", 20),
    ]
    assert _kinds(tmp_path, events) == ["context"]


def test_maintenance_and_exclusive_mixed(tmp_path: Path) -> None:
    """Maintenance granted beside an exclusive holder, and the reverse, are overlaps."""
    assert _kinds(
        tmp_path,
        [
            _lease("lease_granted", "gpu0/w0", 10),
            _lease("lease_granted", "gpu0/s1", 11, "maintenance"),
        ],
    ) == ["maintenance"]
    assert _kinds(
        tmp_path,
        [
            _lease("lease_granted", "gpu0/s1", 11, "maintenance"),
            _lease("lease_granted", "gpu0/w0", 10),
        ],
    ) == ["maintenance"]


def test_other_gpu_does_not_count(tmp_path: Path) -> None:
    """A creation on GPU 1 beside a measurement on GPU 0 is fine."""
    events = [
        _lease("lease_granted", "gpu0/w0", 10),
        _context("context_create_started", "gpu1/w0", 11, gpu=1),
    ]
    assert _kinds(tmp_path, events) == []


def test_creation_bound_from_the_log(tmp_path: Path) -> None:
    """Batched creations count their common time once: the contexts/s bound."""
    events = [
        {**_context("context_create_started", "gpu0/s1", 11), "timestamp": 10.0},
        {**_context("context_create_started", "gpu0/s2", 12), "timestamp": 10.1},
        {
            **_context("context_create_finished", "gpu0/s1", 11),
            "timestamp": 10.3,
            "duration_ms": 300.0,
        },
        {
            **_context("context_create_finished", "gpu0/s2", 12),
            "timestamp": 10.5,
            "duration_ms": 400.0,
        },
    ]
    facts = _tool().check([_write(tmp_path, events)])["gpus"]["0"]
    assert facts["create_busy_s"] == 0.5
    assert facts["creates_per_busy_s"] == 4.0
    assert facts["create_ms_median"] == 350.0


def test_time_is_charged_to_what_the_gpu_was_doing(tmp_path: Path) -> None:
    """Each stretch between events goes to the phase the replay was in."""

    def at(seconds: float, event: dict) -> dict:
        return {**event, "timestamp": seconds}

    events = [
        at(0.0, _lease("lease_granted", "gpu0/w0", 10)),
        at(0.5, _lease("lease_released", "gpu0/w0", 10)),
        at(1.0, _lease("lease_granted", "gpu0/s1", 11, "maintenance")),
        at(1.0, _context("context_create_started", "gpu0/s1", 11)),
        at(1.25, _lease("lease_granted", "gpu0/w0", 10, "maintenance")),
        at(1.25, _context("context_teardown_started", "gpu0/w0", 10)),
        at(2.0, _context("context_create_finished", "gpu0/s1", 11)),
        at(2.5, _context("context_teardown_finished", "gpu0/w0", 10)),
        at(2.5, _lease("lease_released", "gpu0/s1", 11, "maintenance")),
        at(3.0, _lease("lease_released", "gpu0/w0", 10, "maintenance")),
    ]
    facts = _tool().check([_write(tmp_path, events)])["gpus"]["0"]
    assert facts["occupancy_s"] == {
        "exclusive": 0.5,
        "idle": 0.5,
        "creating": 1.0,
        "tearing_down": 0.5,
        "maintenance_other": 0.5,
    }


def _at(event: dict, ms: int) -> dict:
    """C{event} at C{ms} milliseconds past a fixed second, as events.jsonl writes times."""
    return {**event, "timestamp": f"2026-12-01T12:00:{ms // 1000:02d}.{ms % 1000:03d}Z"}


def _two_front_ends(tmp_path: Path, second: list[dict]) -> list[dict]:
    """The first front end's log (every lease event) and the second's (its contexts)."""
    first = [
        _at(_lease("lease_granted", "gpu0/w0", 10), 0),
        _at(_lease("lease_released", "gpu0/w0", 10), 100),
        _at(_lease("lease_granted", "gpu0/w1", 11, "maintenance"), 100),
        _at(_lease("lease_released", "gpu0/w1", 11, "maintenance"), 300),
        _at(_lease("lease_granted", "gpu0/w0", 10), 300),
        _at(_lease("lease_released", "gpu0/w0", 10), 400),
    ]
    (tmp_path / "runs").mkdir()
    (tmp_path / "front-end-1").mkdir()
    paths = [_write(tmp_path / "runs", first), _write(tmp_path / "front-end-1", second)]
    return _tool().check(paths)["overlaps"]


def test_other_front_ends_contexts_inside_their_holds(tmp_path: Path) -> None:
    """The second front end's creation, inside its worker's maintenance hold (bounds included)."""
    second = [
        _at(_context("context_create_started", "gpu0/w1", 11), 100),
        _at(_context("context_create_finished", "gpu0/w1", 11), 300),
    ]
    assert _two_front_ends(tmp_path, second) == []


def test_other_front_ends_context_outside_its_hold(tmp_path: Path) -> None:
    """One that ran into the next measurement, or under no hold of its own, is reported."""
    second = [
        _at(_context("context_create_started", "gpu0/w1", 11), 150),
        _at(_context("context_create_finished", "gpu0/w1", 11), 350),
        _at(_context("context_teardown_started", "gpu0/w3", 13), 200),
    ]
    found = [(o["kind"], o["granted_to"], o["event"]) for o in _two_front_ends(tmp_path, second)]
    assert found == [
        ("context_outside_hold", "gpu0/w1 (pid 11)", "context_create_finished"),
        ("context_outside_hold", "gpu0/w3 (pid 13)", "context_teardown_started"),
    ]
