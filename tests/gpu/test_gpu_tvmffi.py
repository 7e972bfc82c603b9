"""
TVM-FFI host functions on the GPU (issue 17, item 1):
C{builtin.compile_cuda} on a C{language: "cuda"} module whose function is
C{void add_one(tvm::ffi::TensorView x, tvm::ffi::TensorView y)} launching a
kernel returns a callable that computes on the device, and
C{compile_cuda_binary}'s library loads with C{tvm_ffi.load_module} there.

Run on the H200: C{python3 -m pytest -m gpu tests/gpu -q}.
"""

from __future__ import annotations

import importlib.util

import pytest
from twisted.trial.unittest import SynchronousTestCase

from kcoral.compilers.tvmffi import load_library
from kcoral.worker import gpu_builtins
from kcoral.worker.builtins import CudaFunction, compile_cuda_binary
from tests.gpu.conftest import gpu_unavailable_reason
from tests.gpu.test_gpu_backend import _Lease, backend, close_backends
from tests.unit.test_tvmffi import HOST

_SKIP = gpu_unavailable_reason() or (
    None
    if importlib.util.find_spec("tvm_ffi") and importlib.util.find_spec("torch")
    else "apache-tvm-ffi and torch are needed"
)


@pytest.mark.gpu
class TvmFfiHostFunctionTests(SynchronousTestCase):
    skip = _SKIP

    def setUp(self) -> None:
        gpu_builtins.use_backend(backend("torch"))

    def test_compile_cuda_host_function(self) -> None:
        import torch

        lease = _Lease()
        add_one = gpu_builtins.compile_cuda(CudaFunction(HOST, "add_one"), {}, lease=lease)
        self.assertEqual(lease.calls, ["release", "acquire"])
        x = torch.arange(1000, dtype=torch.float32, device="cuda")
        y = torch.zeros_like(x)
        add_one(x, y)
        torch.cuda.synchronize()
        self.assertTrue(torch.equal(y, x + 1))

    def test_compile_cuda_binary_library_loads_and_runs(self) -> None:
        import torch

        arch = backend("torch").arch
        image = compile_cuda_binary(CudaFunction(HOST, "add_one"), {"arch": arch})
        add_one = load_library(image)["add_one"]
        x = torch.ones(64, dtype=torch.float32, device="cuda")
        y = torch.zeros_like(x)
        add_one(x, y)
        torch.cuda.synchronize()
        self.assertTrue(torch.equal(y, x + 1))


def teardown_module() -> None:
    close_backends()
