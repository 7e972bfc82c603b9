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
    assert report["gpus"] == {"0": {"grants": 2, "requests": 2}, "1": {"grants": 1, "requests": 1}}


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
