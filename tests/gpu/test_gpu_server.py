"""
End-to-end tests of a GPU server: real workers on a real GPU, real HTTP.

Run on the GPU machine (they skip elsewhere): one GPU server in bubblewrap,
and a CPU server that compiles CUDA C for the GPU server's target.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kcoral.testing.live_server import ServerProcess, sandbox_readonly_flags, sha256
from kcoral.wire.multipart import decode_response
from kcoral.wire.values import decode_results

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

SAXPY = r"""
__global__ void saxpy(float a, const float *x, float *y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"""


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    logs = tmp_path_factory.mktemp("gpu-logs")
    server = ServerProcess(
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
    server.start(timeout=180)
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def cpu_server(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    logs = tmp_path_factory.mktemp("cpu-logs")
    server = ServerProcess(
        [
            "--device",
            "cpu",
            "--num-workers",
            "2",
            "--log-dir",
            str(logs),
            *sandbox_readonly_flags(),
        ],
        log_path=logs / "server.out",
    )
    server.start(timeout=120)
    yield server
    assert server.stop() == 0


def _ok(response) -> tuple[dict, dict]:
    body, parts = decode_response(response.headers["content-type"], response.body)
    assert response.status == 200, response.body[:2000]
    assert body["status"] == "COMPLETED", body
    return body, decode_results(body["results"], parts)


def test_health_reports_h200_target(gpu_server: ServerProcess) -> None:
    """/health names the GPU's target (sm_90a on an H200) and the versions workers run."""
    health = gpu_server.health()
    assert health["gpu_count"] == 1
    assert health["target"] == {"arch": "sm_90a"}
    assert "pycuda" in health["versions"]
    assert [g["gpu_id"] for g in health["gpus"]] == [0]
    assert {w["gpu_id"] for w in health["workers"]} == {0}
    assert health["sandbox"] == "bubblewrap"


@pytest.mark.parametrize(
    "dtype", ["float32", "float16", "bfloat16", "int8", "int64", "bool", "float8_e4m3fn"]
)
def test_tensor_round_trip(gpu_server: ServerProcess, dtype: str) -> None:
    """A tensor goes to the GPU and comes back byte-exact, under the lease."""
    data = np.random.default_rng(1).integers(0, 255, size=4096, dtype=np.uint8).tobytes()
    if dtype == "bool":
        data = bytes(b & 1 for b in data)
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "int64": 8}.get(dtype, 1)
    shape = [len(data) // itemsize]
    program = {
        "instructions": [
            {
                "op": "upload",
                "kind": "tensor",
                "id": "t",
                "blob": sha256(data),
                "dtype": dtype,
                "shape": shape,
            },
            {"op": "return", "key": "t", "value": {"$ref": "t"}},
        ]
    }
    body, results = _ok(gpu_server.execute(program, [data]))
    assert results["t"].tobytes() == data
    assert body["lease_held_ms"] > 0
    assert body["lease_wait_ms"] + body["lease_held_ms"] <= body["elapsed_ms"] + 1e-6


@pytest.mark.parametrize(("dtype", "mib"), [("float32", 4), ("bfloat16", 4), ("float32", 64)])
def test_large_tensor_round_trip(gpu_server: ServerProcess, dtype: str, mib: int) -> None:
    """
    A 4 MiB and a 64 MiB tensor cross to the worker and back as sealed
    shared buffers (issue 15; returned from 4 MiB by a device-to-host copy
    into a page-locked buffer): byte-exact, from the cache too.
    """
    data = np.random.default_rng(2).integers(0, 255, size=mib << 20, dtype=np.uint8).tobytes()
    itemsize = 4 if dtype == "float32" else 2
    program = {
        "instructions": [
            {
                "op": "upload",
                "kind": "tensor",
                "id": "t",
                "blob": sha256(data),
                "dtype": dtype,
                "shape": [len(data) // itemsize],
            },
            {"op": "return", "key": "t", "value": {"$ref": "t"}},
        ]
    }
    _, results = _ok(gpu_server.execute(program, [data]))
    assert results["t"].tobytes() == data
    _, results = _ok(gpu_server.execute(program))
    assert results["t"].tobytes() == data


def test_builtins_randn_benchmark_check_close(gpu_server: ServerProcess) -> None:
    """Legacy builtin names allocate, compile, launch, benchmark and check on the GPU."""
    n = 1 << 20
    program = {
        "instructions": [
            {"op": "upload", "kind": "module", "id": "src", "language": "cuda", "source": SAXPY},
            {"op": "get_function", "id": "saxpy_src", "module": {"$ref": "src"}, "name": "saxpy"},
            {
                "op": "run",
                "id": "saxpy",
                "fn": "builtin.compile_cuda",
                "args": [
                    {"$ref": "saxpy_src"},
                    {"grid": [n // 256], "block": [256], "arg_types": ["f32", "ptr", "ptr", "i32"]},
                ],
            },
            {
                "op": "run",
                "id": "x",
                "fn": "builtin.randn",
                "args": [{"shape": [n], "dtype": "float32", "seed": 7}],
            },
            {
                "op": "run",
                "id": "y",
                "fn": "builtin.zeros",
                "args": [{"shape": [n], "dtype": "float32"}],
            },
            {
                "op": "run",
                "id": "launch",
                "fn": {"$ref": "saxpy"},
                "args": [2.0, {"$ref": "x"}, {"$ref": "y"}, n],
            },
            {
                "op": "run",
                "id": "timing",
                "fn": "builtin.benchmark",
                "args": [
                    {"$ref": "saxpy"},
                    0.0,
                    {"$ref": "x"},
                    {"$ref": "y"},
                    n,
                    {"warmup": 3, "repeat": 20},
                ],
            },
            {"op": "return", "key": "x", "value": {"$ref": "x"}},
            {"op": "return", "key": "y", "value": {"$ref": "y"}},
            {"op": "return", "key": "timing", "value": {"$ref": "timing"}},
        ]
    }
    _, results = _ok(gpu_server.execute(program))
    x, y = results["x"], results["y"]
    np.testing.assert_allclose(y, 2.0 * x, rtol=1e-6)
    timing = results["timing"]
    assert timing["repeat"] == 20
    assert 0 < timing["latency_ms_min"] <= timing["latency_ms_median"] <= timing["latency_ms_max"]


def test_compile_on_cpu_server_run_on_gpu_server(
    gpu_server: ServerProcess, cpu_server: ServerProcess
) -> None:
    """The split deployment: nvcc on a CPU server, the module image loaded and run on the GPU."""
    arch = gpu_server.health()["target"]["arch"]
    compile_program = {
        "instructions": [
            {"op": "upload", "kind": "module", "id": "src", "language": "cuda", "source": SAXPY},
            {"op": "get_function", "id": "fn", "module": {"$ref": "src"}, "name": "saxpy"},
            {
                "op": "run",
                "id": "image",
                "fn": "builtin.compile_cuda_binary",
                "args": [{"$ref": "fn"}, {"arch": arch, "extra_cuda_cflags": ["-O3"]}],
            },
            {"op": "return", "key": "image", "value": {"$ref": "image"}},
        ]
    }
    _, compiled = _ok(cpu_server.execute(compile_program))
    image = compiled["image"]
    assert image[:4] == b"\x7fELF"
    n = 4096
    x = np.arange(n, dtype=np.float32)
    run_program = {
        "instructions": [
            {"op": "upload", "kind": "library", "id": "lib", "blob": sha256(image)},
            {
                "op": "run",
                "id": "k",
                "fn": "builtin.kernel",
                "args": [
                    {"$ref": "lib"},
                    "saxpy",
                    {"grid": [n // 256], "block": [256], "arg_types": ["f32", "ptr", "ptr", "i32"]},
                ],
            },
            {
                "op": "upload",
                "kind": "tensor",
                "id": "x",
                "blob": sha256(x.tobytes()),
                "dtype": "float32",
                "shape": [n],
            },
            {
                "op": "run",
                "id": "y",
                "fn": "builtin.zeros",
                "args": [{"shape": [n], "dtype": "float32"}],
            },
            {
                "op": "run",
                "id": "go",
                "fn": {"$ref": "k"},
                "args": [3.0, {"$ref": "x"}, {"$ref": "y"}, n],
            },
            {
                "op": "run",
                "id": "check",
                "fn": "builtin.assert_close",
                "args": [{"$ref": "y"}, {"$ref": "x"}, {"rtol": 10.0, "atol": 1e9}],
            },
            {"op": "return", "key": "y", "value": {"$ref": "y"}},
        ]
    }
    _, results = _ok(gpu_server.execute(run_program, [image, x.tobytes()]))
    np.testing.assert_allclose(results["y"], 3.0 * x)


def test_cpu_only_run_releases_the_lease(gpu_server: ServerProcess) -> None:
    """A cpu_only function runs off the lease; the rest of the program holds it."""
    source = "import time\ndef busy():\n    time.sleep(0.3)\n    return 1\n"
    program = {
        "instructions": [
            {"op": "upload", "kind": "module", "id": "m", "source": source},
            {
                "op": "get_function",
                "id": "f",
                "module": {"$ref": "m"},
                "name": "busy",
                "cpu_only": True,
            },
            {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": []},
            {"op": "return", "key": "r", "value": {"$ref": "r"}},
        ]
    }
    body, results = _ok(gpu_server.execute(program))
    assert results["r"] == 1
    assert body["elapsed_ms"] >= 300
    assert body["lease_held_ms"] < body["elapsed_ms"] - 250


def test_worker_crash_on_gpu_is_contained(gpu_server: ServerProcess) -> None:
    """An out-of-bounds kernel or a dying worker fails its request only."""
    bad = r"""
__global__ void oob(float *p) { p[1ull << 40] = 1.0f; }
"""
    program = {
        "instructions": [
            {"op": "upload", "kind": "module", "id": "src", "language": "cuda", "source": bad},
            {"op": "get_function", "id": "fn", "module": {"$ref": "src"}, "name": "oob"},
            {
                "op": "run",
                "id": "k",
                "fn": "builtin.compile_cuda",
                "args": [{"$ref": "fn"}, {"grid": [1], "block": [1], "arg_types": ["ptr"]}],
            },
            {
                "op": "run",
                "id": "buf",
                "fn": "builtin.zeros",
                "args": [{"shape": [4], "dtype": "float32"}],
            },
            {"op": "run", "id": "go", "fn": {"$ref": "k"}, "args": [{"$ref": "buf"}]},
        ]
    }
    response = gpu_server.execute(program)
    assert response.status == 200
    body, _ = decode_response(response.headers["content-type"], response.body)
    assert body["status"] == "FAILED"
    assert body["error"]["kind"] == "runtime"
    # The next request gets a healthy worker.
    test_tensor_round_trip(gpu_server, "float32")


def test_cpu_only_run_touching_cuda_fails_gpu_access(gpu_server: ServerProcess) -> None:
    """A cpu_only function that calls PyCUDA is stopped with kind gpu_access."""
    source = "import pycuda.driver as drv\ndef sneaky():\n    return drv.mem_alloc(1024)\n"
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
        ]
    }
    response = gpu_server.execute(program)
    assert response.status == 200
    body, _ = decode_response(response.headers["content-type"], response.body)
    assert body["status"] == "FAILED"
    error = body["error"]
    assert error["kind"] == "gpu_access"
    assert error["cuda_call"] == "pycuda.driver.mem_alloc"
    assert error["location"].startswith("<uploaded:")
    assert set(error) == {
        "kind",
        "message",
        "instruction_index",
        "instruction_op",
        "instruction_id",
        "traceback",
        "cuda_call",
        "location",
        "interfered_request_id",
    }


def test_gpu_count_one_reports_gpu_ids(gpu_server: ServerProcess) -> None:
    """A program that asks for one GPU is told which physical GPU ran it."""
    program = {
        "instructions": [
            {"op": "upload", "kind": "module", "id": "m", "source": "def f():\n    return 1\n"},
            {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
            {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": []},
            {"op": "return", "key": "r", "value": {"$ref": "r"}},
        ],
        "options": {"gpu_count": 1},
    }
    body, _ = _ok(gpu_server.execute(program))
    assert body["gpu_ids"] == [0]
    assert body["gpu_count"] == 1


def test_gpus_are_physical_whatever_the_front_end_sees(tmp_path: Path) -> None:
    """--gpus 0 serves on physical GPU 0 even when the front end's CUDA_VISIBLE_DEVICES hides it."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    server = ServerProcess(
        [
            "--device",
            "gpu",
            "--gpus",
            "0",
            "--workers-per-gpu",
            "1",
            "--log-dir",
            "",
            *sandbox_readonly_flags(),
        ],
        env=env,
        log_path=tmp_path / "server.out",
    )
    with server:
        assert server.health()["target"] == {"arch": "sm_90a"}
        test_tensor_round_trip(server, "float32")


def test_gpu_access_names_the_request_holding_the_gpu(gpu_server: ServerProcess) -> None:
    """B's cpu_only run leaves the GPU to A; B's CUDA call during A's hold names A."""
    import threading
    import time
    import uuid

    holder_id = str(uuid.uuid4())
    hold = {
        "instructions": [
            {
                "op": "upload",
                "kind": "module",
                "id": "m",
                "source": "import time\ndef f():\n    time.sleep(3)\n",
            },
            {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
            {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": []},
        ]
    }
    sneaky = (
        "import time\nimport pycuda.driver as drv\n"
        "def f():\n    time.sleep(1.5)\n    return drv.mem_alloc(16)\n"
    )
    probe = {
        "instructions": [
            {"op": "upload", "kind": "module", "id": "m", "source": sneaky},
            {
                "op": "get_function",
                "id": "f",
                "module": {"$ref": "m"},
                "name": "f",
                "cpu_only": True,
            },
            {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": []},
        ]
    }
    answers: dict[str, Any] = {}
    prober = threading.Thread(target=lambda: answers.update(probe=gpu_server.execute(probe)))
    prober.start()
    time.sleep(0.5)  # B is inside its cpu_only run, off the lease
    holder = threading.Thread(
        target=gpu_server.execute, args=(hold,), kwargs={"headers": {"X-Request-ID": holder_id}}
    )
    holder.start()
    prober.join()
    holder.join()
    error = answers["probe"].json()["error"]
    assert error["kind"] == "gpu_access"
    assert error["interfered_request_id"] == holder_id


def test_gpu_count_program_runs_in_a_worker_that_sees_its_gpus(gpu_server: ServerProcess) -> None:
    """gpu_count programs run in a one-request worker that sees exactly the leased GPUs."""
    source = (
        "import os\nimport pycuda.driver as drv\n"
        "def f():\n    return [os.environ['CUDA_VISIBLE_DEVICES'], drv.Device.count()]\n"
    )
    program = {
        "instructions": [
            {"op": "upload", "kind": "module", "id": "m", "source": source},
            {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
            {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": []},
            {"op": "return", "key": "r", "value": {"$ref": "r"}},
        ],
        "options": {"gpu_count": 1},
    }
    body, results = _ok(gpu_server.execute(program))
    assert results["r"] == ["0", 1]
    assert body["gpu_ids"] == [0] and body["gpu_count"] == 1
    assert body["lease_held_ms"] > 0


def test_two_gpu_program_copies_between_devices(tmp_path: Path) -> None:
    """On a machine with two GPUs: a gpu_count 2 program sees both and copies GPU 0 -> GPU 1."""
    import pycuda.driver as drv

    drv.init()
    if drv.Device.count() < 2:
        pytest.skip("needs two GPUs (the nvidia-h200-x2 machine)")
    source = (
        "import torch\n"
        "def f(t):\n"
        "    assert torch.cuda.device_count() == 2\n"
        "    return t.to('cuda:0').to('cuda:1').cpu()\n"
    )
    data = np.arange(1 << 20, dtype=np.float32)
    program = {
        "instructions": [
            {
                "op": "upload",
                "kind": "tensor",
                "id": "t",
                "blob": sha256(data.tobytes()),
                "dtype": "float32",
                "shape": [1 << 20],
            },
            {"op": "upload", "kind": "module", "id": "m", "source": source},
            {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
            {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": [{"$ref": "t"}]},
            {"op": "return", "key": "r", "value": {"$ref": "r"}},
        ],
        "options": {"gpu_count": 2},
    }
    server = ServerProcess(
        [
            "--device",
            "gpu",
            "--gpus",
            "0,1",
            "--workers-per-gpu",
            "2",
            "--log-dir",
            "",
            *sandbox_readonly_flags(),
        ],
        log_path=tmp_path / "server.out",
    )
    with server:
        body, results = _ok(server.execute(program, [data.tobytes()]))
    assert sorted(body["gpu_ids"]) == [0, 1] and body["gpu_count"] == 2
    assert results["r"].tobytes() == data.tobytes()


def test_remote_compile_example(
    gpu_server: ServerProcess, cpu_server: ServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    """
    examples/remote_compile.py on kcoral.Client: nvcc on the CPU server, the
    image run, checked (builtin.check_close) and timed on the GPU server.
    """
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "remote_compile.py"
    spec = importlib.util.spec_from_file_location("kcoral_example_remote_compile", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    cpu, gpu = (f"http://127.0.0.1:{s.port}" for s in (cpu_server, gpu_server))
    assert example.main(["--cpu", cpu, "--gpu", gpu, "-n", str(1 << 16)]) == 0
    out = capsys.readouterr().out
    assert f"GPU server target: {gpu_server.health()['target']['arch']}" in out
    assert "passed=True" in out
    assert "saxpy n=65536: median" in out
