"""
Servers on more than one GPU, in bubblewrap (the default sandbox): every
worker sees exactly its own device, numbered from 0; C{gpu_count: 2}
programs hold both leases only while they run.

Most tests need two GPUs (the nvidia-h200-x2 machine) and skip with that
reason elsewhere; the C{--gpus} tests also run with one GPU.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from kcoral.server.leases.gpus import discover_gpus
from kcoral.testing.live_server import ServerProcess, sandbox_readonly_flags, sha256
from kcoral.wire.multipart import decode_response
from kcoral.wire.values import decode_results

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

TWO_GPUS = "needs two GPUs (the nvidia-h200-x2 machine)"


def _visible_gpus() -> int:
    """How many GPUs this test process's CUDA sees (after its CUDA_VISIBLE_DEVICES)."""
    import pycuda.driver as drv

    drv.init()
    return int(drv.Device.count())


def _machine_gpus() -> list[Any]:
    return discover_gpus()


def _server(tmp: Path, gpus: str, workers: int, env: dict[str, str] | None = None) -> ServerProcess:
    return ServerProcess(
        [
            "--device",
            "gpu",
            "--gpus",
            gpus,
            "--workers-per-gpu",
            str(workers),
            "--log-dir",
            str(tmp / "logs"),
            "--max-requests-per-worker",
            "0",
            *sandbox_readonly_flags(),
        ],
        env=env,
        log_path=tmp / "server.out",
    )


