"""
The exploit corpus of issue 33: uploaded "kernel" modules that try to make
C{benchmark} report less time than their work takes, timed by a trusted
harness module through C{kcoral.builtins.benchmark} on a bubblewrap GPU
server, and honest controls that must not be flagged.

Every exploit must fail, be flagged (C{validity.ok} false), or be measured
honestly anyway (at least half the honest kernel's median).  Every control
must complete, valid, with its output correct.  Each response's
C{measurements} record must match the value the program returned, except
where the uploaded code replaced C{benchmark} itself, and then the record
shows it.

Run on the GPU machine (they skip elsewhere):
C{python3 -m pytest -m gpu tests/gpu/test_gpu_trusted_timing.py -q -s}.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from kcoral.client.results import program_result
from kcoral.testing.live_server import ServerProcess
from kcoral.wire.multipart import decode_response

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

#: The evaluator's harness: times C{kernel(x, out)} (C{x} 2048x2048
#: float32), then calls it once more and checks C{out} against C{ref}.
HARNESS = r"""
import torch
from kcoral.builtins import benchmark

REFERENCES = {
    "matmul": lambda x: x @ x,
    "twice": lambda x: 2 * x,
    "add_one": lambda x: x + 1,
}


def measure(kernel, cfg, ref, with_n):
    torch.manual_seed(0)
    x = torch.randn(2048, 2048, device="cuda")
    out = torch.zeros_like(x)
    call = (lambda a, b: kernel(a, b, a.numel())) if with_n else kernel
    cfg = dict(cfg)
    if cfg.pop("fresh_inputs", False):
        cfg["inputs"] = lambda i: (torch.randn(2048, 2048, device="cuda"), out)
    if cfg.pop("audit_reference", False):
        cfg["audit"] = lambda a, b: REFERENCES[ref](a)
        cfg["audit_output"] = 1
    result = benchmark(call, x, out, cfg)
    out.zero_()
    call(x, out)
    torch.cuda.synchronize()
    result["check"] = bool(torch.allclose(out, REFERENCES[ref](x), rtol=1e-2, atol=1e-2))
    return result
"""

MATMUL = "import torch\n\ndef kernel(x, out):\n    torch.matmul(x, x, out=out)\n"

#: The exploits: each makes the kernel look faster than its work.
EXPLOITS: dict[str, tuple[str, dict[str, Any]]] = {
    "side_stream": (
        """
import torch
_s = torch.cuda.Stream()
def kernel(x, out):
    with torch.cuda.stream(_s):
        torch.matmul(x, x, out=out)
""",
        {},
    ),
    "thread": (
        """
import threading, torch
def kernel(x, out):
    threading.Thread(target=lambda: torch.matmul(x, x, out=out)).start()
""",
        {},
    ),
    "replay_by_pointer": (
        """
import torch
_seen = set()
def kernel(x, out):
    key = (x.data_ptr(), out.data_ptr())
    if key not in _seen:
        _seen.add(key)
        torch.matmul(x, x, out=out)
""",
        {"rotate": 4},
    ),
    "replay_by_content": (
        """
import torch
_cache = {}
def kernel(x, out):
    key = float(x.sum())
    hit = _cache.get(key)
    if hit is None:
        torch.matmul(x, x, out=out)
        _cache[key] = out.clone()
    else:
        out.copy_(hit)
""",
        {},
    ),
    "replay_by_content_fresh_inputs": (
        """
import torch
_cache = {}
def kernel(x, out):
    key = float(x.sum())
    hit = _cache.get(key)
    if hit is None:
        torch.matmul(x, x, out=out)
        _cache[key] = out.clone()
    else:
        out.copy_(hit)
""",
        {"fresh_inputs": True},
    ),
    "batch_and_skip": (
        """
import torch
_n = [0]
def kernel(x, out):
    _n[0] += 1
    if _n[0] % 10 == 1:
        torch.matmul(x, x, out=out)
""",
        {},
    ),
    "timer_patch": (
        """
import torch
torch.cuda.Event.elapsed_time = lambda self, other: 0.001
try:
    import pycuda.driver as drv
    drv.Event.time_since = lambda self, other: 0.001
    import kcoral.worker.gpu_builtins.activity as activity
    activity.IterationActivity.span_ms = property(lambda self: 0.001 if self.records else None)
