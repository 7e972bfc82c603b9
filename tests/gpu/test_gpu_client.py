# -*- test-case-name: tests.gpu.test_gpu_client -*-
"""
Our clients (L{kcoral.Client}, C{kcoral run}) against a GPU server: the
GPU interop cases of issue 16.  Run on the GPU machine (skipped elsewhere):

    .venv/bin/python -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_client.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from kcoral import Client, Program
from kcoral.testing.live_server import ServerProcess, sandbox_readonly_flags

pytestmark = [pytest.mark.gpu, pytest.mark.integration]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    logs = tmp_path_factory.mktemp("gpu-client-logs")
    process = ServerProcess(
        [
            "--device",
            "gpu",
            "--gpus",
            "0",
            "--workers-per-gpu",
            "2",
            "--log-dir",
            str(logs),
            "--tensor-api",
            "pycuda",
            *sandbox_readonly_flags(),
        ],
        log_path=logs / "server.out",
    )
    process.start(timeout=180)
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Client:
    with Client(f"http://127.0.0.1:{server.port}") as c:
        yield c


def test_target(client: Client) -> None:
    """Client.target() reads the GPU's architecture."""
    assert client.target() == {"arch": "sm_90a"}
    assert client.health()["gpu_count"] == 1


@pytest.mark.parametrize(
    "array",
    [
        np.arange(24, dtype=np.float32).reshape(2, 3, 4),
        np.arange(8, dtype=np.float16),
        np.arange(8, dtype=np.float32).astype(ml_dtypes.bfloat16),
        np.array([True, False, True]),
        np.arange(-4, 4, dtype=np.int64),
        np.zeros((0, 3), dtype=np.int8),
    ],
    ids=lambda a: str(a.dtype),
)
def test_tensor_round_trip(client: Client, array: np.ndarray) -> None:
    """A NumPy array uploaded as a tensor comes back equal, dtype and shape included."""
    program = Program()
    program.return_(key="t", value=program.upload(kind="tensor", value=array))
    result = client.execute(program).check()
    assert result["t"].dtype == array.dtype
    assert result["t"].shape == array.shape
    assert result["t"].tobytes() == array.tobytes()
    assert result.lease_held_ms > 0


def test_large_tensor_streams(client: Client) -> None:
    """A 192 MiB tensor goes up (streamed) and comes back byte-exact."""
    array = np.random.default_rng(0).standard_normal(48 * 1024 * 1024, dtype=np.float32)
    program = Program()
    program.return_(key="t", value=program.upload(kind="tensor", value=array))
    result = client.execute(program, timeout_seconds=600).check()
    assert np.array_equal(result["t"], array)


def test_remote_function_with_arrays(client: Client) -> None:
    """@client.function() passes arrays as device tensors and returns them as arrays."""

    @client.function(timeout=120)
    def same(x, scale=1):
        return {"x": x, "scale": scale}

    array = np.arange(16, dtype=np.float32)
    out = same.remote(array, scale=3)
    assert out["scale"] == 3
    assert np.array_equal(out["x"], array)


def test_gpu_count_one(client: Client) -> None:
    """execute(gpu_count=1) reports the GPU the program ran on."""
    program = Program()
    module = program.upload(kind="module", source="def f():\n    return 1\n")
    program.return_(key="r", value=program.run(fn=program.get_function(module=module, name="f")))
    result = client.execute(program, gpu_count=1).check()
    assert result.gpu_ids == (0,)


def test_cpu_only_touching_cuda(client: Client) -> None:
    """A cpu_only function that enters CUDA fails with kind gpu_access."""
    source = "import pycuda.driver as drv\ndef f():\n    return drv.mem_alloc(1024)\n"
    program = Program()
    module = program.upload(kind="module", source=source)
    function = program.get_function(module=module, name="f", cpu_only=True)
    program.return_(key="r", value=program.run(fn=function))
    result = client.execute(program)
    assert result.status == "FAILED"
    assert result.error["kind"] == "gpu_access"
    assert result.error["cuda_call"] == "pycuda.driver.mem_alloc"


def test_kcoral_run_python_on_gpu(server: ServerProcess, tmp_path: Path) -> None:
    """kcoral run python on a GPU server: output and exit status come back."""
    script = tmp_path / "job"
    script.mkdir()
    (script / "check.py").write_text("import sys\nprint('ran on', sys.executable)\nsys.exit(7)\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kcoral",
            "run",
            "python",
            "--send",
            str(script),
            "--",
            "job/check.py",
        ],
        env={**os.environ, "KCORAL_URL": f"http://127.0.0.1:{server.port}"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 7, proc.stderr
    assert "ran on" in proc.stdout
