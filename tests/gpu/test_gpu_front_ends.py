"""
Two front ends on one GPU (C{--front-ends 2}): each process runs half of
the seats, the first keeps the lease for both, and the lease events in its
log show every grant exclusive, whichever front end's worker held it.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kcoral.testing.live_server import ServerProcess

from ..unit.test_lease_overlap_tool import _tool
from .test_gpu_fresh import COPY, _program
from .test_gpu_server import _ok

pytestmark = [pytest.mark.gpu, pytest.mark.integration]


@pytest.mark.parametrize("reuse", ["0", "1"])
def test_two_front_ends_one_lease(tmp_path: Path, reuse: str) -> None:
    logs = tmp_path / "logs"
    server = ServerProcess(
        [
            *("--device", "gpu", "--gpus", "0", "--workers-per-gpu", "4"),
            *("--front-ends", "2", "--max-requests-per-worker", reuse),
            *("--sandbox", "none", "--log-dir", str(logs)),
        ],
        log_path=tmp_path / "server.out",
    )
    server.start(timeout=240)
    try:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: server.execute(_program(COPY)), range(24)))
        for response in answers:
            _body, results = _ok(response)
            assert results["r"] == float(1 << 24)
    finally:
        assert server.stop() == 0
    # The first's log (runs/) has every lease event; the second's
    # (front-end-1/) its own workers' context events, each of which must lie
    # inside a hold of its own (lease_overlap's context_outside_hold).
    every = sorted(logs.rglob("events.jsonl"))
    grants = [
        json.loads(line)
        for path in every
        for line in path.read_text().splitlines()
        if '"lease_granted"' in line
    ]
    holders = {g["holder"] for g in grants if g["purpose"] == "request"}
    # Seats of both front ends (w0, w2: the first; w1, w3: the second)
    # held the GPU, all through the first's arbiter.
    assert holders & {"gpu0/w0", "gpu0/w2"} and holders & {"gpu0/w1", "gpu0/w3"}, holders
    report = _tool().check(every)
    assert report["overlaps"] == []
