# -*- test-case-name: tests.integration.test_retention_server -*-
"""
A real server prunes its log directory at start-up: an old run directory
goes, and the event log says so.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from kcoral.testing.live_server import ServerProcess

pytestmark = pytest.mark.integration


def test_old_run_pruned_at_start(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    old = logs / "runs" / "20200101T000000.000000Z"
    (old / "programs").mkdir(parents=True)
    (old / "events.jsonl").write_text("{}\n")
    stamp = time.time() - 100 * 86400
    for path in (old / "events.jsonl", old / "programs", old):
        os.utime(path, (stamp, stamp))
    server = ServerProcess(
        ["--device", "cpu", "--sandbox", "none", "--log-dir", str(logs)]
        + ["--disk-cache-dir", "", "--log-retention-days", "30"]
    )
    with server:
        deadline = time.monotonic() + 30
        while old.exists():
            assert time.monotonic() < deadline, "the old run was not pruned"
            time.sleep(0.1)
    [current] = list((logs / "runs").iterdir())
    events = [json.loads(line) for line in (current / "events.jsonl").read_text().splitlines()]
    [pruned] = [e for e in events if e["event"] == "logs_pruned"]
    assert pruned["runs"] == [old.name]