def _ok(response: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    body, parts = decode_response(response.headers["content-type"], response.body)
    assert response.status == 200, response.body[:2000]
    assert body["status"] == "COMPLETED", body
    return body, decode_results(body["results"], parts)


def _events(tmp: Path) -> list[dict[str, Any]]:
    events = []
    for path in sorted((tmp / "logs" / "runs").glob("*/events.jsonl")):
        events += [json.loads(line) for line in path.read_text().splitlines() if line]
    return events


#: Where the worker's CUDA device 0 is, and what it sees.
WHERE = (
    "import os, time\n"
    "import pycuda.driver as drv\n"
    "def f(pause):\n"
    "    time.sleep(pause)\n"
    "    return [os.environ.get('CUDA_VISIBLE_DEVICES'), drv.Device.count(),\n"
    "            drv.Device(0).pci_bus_id().lower()]\n"
)


def _where(pause: float, gpu_count: int | None = None) -> dict[str, Any]:
    program: dict[str, Any] = {
        "instructions": [
            {"op": "upload", "kind": "module", "id": "m", "source": WHERE},
            {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
            {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": [pause]},
            {"op": "return", "key": "r", "value": {"$ref": "r"}},
        ]
    }
    if gpu_count is not None:
        program["options"] = {"gpu_count": gpu_count}
    return program


def _bus(device: Any) -> str:
    return str(device.bus_id).lower()


@attrs.frozen
class TwoGpuServer:
    """A server on GPUs 0 and 1 and the directory that holds its logs."""

    server: ServerProcess
    tmp: Path

    def health(self) -> dict[str, Any]:
        return self.server.health()

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        return self.server.execute(*args, **kwargs)


@pytest.fixture(scope="module")
def two_gpu_server(tmp_path_factory: pytest.TempPathFactory) -> TwoGpuServer:
    if _visible_gpus() < 2:
        pytest.skip(TWO_GPUS)
    tmp = tmp_path_factory.mktemp("two-gpus")
    server = _server(tmp, "0,1", 2)
    server.start(timeout=240)
    yield TwoGpuServer(server, tmp)
    assert server.stop() == 0


def test_every_gpus_workers_start_and_see_only_their_device(two_gpu_server: TwoGpuServer) -> None:
    """Workers of GPU 0 and GPU 1 run in bubblewrap, each seeing one device as ordinal 0."""
    health = two_gpu_server.health()
    assert health["sandbox"] == "bubblewrap"
    assert {w["gpu_id"] for w in health["workers"]} == {0, 1}
    assert {w["status"] for w in health["workers"]} == {"idle"}
    answers: list[Any] = []
    # Four overlapping requests: the pool spreads them over both GPUs.
    threads = [
        threading.Thread(target=lambda: answers.append(_ok(two_gpu_server.execute(_where(2.0)))))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seen = [results["r"] for _, results in answers]
    assert len(seen) == 4
    assert {cvd for cvd, _, _ in seen} == {"0"}
    assert {count for _, count, _ in seen} == {1}
    machine = _machine_gpus()
    assert {bus for _, _, bus in seen} == {_bus(machine[0]), _bus(machine[1])}


def test_gpus_1_alone_serves_on_physical_gpu_1(tmp_path: Path) -> None:
    """--gpus 1 serves on physical GPU 1, even when the front end's CUDA_VISIBLE_DEVICES is 0."""
    machine = _machine_gpus()
    if len(machine) < 2:
        pytest.skip(TWO_GPUS)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0")
    with _server(tmp_path, "1", 1, env=env) as server:
        _, results = _ok(server.execute(_where(0.0)))
        assert results["r"] == ["0", 1, _bus(machine[1])]
        assert {w["gpu_id"] for w in server.health()["workers"]} == {1}


def test_gpus_0_with_the_front_end_restricted(tmp_path: Path) -> None:
    """With one GPU visible to the front end, --gpus 0 still serves on physical GPU 0."""
    machine = _machine_gpus()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(len(machine) - 1))
    with _server(tmp_path, "0", 1, env=env) as server:
        _, results = _ok(server.execute(_where(0.0)))
        assert results["r"] == ["0", 1, _bus(machine[0])]


def test_a_gpu_the_machine_lacks_stops_the_start(tmp_path: Path) -> None:
    """--gpus with an id past the machine's GPUs: the server exits and says which ids exist."""
    machine = _machine_gpus()
    server = _server(tmp_path, str(len(machine)), 1)
    with pytest.raises(RuntimeError):
        server.start(timeout=60)
    output = (tmp_path / "server.out").read_text(errors="replace")
    have = ", ".join(str(d.index) for d in machine)
    assert f"no GPU with id {len(machine)} on this machine (it has {have})" in output


COPY = (
    "import time\n"
    "import torch\n"
    "def f(t, pause):\n"
    "    assert torch.cuda.device_count() == 2\n"
    "    y = torch.as_tensor(t, device='cuda:0').to('cuda:1')\n"
    "    assert y.device.index == 1\n"
    "    time.sleep(pause)\n"
    "    return y.cpu()\n"
)


def _copy_program(digest: str, pause: float) -> dict[str, Any]:
    return {
        "instructions": [
            {
                "op": "upload",
                "kind": "tensor",
                "id": "t",
                "blob": digest,
                "dtype": "float32",
                "shape": [1 << 20],
            },
            {"op": "upload", "kind": "module", "id": "m", "source": COPY},
            {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
            {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": [{"$ref": "t"}, pause]},
            {"op": "return", "key": "r", "value": {"$ref": "r"}},
        ],
        "options": {"gpu_count": 2},
    }


def test_two_gpu_copy_holds_both_leases_only_while_it_runs(two_gpu_server: TwoGpuServer) -> None:
    """
    The cuda:0 -> cuda:1 copy returns the right bytes; /health shows both
    GPUs held while it runs; the request's lease is granted only after its
    worker is ready (start-up, imports and context creation hold no lease of
    the request), for both GPUs at once.
    """
    data = np.random.default_rng(7).standard_normal(1 << 20, dtype=np.float32)
    request_id = str(uuid.uuid4())
    answer: dict[str, Any] = {}

    def send() -> None:
        answer["response"] = two_gpu_server.execute(
            _copy_program(sha256(data.tobytes()), 3.0),
            [data.tobytes()],
            headers={"X-Request-ID": request_id},
        )

    sender = threading.Thread(target=send)
    sender.start()
    both_held = None
    while sender.is_alive():
        gpus = {g["gpu_id"]: g for g in two_gpu_server.health()["gpus"]}
        if all(gpus[g]["lease_depth"] >= 1 and gpus[g]["holder"] for g in (0, 1)):
            if gpus[0]["holder"] == gpus[1]["holder"]:
                both_held = gpus
        time.sleep(0.1)
    sender.join()
    body, results = _ok(answer["response"])
    assert results["r"].tobytes() == data.tobytes()
    assert sorted(body["gpu_ids"]) == [0, 1] and body["gpu_count"] == 2
    assert both_held is not None, "/health never showed both GPUs held by the program"

    time.sleep(1.0)  # the log writer flushes
    events = _events(two_gpu_server.tmp)
    names = [(e.get("event"), e.get("request_id")) for e in events]
    routed = names.index(("request_routed", request_id))
    grants = [
        i
        for i, e in enumerate(events)
        if e.get("event") == "lease_granted" and e.get("request_id") == request_id
    ]
    assert grants, "the program never took a lease"
    assert min(grants) > routed, "a lease of the request was granted before its worker was ready"
    assert {tuple(events[i]["gpu_ids"]) for i in grants} == {(0, 1)}


def test_gpu_count_2_under_mixed_load_no_overlap(two_gpu_server: TwoGpuServer) -> None:
    """Single-GPU and two-GPU programs together: all answered right, no GPU held twice."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import lease_overlap

    data = np.arange(1 << 20, dtype=np.float32)
    digest = sha256(data.tobytes())
    answers: list[tuple[str, Any]] = []

    def one(i: int) -> None:
        if i % 4 == 3:
            answers.append(
                ("two", two_gpu_server.execute(_copy_program(digest, 0.0), [data.tobytes()]))
            )
        else:
            answers.append(("one", two_gpu_server.execute(_where(0.05))))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(answers) == 16
    for kind, response in answers:
        _, results = _ok(response)
        if kind == "two":
            assert results["r"].tobytes() == data.tobytes()
    time.sleep(1.0)
    paths = sorted((two_gpu_server.tmp / "logs" / "runs").glob("*/events.jsonl"))
    report = lease_overlap.check(paths)
    assert report["overlaps"] == []
    assert set(report["gpus"]) == {"0", "1"}
