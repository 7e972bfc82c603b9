"""
A GPU node in a pool (C{kcoral server --device gpu --join ...}) on a real
nats-server, with L{kcoral.testing.pool.PoolStandIn} in the gateway's
place: the node runs on Twisted's asyncio reactor with its GPU workers,
announces its GPU target, fetches a tensor's blob, runs it on the GPU and
sends the answer back, a small one over NATS and a large one posted.

Run on the GPU machine (they skip elsewhere).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kcoral.gateway.jobs import NATS_RESULT_BYTES
from kcoral.testing.live_server import ServerProcess, sandbox_readonly_flags, sha256
from kcoral.testing.nats import NatsServer
from kcoral.testing.pool import PoolStandIn
from kcoral.wire.multipart import decode_response
from kcoral.wire.values import decode_results

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

NODE = "gpu-node"


@pytest.fixture(scope="module")
def nats_server() -> Iterator[NatsServer]:
    with NatsServer(node_ids=(NODE,)) as server:
        yield server


@pytest.fixture(scope="module")
def pool(nats_server: NatsServer) -> Iterator[PoolStandIn]:
    with PoolStandIn(nats_server) as stand_in:
        stand_in.listen_results("gpu-test")
        yield stand_in


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gpu-join-logs")


@pytest.fixture(scope="module")
def gpu_node(nats_server: NatsServer, pool: PoolStandIn, log_dir: Path) -> Iterator[ServerProcess]:
    node = ServerProcess(
        [
            "--device",
            "gpu",
            "--gpus",
            "0",
            "--workers-per-gpu",
            "2",
            "--tensor-api",
            "pycuda",
            "--log-dir",
            str(log_dir),
            *sandbox_readonly_flags(),
            "--join",
            nats_server.url,
            "--node-id",
            NODE,
            "--credentials",
            str(nats_server.credentials_file(NODE)),
        ],
        log_path=log_dir / "node.out",
    )
    node.start(timeout=180)
    try:
        pool.wait_presence(NODE, timeout=120)
        yield node
    finally:
        assert node.stop() == 0


def _tensor_program(data: bytes) -> dict[str, Any]:
    return {
        "instructions": [
            {
                "op": "upload",
                "kind": "tensor",
                "id": "t",
                "blob": sha256(data),
                "dtype": "float32",
                "shape": [len(data) // 4],
            },
            {"op": "return", "key": "t", "value": {"$ref": "t"}},
        ]
    }


def _events(log_dir: Path) -> list[dict[str, Any]]:
    (run,) = list((log_dir / "runs").iterdir())
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(("size", "via"), [(64 << 10, "nats"), (1 << 20, "http")])
def test_gpu_node_runs_pool_jobs(
    gpu_node: ServerProcess, pool: PoolStandIn, log_dir: Path, size: int, via: str
) -> None:
    """
    The GPU node's presence names its GPU target; a tensor job's blob is
    fetched with the job's token, goes to the GPU and comes back
    byte-exact, the answer sent over NATS when it fits (64 KiB) and posted
    when it does not (1 MiB); the node's NATS client runs on its reactor's
    own loop.
    """
    presence = pool.wait_presence(NODE)
    assert presence.gpus == 1 and presence.target == {"arch": "sm_90a"}
    data = np.random.default_rng(size).standard_normal(size // 4).astype(np.float32).tobytes()
    job = pool.publish(_tensor_program(data), presence.compat, blobs=[data], results="gpu-test")
    result = pool.wait_result(job.job, timeout=120)
    assert (result.status, result.node, result.via) == (200, NODE, via)
    assert (len(result.body) <= NATS_RESULT_BYTES) == (via == "nats")
    body, parts = decode_response(result.content_type, result.body)
    assert body["status"] == "COMPLETED", body
    assert decode_results(body["results"], parts)["t"].tobytes() == data
    assert pool.fetches[job.job] == [sha256(data)]
    client = [e for e in _events(log_dir) if e.get("event") == "join_nats_client"]
    assert [e["inline"] for e in client] == [True]
