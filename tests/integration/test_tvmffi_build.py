"""
TVM-FFI host functions built for real with nvcc and apache-tvm-ffi's
headers, on a CPU machine (issue 17, item 1): the C{tvmffi} backend's
library loads with C{tvm_ffi.load_module}, and a CPU server's
C{builtin.compile_cuda_binary} returns such a library for a C{language:
"cuda"} module whose function is a TVM-FFI host function.  Calling it needs
a GPU: C{tests/gpu/test_gpu_tvmffi.py}.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from kcoral.compilers.nvcc import find_nvcc
from kcoral.compilers.tvmffi import TvmFfiBackend, export_source, load_library
from kcoral.errors import ExecutionError
from kcoral.testing.live_server import ServerProcess
from kcoral.wire.multipart import decode_response
from kcoral.wire.values import decode_results
from tests.unit.test_tvmffi import HOST

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(find_nvcc()[0] is None, reason="no nvcc"),
    pytest.mark.skipif(
        importlib.util.find_spec("tvm_ffi") is None, reason="apache-tvm-ffi is not installed"
    ),
    pytest.mark.skipif(shutil.which("c++") is None, reason="no host C++ compiler for nvcc"),
]


def test_backend_builds_a_loadable_library(tmp_path: Path) -> None:
    image = TvmFfiBackend(workspace=str(tmp_path)).compile(
        export_source(HOST, "add_one"), "sm_90a", (), 600.0
    )
    assert image[:4] == b"\x7fELF"
    module = load_library(image, str(tmp_path))
    assert module["add_one"] is not None
    assert list(tmp_path.iterdir()) == []  # the temporary file is gone


def test_broken_host_function_is_compile(tmp_path: Path) -> None:
    source = "void add_one(tvm::ffi::TensorView x) { no_such_function(x); }\n"
    with pytest.raises(ExecutionError) as caught:
        TvmFfiBackend(workspace=str(tmp_path)).compile(
            export_source(source, "add_one"), "sm_90a", (), 600.0
        )
    assert caught.value.kind == "compile"
    assert "no_such_function" in caught.value.message


def test_cpu_server_compile_cuda_binary_host_function(tmp_path: Path) -> None:
    program = {
        "instructions": [
            {"op": "upload", "kind": "module", "id": "src", "language": "cuda", "source": HOST},
            {"op": "get_function", "id": "fn", "module": {"$ref": "src"}, "name": "add_one"},
            {
                "op": "run",
                "id": "lib",
                "fn": "builtin.compile_cuda_binary",
                "args": [{"$ref": "fn"}, {"arch": "sm_90a", "timeout_seconds": 600}],
            },
            {"op": "return", "key": "lib", "value": {"$ref": "lib"}},
        ],
        "options": {"timeout_seconds": 900},
    }
    args = ["--device", "cpu", "--log-dir", "", "--disk-cache-dir", ""]
    with ServerProcess(args, log_path=tmp_path / "server.log") as server:
        response = server.execute(program)
    body, parts = decode_response(response.headers["content-type"], response.body)
    assert body["status"] == "COMPLETED", body
    image = decode_results(body["results"], parts)["lib"]
    assert image[:4] == b"\x7fELF"
    assert load_library(image, str(tmp_path))["add_one"] is not None
