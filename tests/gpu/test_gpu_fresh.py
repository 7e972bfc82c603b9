"""
Fresh workers on a real GPU (issue 14): contexts are created and destroyed
on the maintenance lease, seats are refilled from warm spares, and the run's
own log proves no context operation overlapped another holder's lease.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from kcoral.testing.live_server import ServerProcess, sandbox_readonly_flags

from ..unit.test_lease_overlap_tool import _tool
from .test_gpu_server import _ok

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]

COPY = """
def f():
    import torch
    x = torch.ones(1 << 24, device="cuda")
    y = torch.empty_like(x)
    for _ in range(20):
        y.copy_(x)
    torch.cuda.synchronize()
    return float(y.sum().item())
"""


CONNECTIONS = """
def f():
    import os
    return os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
"""


def _program(source: str) -> dict[str, Any]:
    return {
        "instructions": [
            {"op": "upload", "kind": "module", "id": "m", "source": source},
            {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
            {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": []},
            {"op": "return", "key": "r", "value": {"$ref": "r"}},
        ]
    }


def _events(logs: Path) -> list[dict[str, Any]]:
    events = []
    for path in sorted(logs.rglob("events.jsonl")):
        events += [json.loads(line) for line in path.read_text().splitlines()]
    return events


@pytest.mark.parametrize("sandbox", ["none", "bubblewrap"])
def test_fresh_workers_on_the_lease(tmp_path: Path, sandbox: str) -> None:
    """
    Fresh mode with two spares: every request runs in a new process, its
    seat refilled from a spare; contexts are created and torn down (the
    worker answers torn_down) under maintenance holds that never overlap an
    exclusive one.
    """
    logs = tmp_path / "logs"
    server = ServerProcess(
        [
            "--device",
            "gpu",
            "--gpus",
            "0",
            "--workers-per-gpu",
            "2",
            "--spare-workers-per-gpu",
            "2",
            "--max-requests-per-worker",
            "1",
            "--sandbox",
            sandbox,
            "--log-dir",
            str(logs),
            # read-only paths are a sandbox flag: refused with --sandbox none
            *(sandbox_readonly_flags() if sandbox == "bubblewrap" else []),
        ],
        log_path=tmp_path / "server.out",
    )
    server.start(timeout=240)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            spares = server.health()["spares"]
            if len(spares) == 2 and all(s["state"] == "ready" for s in spares):
                break
            time.sleep(0.5)
        for _ in range(6):
            _body, results = _ok(server.execute(_program(COPY)))
            assert results["r"] == float(1 << 24)
        # Each fresh worker's context has the default work queues for
        # fresh workers (--cuda-connections auto).
        _body, results = _ok(server.execute(_program(CONNECTIONS)))
        assert results["r"] == "2"
        assert server.health()["gpus"][0]["work_queues"] == 2
        deadline = time.monotonic() + 60
        while (health := server.health())["load"]["request_capacity"] < 2:
            assert time.monotonic() < deadline, health
            time.sleep(0.2)
        pids = {w["pid"] for w in health["workers"]}
        assert len(pids) == 2
    finally:
        assert server.stop() == 0
    events = _events(logs)
    names = [e.get("event") for e in events]
    # Sequential requests may outrun the spares' refill; the first two are adopted.
    assert names.count("spare_adopted") >= 2
    teardowns = [e for e in events if e.get("event") == "context_teardown_finished"]
    assert len(teardowns) >= 4
    # destroyed: the worker reset its contexts and said so; exited: they
    # went with the process.  Both are under the lease.
    assert {e["how"] for e in teardowns} <= {"destroyed", "exited"}
    creations = [e for e in events if e.get("event") == "context_create_finished"]
    # A spare still creating its context when the server stops is killed
    # (its creation ends "exited"); every creation before the stop ended ready.
    stop = names.index("shutdown_started")
    before_stop = [e for e in events[:stop] if e.get("event") == "context_create_finished"]
    assert len(before_stop) >= 8 and all(e["how"] == "ready" for e in before_stop)
    assert {e["how"] for e in creations} <= {"ready", "exited"}
    report = _tool().check(sorted(logs.rglob("events.jsonl")))
    assert report["overlaps"] == []
    assert report["gpus"]["0"]["contexts_created"] == len(creations)
