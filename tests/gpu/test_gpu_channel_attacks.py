"""
A program that forges frames on a GPU worker while it holds the GPU's lease
(issue 13, GPU variant of tests/reliability/test_channel_attacks.py): its
request fails, the worker is retired, the lease is released, and the next
requests on that GPU (on either worker) succeed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kcoral.testing.live_server import ServerProcess, sandbox_readonly_flags

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

#: Runs under the lease (an ordinary GPU-worker run): touches the GPU, then
#: forges. C{flood}: a frame prefix claiming 2**39 bytes and 64 MiB after it.
#: C{outcome}: a valid outcome that keeps the lease, then sleeps.
ATTACK = r"""
import os
import struct
import time

import pycuda.driver as drv
from kcoral.wire.channel import Outcome, encode


def flood():
    drv.mem_alloc(1024)
    header = b'{"type":"outcome"}'
    os.write(4, struct.pack(">IQ", len(header), 1 << 39) + header)
    try:
        for _ in range(64):
            os.write(4, b"x" * (1 << 20))
    except OSError:
        pass
    time.sleep(30)


def forge():
    drv.mem_alloc(1024)
    os.write(4, encode(Outcome(status="COMPLETED", results={})))
    time.sleep(30)
"""

OK = "import pycuda.driver as drv\ndef f():\n    drv.mem_alloc(1024)\n    return 7\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("gpu-attack-logs")
    server = ServerProcess(
        ["--device", "gpu", "--gpus", "0", "--workers-per-gpu", "2"]
        + ["--log-dir", str(logs), "--tensor-api", "pycuda", *sandbox_readonly_flags()],
        log_path=logs / "server.out",
    )
    server.start(timeout=180)
    yield server
    assert server.stop() == 0


def _program(source: str, fn: str) -> dict:
    return {
        "instructions": [
            {"op": "upload", "kind": "module", "id": "m", "source": source},
            {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": fn},
            {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": []},
            {"op": "return", "key": "out", "value": {"$ref": "r"}},
        ],
        "options": {"timeout_seconds": 60},
    }


def _next_requests_succeed(server: ServerProcess) -> None:
    # Two in a row: with two workers on the GPU, at least one runs on the
    # other worker, which needs the lease the attacker held.
    for _ in range(3):
        response = server.execute(_program(OK, "f"))
        assert response.status == 200, response.body[:2000]
        body = response.json()
        assert body["status"] == "COMPLETED", body
        assert body["results"]["out"]["value"] == 7


@pytest.mark.parametrize("attack", ["flood", "forge"])
def test_forged_frames_under_the_lease(server: ServerProcess, attack: str) -> None:
    response = server.execute(_program(ATTACK, attack))
    assert response.status == 500, response.body[:2000]
    body = response.json()
    assert body["error"]["kind"] == "engine", body
    assert "invalid worker response" in body["error"]["message"], body
    assert server.health()["status"] == "ok"
    _next_requests_succeed(server)