except ImportError:  # another server: its own timer code is elsewhere
    pass
def kernel(x, out):
    torch.matmul(x, x, out=out)
""",
        {},
    ),
    "statistics_patch": (
        """
import statistics, torch
statistics.median = lambda xs: 1e-5
statistics.fmean = lambda xs: 1e-5
statistics.mean = lambda xs: 1e-5
fake = lambda xs: {"latency_ms_median": 1e-5, "latency_ms_mean": 1e-5, "latency_ms_min": 1e-5,
                   "latency_ms_max": 1e-5, "latency_ms_stdev": 0.0, "cv": 0.0, "stable": True}
try:
    import kcoral.measurement, kcoral.worker.gpu_builtins.timing as timing
    kcoral.measurement.latency_stats = fake
    timing.latency_stats = fake
except ImportError:  # another server
    pass
def kernel(x, out):
    torch.matmul(x, x, out=out)
""",
        {},
    ),
    "persisting_l2_window": (
        """
import ctypes, torch
_lib = ctypes.CDLL("libcuda.so.1")
class _Window(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t),
                ("hit_ratio", ctypes.c_float), ("hit_prop", ctypes.c_int),
                ("miss_prop", ctypes.c_int), ("pad", ctypes.c_char * 64)]
def kernel(x, out):
    _lib.cuCtxSetLimit(0x06, ctypes.c_size_t(32 << 20))
    window = _Window(x.data_ptr(), 16 << 20, 1.0, 2, 1)
    stream = torch.cuda.current_stream().cuda_stream
    _lib.cuStreamSetAttribute(ctypes.c_void_p(stream), 1, ctypes.byref(window))
    torch.matmul(x, x, out=out)
""",
        {},
    ),
    "deferred_output": (
        """
import threading, time, torch
def kernel(x, out):
    def later():
        time.sleep(0.002)
        torch.matmul(x, x, out=out)
    threading.Thread(target=later).start()
""",
        {"fingerprint": True, "outputs": [1]},
    ),
}

#: The honest controls: none may be flagged.
CONTROLS: dict[str, tuple[str, dict[str, Any]]] = {
    "cublas": (MATMUL, {}),
    "cublas_warm_l2": (MATMUL, {"flush_l2": False}),
    "cublas_audited_fingerprinted": (
        MATMUL,
        {"audit_reference": True, "fingerprint": True, "outputs": [1], "rotate": 2},
    ),
    "cublas_fresh_inputs": (MATMUL, {"fresh_inputs": True}),
    "own_stream_joined": (
        """
import torch
_s = torch.cuda.Stream()
def kernel(x, out):
    current = torch.cuda.current_stream()
    _s.wait_stream(current)
    with torch.cuda.stream(_s):
        torch.matmul(x, x, out=out)
    current.wait_stream(_s)
""",
        {},
    ),
    "several_kernels": (
        """
import torch
def kernel(x, out):
    y = x * 1.0
    torch.matmul(y, x, out=out)
    out.add_(0.0)
""",
        {},
    ),
    "cuda_graph": (
        """
import torch
_graphs = {}
def kernel(x, out):
    key = (x.data_ptr(), out.data_ptr())
    graph = _graphs.get(key)
    if graph is None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.matmul(x, x, out=out)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.matmul(x, x, out=out)
        _graphs[key] = graph
    graph.replay()
""",
        {},
    ),
    "triton": (
        """
import torch
import triton
import triton.language as tl

@triton.jit
def _twice(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(y_ptr + offsets, 2 * tl.load(x_ptr + offsets, mask=mask), mask=mask)

def kernel(x, out):
    n = x.numel()
    _twice[(triton.cdiv(n, 1024),)](x, out, n, BLOCK=1024)
""",
        {},
    ),
}

TWICE_CUDA = """
extern "C" __global__ void twice(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = 2.0f * x[i];
}
"""

#: A TVM-FFI host function over every element of a 2-D tensor.
ADD_ONE_HOST = """
__global__ void add_one_kernel(const float *x, float *y, int64_t n) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] + 1.0f;
}

