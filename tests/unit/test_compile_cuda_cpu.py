# -*- test-case-name: tests.unit.test_compile_cuda_cpu -*-
"""
How C{builtin.compile_cuda} reaches the compiler, checked without a GPU:
it compiles before it reads the kernel's signature (issue 17, item 2) and
goes through the compiler backend registry's C{sourcemodule} backend with
a timeout bounded by the request's budget (issue 17, item 11).  The real
compiles run on the H200 in C{tests/gpu/test_gpu_compile_path.py}.
"""

from __future__ import annotations

from typing import Any

from twisted.trial.unittest import SynchronousTestCase

import kcoral.compilers
from kcoral.errors import ExecutionError
from kcoral.worker import runtime
from kcoral.worker.builtins import CudaFunction
from kcoral.worker.gpu_builtins import compiling


class _Backend:
    """Just enough of a GPU device backend for compile_cuda to get its arch."""

    name = "gpu"
    arch = "sm_90a"

    def load_library(self, image: bytes) -> Any:
        raise AssertionError("not reached in these tests")


class _Lease:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def acquire(self) -> None:
        self.calls.append("acquire")

    def release(self) -> None:
        self.calls.append("release")


class CompileCudaPathTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.error: ExecutionError | None = None

        def compile_binary(
            source: str, arch: str, flags: tuple[str, ...], timeout: float, *, backend: str
        ) -> bytes:
            self.calls.append(
                {
                    "source": source,
                    "arch": arch,
                    "flags": flags,
                    "timeout": timeout,
                    "backend": backend,
                }
            )
            if self.error is not None:
                raise self.error
            return b"image"

        self.patch(kcoral.compilers, "compile_binary", compile_binary)
        runtime.use_backend(_Backend())
        self.addCleanup(runtime.use_backend, None)
        runtime.set_budget(None)
        self.addCleanup(runtime.set_budget, None)

    def test_broken_source_is_compile_error(self) -> None:
        """
        A source that does not compile is kind C{compile} with the
        compiler's message, even though its signature cannot be read.
        """
        self.error = ExecutionError("compile", "nvcc failed for sm_90a:\nerror: expected a ')'")
        with self.assertRaises(ExecutionError) as e:
            compiling.compile_cuda(CudaFunction("void broken( {", "broken"), {}, lease=_Lease())
        self.assertEqual(e.exception.kind, "compile")
        self.assertIn("expected a ')'", e.exception.message)
        self.assertEqual(len(self.calls), 1)

    def test_unreadable_signature_after_compile_is_parse(self) -> None:
        """A source that compiles but whose parameters cannot be read is C{parse}."""
        source = "struct my_t { int v; };\n__global__ void k(my_t x) {}"
        with self.assertRaises(ExecutionError) as e:
            compiling.compile_cuda(CudaFunction(source, "k"), {}, lease=_Lease())
        self.assertEqual(e.exception.kind, "parse")
        self.assertIn("give cfg.arg_types", e.exception.message)

    def test_sourcemodule_backend_and_default_timeout(self) -> None:
        """Without a budget the compile gets the default bound, through the registry."""
        compiling.compile_image("__global__ void k() {}", "sm_90a", ["-lineinfo"])
        [call] = self.calls
        self.assertEqual(call["backend"], "sourcemodule")
        self.assertEqual(call["arch"], "sm_90a")
        self.assertEqual(call["flags"], ("-O3", "-lineinfo"))
        self.assertEqual(call["timeout"], compiling.COMPILE_TIMEOUT_SECONDS)

    def test_timeout_bounded_by_budget(self) -> None:
        """A request with 10 s of budget never lets the compiler run longer."""
        runtime.set_budget(10.0)
        compiling.compile_image("__global__ void k() {}", "sm_90a", [])
        [call] = self.calls
        self.assertGreater(call["timeout"], 0)
        self.assertLessEqual(call["timeout"], 10.0)

    def test_budget_spent(self) -> None:
        """With no budget left the compiler is not started."""
        runtime.set_budget(-1.0)
        with self.assertRaises(ExecutionError) as e:
            compiling.compile_image("__global__ void k() {}", "sm_90a", [])
        self.assertEqual(e.exception.kind, "compile")
        self.assertEqual(self.calls, [])
