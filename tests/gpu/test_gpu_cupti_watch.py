"""
A C{cpu_only} function that touches the GPU fails with C{gpu_access} naming
the CUDA call and the uploaded-code line, whatever library made the call
(issue 17, item 3): torch, cupy and ctypes on C{libcuda} reach the driver
without PyCUDA, so only the CUPTI driver watch sees them.

Run on the H200: C{python3 -m pytest -m gpu tests/gpu -q}.
"""

from __future__ import annotations

import importlib.util

import pytest

from kcoral.testing.live_server import ServerProcess
from kcoral.wire.multipart import decode_response
from tests.gpu.test_gpu_server import gpu_server  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

TORCH = "import torch\ndef sneaky():\n    return torch.zeros(1, device='cuda').sum().item()\n"
CUPY = "import cupy\ndef sneaky():\n    return int(cupy.arange(4).sum())\n"
CTYPES = (
    "import ctypes\n"
    "def sneaky():\n"
    "    cuda = ctypes.CDLL('libcuda.so.1')\n"
    "    ptr = ctypes.c_uint64()\n"
    "    return cuda.cuMemAlloc_v2(ctypes.byref(ptr), 1024)\n"
)


def _cpu_only_run(server: ServerProcess, source: str) -> dict:
    program = {
        "instructions": [
            {"op": "upload", "kind": "module", "id": "m", "source": source},
            {
                "op": "get_function",
                "id": "f",
                "module": {"$ref": "m"},
                "name": "sneaky",
                "cpu_only": True,
            },
            {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": []},
            {"op": "return", "key": "r", "value": {"$ref": "r"}},
        ]
    }
    response = server.execute(program)
    assert response.status == 200
    body, _ = decode_response(response.headers["content-type"], response.body)
    return body


def _assert_gpu_access(body: dict) -> None:
    assert body["status"] == "FAILED", body
    error = body["error"]
    assert error["kind"] == "gpu_access", error
    assert error["cuda_call"].startswith("cu"), error
    assert error["location"].startswith("<uploaded:"), error
    assert error["instruction_op"] == "run"


def test_torch_in_cpu_only_run(gpu_server: ServerProcess) -> None:  # noqa: F811
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    _assert_gpu_access(_cpu_only_run(gpu_server, TORCH))


def test_cupy_in_cpu_only_run(gpu_server: ServerProcess) -> None:  # noqa: F811
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("cupy is not installed")
    _assert_gpu_access(_cpu_only_run(gpu_server, CUPY))


def test_ctypes_libcuda_in_cpu_only_run(gpu_server: ServerProcess) -> None:  # noqa: F811
    body = _cpu_only_run(gpu_server, CTYPES)
    _assert_gpu_access(body)
    assert body["error"]["cuda_call"].startswith("cuMemAlloc")


def test_plain_cpu_only_run_still_completes(gpu_server: ServerProcess) -> None:  # noqa: F811
    body = _cpu_only_run(gpu_server, "def sneaky():\n    return sum(range(10))\n")
    assert body["status"] == "COMPLETED", body