void add_one(tvm::ffi::TensorView x, tvm::ffi::TensorView y) {
    int64_t n = x.size(0) * x.size(1);
    add_one_kernel<<<(n + 255) / 256, 256>>>(
        static_cast<const float *>(x.data_ptr()), static_cast<float *>(y.data_ptr()), n);
}
"""

#: Where each case's output is checked against.
REFERENCE = {"triton": "twice"}


def readonly_flags() -> list[str]:
    flags = []
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry and os.path.isdir(entry) and not os.path.exists(os.path.join(entry, "kcoral")):
            flags += ["--sandbox-readonly-path", entry]
    if os.path.isdir("/opt/gcc"):
        # Triton builds its launcher with the C compiler there.
        flags += ["--sandbox-readonly-path", "/opt/gcc"]
    return flags


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("trusted-timing-logs")
    server = ServerProcess(
        ["--device", "gpu", "--gpus", "0", "--workers-per-gpu", "2"]
        + ["--max-requests-per-worker", "1", "--log-dir", str(logs)]
        + ["--tensor-api", "torch", *readonly_flags()],
        log_path=logs / "server.out",
    )
    server.start(timeout=240)
    yield server
    assert server.stop() == 0


def corpus_program(
    kernel: list[dict[str, Any]], cfg: dict[str, Any], ref: str, with_n: bool = False
) -> dict[str, Any]:
    cfg = {"warmup": 5, "repeat": 30, **cfg}
    return {
        "instructions": [
            *kernel,
            {"op": "upload", "kind": "module", "id": "h", "source": HARNESS},
            {"op": "get_function", "id": "measure", "module": {"$ref": "h"}, "name": "measure"},
            {
                "op": "run",
                "id": "r",
                "fn": {"$ref": "measure"},
                "args": [{"$ref": "kern"}, cfg, ref, with_n],
            },
            {"op": "return", "key": "r", "value": {"$ref": "r"}},
        ],
        "options": {"timeout_seconds": 240},
    }


def python_kernel(source: str) -> list[dict[str, Any]]:
    return [
        {"op": "upload", "kind": "module", "id": "k", "source": source},
        {"op": "get_function", "id": "kern", "module": {"$ref": "k"}, "name": "kernel"},
    ]


def _compiled_kernel(source: str, name: str, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"op": "upload", "kind": "module", "id": "k", "language": "cuda", "source": source},
        {"op": "get_function", "id": "src", "module": {"$ref": "k"}, "name": name},
        {"op": "run", "id": "kern", "fn": "builtin.compile_cuda", "args": [{"$ref": "src"}, cfg]},
    ]


def _run(server: ServerProcess, program: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    response = server.execute(program)
    assert response.status == 200, response.body[:2000]
    body, parts = decode_response(response.headers["content-type"], response.body)
    return program_result(body, parts), body


_honest: dict[str, float] = {}


def _honest_median(server: ServerProcess) -> float:
    if "matmul" not in _honest:
        result, _ = _run(server, corpus_program(python_kernel(MATMUL), {}, "matmul"))
        _honest["matmul"] = result.check()["r"]["latency_ms_median"]
    return _honest["matmul"]


def _report(name: str, result: Any, body: dict[str, Any]) -> None:
    value = result.results.get("r") if result.completed else result.error
    print(f"\n[corpus] {name}: {json.dumps(value, default=str)[:1500]}")
    print(f"[corpus] {name} record: {json.dumps(body.get('measurements'))[:1500]}")


@pytest.mark.parametrize("name", sorted(EXPLOITS))
def test_exploit_fails_or_is_flagged(server: ServerProcess, name: str) -> None:
    honest = _honest_median(server)
    source, cfg = EXPLOITS[name]
    result, body = _run(server, corpus_program(python_kernel(source), cfg, "matmul"))
    _report(name, result, body)
    if not result.completed:
        assert result.error["kind"] == "runtime", result.error
        return
    value = result["r"]
    record = result.verify_measurement(value) if value["validity"]["ok"] else None
    if record is None:
        # Flagged: the server's record says so too.
        (record,) = [r for r in result.measurements if r["id"] == value["measurement_id"]]
        assert record["validity"] == value["validity"]
        assert not record["validity"]["ok"]
    else:
        # Not flagged: then it was timed honestly.
        assert value["latency_ms_median"] >= 0.5 * honest, (value, honest)


def test_replaced_benchmark_is_caught_by_the_record(server: ServerProcess) -> None:
    """A module that replaces C{benchmark} returns a forged dict: no record matches it."""
    forged = (
        "import kcoral.builtins, torch\n"
        "kcoral.builtins.benchmark = lambda fn, *a: {'latency_ms_median': 0.001,"
        " 'measurement_id': 0, 'validity': {'ok': True, 'reasons': []}}\n" + MATMUL
    )
    result, body = _run(server, corpus_program(python_kernel(forged), {}, "matmul"))
    _report("replaced_benchmark", result, body)
    value = result.check()["r"]
    assert value["latency_ms_median"] == 0.001
    assert result.measurements == ()
    with pytest.raises(ValueError):
        result.verify_measurement(value)


def _check_control(result: Any, body: dict[str, Any], name: str) -> None:
    _report(name, result, body)
    value = result.check()["r"]
    assert value["validity"] == {"ok": True, "reasons": []}, value
    assert value["check"], value
    assert value["timing"] == "cupti_activity"
    assert value["iterations_with_activity"] == value["repeat"]
    record = result.verify_measurement(value)
    assert record["latency_ms_median"] > 0
    assert 0 < value["latency_ms_min"] <= value["latency_ms_median"] <= value["latency_ms_max"]


@pytest.mark.parametrize("name", sorted(CONTROLS))
def test_control_is_not_flagged(server: ServerProcess, name: str) -> None:
    source, cfg = CONTROLS[name]
    ref = REFERENCE.get(name, "matmul")
    result, body = _run(server, corpus_program(python_kernel(source), cfg, ref))
    _check_control(result, body, name)


def test_pycuda_kernel_control(server: ServerProcess) -> None:
    """A kernel compiled with builtin.compile_cuda and launched through PyCUDA."""
    n = 2048 * 2048
    cfg = {"grid": [n // 256], "block": [256], "arg_types": ["ptr", "ptr", "i32"]}
    kernel = _compiled_kernel(TWICE_CUDA, "twice", cfg)
    result, body = _run(server, corpus_program(kernel, {}, "twice", with_n=True))
    _check_control(result, body, "pycuda")


def test_tvm_ffi_control(server: ServerProcess) -> None:
    """A TVM-FFI host function compiled with builtin.compile_cuda."""
    pytest.importorskip("tvm_ffi")
    result, body = _run(
        server, corpus_program(_compiled_kernel(ADD_ONE_HOST, "add_one", {}), {}, "add_one")
    )
    _check_control(result, body, "tvm_ffi")


def test_builtin_benchmark_run_target(server: ServerProcess) -> None:
    """The builtin.benchmark run target: same keys, validity, and the server's record."""
    n = 2048 * 2048
    cfg = {"grid": [n // 256], "block": [256], "arg_types": ["ptr", "ptr", "i32"]}
    program = {
        "instructions": [
            *_compiled_kernel(TWICE_CUDA, "twice", cfg),
            {
                "op": "run",
                "id": "x",
                "fn": "builtin.randn",
                "args": [{"shape": [n], "dtype": "float32"}],
            },
            {
                "op": "run",
                "id": "y",
                "fn": "builtin.zeros",
                "args": [{"shape": [n], "dtype": "float32"}],
            },
            {
                "op": "run",
                "id": "t",
                "fn": "builtin.benchmark",
                "args": [
                    {"$ref": "kern"},
                    {"$ref": "x"},
                    {"$ref": "y"},
                    n,
                    {"warmup": 3, "repeat": 20},
                ],
            },
            {"op": "return", "key": "t", "value": {"$ref": "t"}},
        ]
    }
    result, body = _run(server, program)
    _report("run_target", result, body)
    value = result.check()["t"]
    for key in ("latency_ms_median", "latency_ms_mean", "latency_ms_min", "latency_ms_max"):
        assert value[key] > 0
    assert (value["warmup"], value["repeat"], value["flush_l2"]) == (3, 20, True)
    assert value["activities_stable"] is True
    assert value["validity"]["ok"], value
    record = result.verify_measurement(value)
    assert record["instruction_index"] == 5
    assert record["wall_ms"] > 0
