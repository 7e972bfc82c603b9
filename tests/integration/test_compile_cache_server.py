"""
The compile cache across requests on a real CPU server: every worker shares
it (bound read-write into the bubblewrap sandbox), so resubmitting a kernel
skips nvcc even though each request gets a fresh worker process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kcoral.testing.live_server import ServerProcess
from kcoral.wire.multipart import decode_response
from kcoral.wire.values import decode_results

pytestmark = pytest.mark.integration

KERNEL = "__global__ void scale(float *p, float a) { p[threadIdx.x] *= a; }\n"
STATS = "from kcoral.compilers import compile_stats\ndef stats():\n    return compile_stats()\n"


def _compile_and_report() -> dict[str, Any]:
    return {
        "instructions": [
            {"op": "upload", "kind": "module", "id": "src", "language": "cuda", "source": KERNEL},
            {"op": "get_function", "id": "fn", "module": {"$ref": "src"}, "name": "scale"},
            {
                "op": "run",
                "id": "image",
                "fn": "builtin.compile_cuda_binary",
                "args": [{"$ref": "fn"}, {"arch": "sm_90a"}],
            },
            {"op": "upload", "kind": "module", "id": "m", "source": STATS},
            {"op": "get_function", "id": "s", "module": {"$ref": "m"}, "name": "stats"},
            {"op": "run", "id": "st", "fn": {"$ref": "s"}, "args": []},
            {"op": "return", "key": "image", "value": {"$ref": "image"}},
            {"op": "return", "key": "stats", "value": {"$ref": "st"}},
        ]
    }


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on PATH")
def test_resubmitted_kernel_hits_the_shared_compile_cache(tmp_path: Path) -> None:
    """The second compile of the same kernel, in a new worker, is a cache hit."""
    cache = tmp_path / "cache" / "files"
    with ServerProcess(
        ["--device", "cpu", "--num-workers", "1", "--log-dir", "", "--disk-cache-dir", str(cache)]
    ) as server:
        results = []
        for _ in range(2):
            response = server.execute(_compile_and_report())
            body, parts = decode_response(response.headers["content-type"], response.body)
            assert body["status"] == "COMPLETED", body
            results.append(decode_results(body["results"], parts))
    first, second = results
    assert first["image"] == second["image"]
    assert first["image"][:4] == b"\x7fELF"
    assert first["stats"]["cache_misses"] == 1 and first["stats"]["cache_hits"] == 0
    assert second["stats"]["cache_hits"] == 1 and second["stats"]["compiles"] == 0
    assert second["stats"]["saved_seconds"] > 0
    assert list((tmp_path / "cache" / "compile").rglob("*.bin"))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on PATH")
def test_two_workers_compile_at_once(tmp_path: Path) -> None:
    """Two requests compile different kernels on two workers at the same time."""
    import threading

    def program(name: str) -> dict[str, Any]:
        source = f"__global__ void {name}(float *p) {{ p[threadIdx.x] += 1.0f; }}\n"
        return {
            "instructions": [
                {
                    "op": "upload",
                    "kind": "module",
                    "id": "src",
                    "language": "cuda",
                    "source": source,
                },
                {"op": "get_function", "id": "fn", "module": {"$ref": "src"}, "name": name},
                {
                    "op": "run",
                    "id": "image",
                    "fn": "builtin.compile_cuda_binary",
                    "args": [{"$ref": "fn"}, {"arch": "sm_90a"}],
                },
                {"op": "return", "key": "image", "value": {"$ref": "image"}},
            ]
        }

    logs = tmp_path / "logs"
    with ServerProcess(
        ["--device", "cpu", "--num-workers", "2", "--log-dir", str(logs), "--disk-cache-dir", ""]
    ) as server:
        answers: dict[str, Any] = {}
        threads = [
            threading.Thread(target=lambda n=n: answers.update({n: server.execute(program(n))}))
            for n in ("first_kernel", "second_kernel")
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    for name, response in answers.items():
        body, parts = decode_response(response.headers["content-type"], response.body)
        assert body["status"] == "COMPLETED", body
        image = decode_results(body["results"], parts)["image"]
        assert image[:4] == b"\x7fELF" and name.encode() in image
    events = [
        json.loads(line)
        for path in logs.glob("runs/*/events.jsonl")
        for line in path.read_text().splitlines()
    ]
    routed = {e["worker_id"] for e in events if e["event"] == "request_routed"}
    assert routed == {"cpu/w0", "cpu/w1"}
