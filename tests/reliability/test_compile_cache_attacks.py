"""
Planting a compiled image in the shared compile cache (issue 13, item 6):
the cache is read-only in every worker; the parent compiles in a sandbox of
its own and writes the entries, which reads check against their sha256.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kcoral.testing import ServerProcess
from kcoral.wire.multipart import decode_response
from kcoral.wire.values import decode_results
from tests.reliability.conftest import requires_bwrap

pytestmark = [pytest.mark.integration, requires_bwrap]

PLANT = r"""
import errno
import json
import os


def plant():
    out = {}
    for name in ("planted.bin", "ab" * 32 + ".bin"):
        try:
            with open(os.path.join("/var/cache/kcoral/compile", name), "wb") as f:
                f.write(b"KCC2 evil image")
            out[name] = "written"
        except OSError as e:
            out[name] = errno.errorcode.get(e.errno, "?")
    return json.dumps(out)
"""

KERNEL = "__global__ void scale(float *p, float a) { p[threadIdx.x] *= a; }\n"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("compile-attack")


@pytest.fixture(scope="module")
def server(base: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(
        ["--device", "cpu", "--sandbox", "bubblewrap", "--num-workers", "1"]
        + ["--log-dir", "", "--disk-cache-dir", str(base / "files")]
    )
    server.start()
    yield server
    server.stop()


def _plant_program() -> dict[str, Any]:
    return {
        "instructions": [
            {"op": "upload", "kind": "module", "id": "m", "source": PLANT},
            {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "plant"},
            {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": []},
            {"op": "return", "key": "out", "value": {"$ref": "r"}},
        ]
    }


def test_workers_cannot_write_the_compile_cache(server: ServerProcess, base: Path) -> None:
    response = server.execute(_plant_program())
    body = response.json()
    assert body["status"] == "COMPLETED", body
    seen = json.loads(body["results"]["out"]["value"])
    assert set(seen.values()) == {"EROFS"}, seen
    assert not [p for p in (base / "compile").glob("*") if "ab" * 32 in p.name]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on PATH")
def test_parent_compiles_into_the_cache(server: ServerProcess, base: Path) -> None:
    program = {
        "instructions": [
            {"op": "upload", "kind": "module", "id": "src", "language": "cuda", "source": KERNEL},
            {"op": "get_function", "id": "fn", "module": {"$ref": "src"}, "name": "scale"},
            {
                "op": "run",
                "id": "image",
                "fn": "builtin.compile_cuda_binary",
                "args": [{"$ref": "fn"}, {"arch": "sm_90a"}],
            },
            {"op": "return", "key": "image", "value": {"$ref": "image"}},
        ]
    }
    images = []
    for _ in range(2):
        response = server.execute(program)
        body, parts = decode_response(response.headers["content-type"], response.body)
        assert body["status"] == "COMPLETED", body
        images.append(decode_results(body["results"], parts)["image"])
    assert images[0] == images[1]
    assert images[0][:4] == b"\x7fELF"
    entries = list((base / "compile").glob("*.bin"))
    assert len(entries) == 1
    assert Path(entries[0]).read_bytes()[:4] == b"KCC2"
