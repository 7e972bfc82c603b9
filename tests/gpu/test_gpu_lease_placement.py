"""
The lease only while instructions use the GPU (issue 15), on a real GPU: a
module import runs off the lease and takes it at its first device call
(CUPTI), an inert module (definitions, loaded imports) takes none, a GPU
function's run takes it at its first device call (none for one that never
touches the device), a program of cpu_only work never holds the GPU, and the drain after the
last GPU instruction ends the hold before host values are encoded.

The server's own log is the witness: each request's C{lease_granted} events,
read after the server has stopped (its log lines are written by a thread).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kcoral.testing.live_server import ServerProcess, sandbox_readonly_flags
from kcoral.wire.multipart import decode_response

from .test_gpu_server import _ok

pytestmark = [pytest.mark.gpu, pytest.mark.integration]


def _program(source: str, *calls: tuple[str, bool]) -> dict[str, Any]:
    instructions: list[dict[str, Any]] = [
        {"op": "upload", "kind": "module", "id": "m", "source": source}
    ]
    for i, (name, cpu_only) in enumerate(calls):
        instructions.append(
            {
                "op": "get_function",
                "id": f"f{i}",
                "module": {"$ref": "m"},
                "name": name,
                "cpu_only": cpu_only,
            }
        )
        instructions.append({"op": "run", "id": f"r{i}", "fn": {"$ref": f"f{i}"}, "args": []})
    instructions.append({"op": "return", "key": "r", "value": {"$ref": f"r{len(calls) - 1}"}})
    return {"instructions": instructions}


SOURCE = """
import numpy as np

# Made at import, off the lease: a 64 MiB host array.
BIG = np.ones(1 << 24, dtype=np.float32)

def host():
    return sum(range(1000))

def has_cupti():
    # Made by the cpu_only watch this very run, when CUPTI works here.
    from kcoral.worker.cuptiwatch import _watch
    return bool(_watch) and _watch[0] is not None

def gpu():
    import torch
    x = torch.ones(1 << 20, device="cuda")
    torch.cuda._sleep(1000)
    return float(x.sum().item())

def gpu_then_big_host_value():
    import torch
    torch.ones(1024, device="cuda").sum().item()
    # Hashing and copying 64 MiB into the answer: after the hold has ended.
    return BIG
"""

#: Definitions and a loaded import only: its import runs nothing of its
#: own, so it takes no lease with or without CUPTI (kcoral.worker.inert).
INERT = """
import torch

def host():
    return 7

def noop():
    return None

def gpu():
    return float(torch.ones(4, device="cuda").sum().item())
"""

TOUCHING = """
import torch
X = torch.full((1024,), 2.0, device="cuda")

def f():
    return float(X.sum().item())
"""


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lease-logs")


@pytest.fixture(scope="module")
def server(logs: Path) -> Any:
    server = ServerProcess(
        [
            "--device",
            "gpu",
            "--gpus",
            "0",
            "--workers-per-gpu",
            "2",
            "--max-requests-per-worker",
            "0",
            "--log-dir",
            str(logs),
            *sandbox_readonly_flags(),
        ],
        log_path=logs / "server.out",
    )
    server.start(timeout=180)
    yield server
    server.stop()


def _grants(logs: Path, request_id: str) -> list[dict[str, Any]]:
    events = []
    for path in sorted(logs.rglob("events.jsonl")):
        events += [json.loads(line) for line in path.read_text().splitlines()]
    return [
        e for e in events if e.get("event") == "lease_granted" and e.get("request_id") == request_id
    ]


def test_lease_placement_on_the_gpu(server: ServerProcess, logs: Path) -> None:
    # Warm both workers (torch imported, CUDA initialised).
    for _ in range(4):
        _ok(server.execute(_program(SOURCE, ("gpu", False))))

    _, probe = _ok(server.execute(_program(SOURCE, ("has_cupti", True))))
    cpu_body, cpu_results = _ok(server.execute(_program(SOURCE, ("host", True))))
    assert cpu_results["r"] == sum(range(1000))

    gpu_body, gpu_results = _ok(server.execute(_program(SOURCE, ("gpu", False))))
    assert gpu_results["r"] == float(1 << 20)

    big_body, big_results = _ok(
        server.execute(_program(SOURCE, ("gpu_then_big_host_value", False)))
    )
    assert big_results["r"].shape == (1 << 24,) and float(big_results["r"].min()) == 1.0

    touch_body, touch_results = _ok(server.execute(_program(TOUCHING, ("f", False))))
    assert touch_results["r"] == 2048.0

    inert_cpu_body, inert_cpu = _ok(server.execute(_program(INERT, ("host", True))))
    inert_gpu_body, inert_gpu = _ok(server.execute(_program(INERT, ("gpu", False))))
    assert (inert_cpu["r"], inert_gpu["r"]) == (7, 4.0)
    noop_body, noop_results = _ok(server.execute(_program(INERT, ("noop", False))))
    assert noop_results["r"] is None
    # Run after run, each GPU function's first device call is caught (the
    # driver domain, switched off after each grant, comes back each time).
    repeated = [_ok(server.execute(_program(INERT, ("gpu", False))))[0] for _ in range(6)]
    # And the cpu_only watch still sees torch afterwards.
    sneaky = server.execute(_program(INERT, ("gpu", True)))
    sneaky_body, _ = decode_response(sneaky.headers["content-type"], sneaky.body)
    if probe["r"]:
        assert sneaky_body["status"] == "FAILED", sneaky_body
        assert sneaky_body["error"]["kind"] == "gpu_access", sneaky_body["error"]

    server.stop()
    # An inert module: no hold for its import, CUPTI or not; its GPU run, one.
    assert _grants(logs, inert_cpu_body["request_id"]) == []
    assert inert_cpu_body["lease_held_ms"] == 0
    assert len(_grants(logs, inert_gpu_body["request_id"])) == 1
    # cpu_only work only: the module import ran off the lease (CUPTI watched
    # it) and nothing took the GPU, cleanup included.  Without CUPTI the
    # import takes the lease up front (one hold).
    assert len(_grants(logs, cpu_body["request_id"])) == (0 if probe["r"] else 1)
    if probe["r"]:
        assert cpu_body["lease_held_ms"] == 0
    # A GPU function that never touches the device (a null program): with
    # CUPTI its run starts off the lease and nothing takes it.
    assert len(_grants(logs, noop_body["request_id"])) == (0 if probe["r"] else 1)
    if probe["r"]:
        assert noop_body["lease_held_ms"] == 0
    for body in repeated:
        assert len(_grants(logs, body["request_id"])) == 1, body["request_id"]
        assert body["lease_held_ms"] > 0
    # One GPU run: one hold.
    assert len(_grants(logs, gpu_body["request_id"])) == 1
    # The 64 MiB host array is hashed and encoded after the hold ended.
    assert len(_grants(logs, big_body["request_id"])) == 1
    assert big_body["lease_held_ms"] < big_body["elapsed_ms"] / 2
    # A module whose top level touches the device got the lease for it.
    assert len(_grants(logs, touch_body["request_id"])) == 1
    assert touch_body["lease_held_ms"] > 0
