# -*- test-case-name: tests.gpu.test_gpu_compile_path -*-
"""
C{builtin.compile_cuda} on a real GPU (issue 17): a source that does not
compile is kind C{compile} with nvcc's message (item 2), and GPU compiles go
through the C{sourcemodule} compiler backend, so they hit the compile cache
and are bounded by the request's budget (item 11).

Run on the H200: C{python3 -m pytest -m gpu tests/gpu -q}.
"""

from __future__ import annotations

import tempfile

import pytest
from twisted.trial.unittest import SynchronousTestCase

import kcoral.compilers as compilers
from kcoral.errors import ExecutionError
from kcoral.worker import gpu_builtins, runtime
from kcoral.worker.builtins import CudaFunction
from tests.gpu.conftest import gpu_unavailable_reason
from tests.gpu.test_gpu_backend import SAXPY, _Lease, backend, close_backends

_SKIP = gpu_unavailable_reason()


@pytest.mark.gpu
class CompilePathTests(SynchronousTestCase):
    skip = _SKIP

    def setUp(self) -> None:
        gpu_builtins.use_backend(backend("pycuda"))
        self.cache = tempfile.mkdtemp(prefix="kcoral-gpu-compile-cache-")
        compilers.configure_cache(self.cache)
        self.addCleanup(compilers.configure_cache, None)
        runtime.set_budget(None)
        self.addCleanup(runtime.set_budget, None)

    def test_broken_source_is_compile(self) -> None:
        """Item 2: C{void broken( {} is C{compile} with nvcc's message, not C{parse}."""
        with self.assertRaises(ExecutionError) as e:
            gpu_builtins.compile_cuda(CudaFunction("void broken( {", "broken"), {}, lease=_Lease())
        self.assertEqual(e.exception.kind, "compile")
        self.assertIn("nvcc failed", e.exception.message)
        self.assertIn("error", e.exception.message)

    def test_second_compile_hits_cache(self) -> None:
        """Item 11: the same source, options and arch compile once; then the cache answers."""
        cfg = {"grid": [1], "block": [256], "extra_cuda_cflags": ["-DKCORAL_CACHE_PROBE=1"]}
        before = compilers.compile_stats()
        gpu_builtins.compile_cuda(CudaFunction(SAXPY, "saxpy"), dict(cfg), lease=_Lease())
        middle = compilers.compile_stats()
        gpu_builtins.compile_cuda(CudaFunction(SAXPY, "saxpy"), dict(cfg), lease=_Lease())
        after = compilers.compile_stats()
        self.assertEqual(middle["compiles"] - before["compiles"], 1)
        self.assertEqual(after["compiles"], middle["compiles"])
        self.assertEqual(after["cache_hits"] - middle["cache_hits"], 1)

    def test_budget_spent_starts_no_compiler(self) -> None:
        """Item 11: with the request's budget spent, nvcc is not started."""
        runtime.set_budget(-1.0)
        before = compilers.compile_stats()
        with self.assertRaises(ExecutionError) as e:
            gpu_builtins.compile_cuda(CudaFunction(SAXPY, "saxpy"), {}, lease=_Lease())
        self.assertEqual(e.exception.kind, "compile")
        self.assertEqual(compilers.compile_stats()["compiles"], before["compiles"])

    def test_budget_bounds_nvcc(self) -> None:
        """
        Item 11: a compile that outlasts the budget is stopped at the budget
        and reported as C{compile} (a huge unrolled kernel takes nvcc
        longer than 0.5 s).
        """
        body = "\n".join(f"  x[{i}] = x[{i}] * 1.0001f + {i}.0f;" for i in range(20000))
        slow = f"__global__ void slow(float *x) {{\n#pragma unroll\n{body}\n}}\n"
        runtime.set_budget(0.5)
        with self.assertRaises(ExecutionError) as e:
            gpu_builtins.compile_cuda(CudaFunction(slow, "slow"), {}, lease=_Lease())
        self.assertEqual(e.exception.kind, "compile")
        self.assertIn("timed out", e.exception.message)


def teardown_module() -> None:
    close_backends()
