"""
L{kcoral.compilers.call}: C{compile_cuda_binary}'s call, checked once for
the worker's builtin and the server's compile-only programs alike.
"""

from __future__ import annotations

from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from kcoral.compilers.call import (
    COMPILE_TIMEOUT_SECONDS,
    CompileCall,
    CudaFunction,
    CudaSource,
    compile_call,
    split_cfg,
)
from kcoral.errors import ExecutionError

KERNEL = "__global__ void k(float *p) { p[0] = 1; }\n"
HOST = "void add_one(tvm::ffi::TensorView x, tvm::ffi::TensorView y) { }\n"


class CompileCallTests(SynchronousTestCase):
    """What a call compiles, and the C{parse} errors it is refused with."""

    def test_kernel(self) -> None:
        """A kernel: a cubin by nvcc, C{extern "C"} added, the default timeout."""
        call = compile_call(CudaFunction(KERNEL, "k"), {"arch": "sm_90a"})
        self.assertEqual(
            call,
            CompileCall('extern "C" ' + KERNEL, "sm_90a", (), COMPILE_TIMEOUT_SECONDS, "nvcc"),
        )

    def test_host_function(self) -> None:
        """A TVM-FFI host function: a shared library by C{tvmffi}, exported."""
        call = compile_call(
            CudaFunction(HOST, "add_one"),
            {"arch": "sm_90a", "extra_cuda_cflags": ["-O3"], "timeout_seconds": 5},
        )
        self.assertEqual((call.backend, call.flags, call.timeout), ("tvmffi", ("-O3",), 5.0))
        self.assertIn("TVM_FFI_DLL_EXPORT_TYPED_FUNC(add_one, add_one)", call.source)

    def test_source_text(self) -> None:
        """The source as text (no function named) is a cubin."""
        self.assertEqual(compile_call(HOST, {"arch": "sm_80"}).backend, "nvcc")

    def test_refused(self) -> None:
        """Each broken call is C{parse}, with the builtin's message."""
        function = CudaFunction(KERNEL, "k")
        for args, message in (
            ((function, "x", {"arch": "a"}), "compile_cuda_binary expects (source, cfg)"),
            (
                (42, {"arch": "a"}),
                "compile_cuda_binary expects the get_function handle of a CUDA module",
            ),
            ((function, {}), "compile_cuda_binary: 'arch' must be a string"),
            ((function,), "compile_cuda_binary: 'arch' must be a string"),
            (
                (function, {"arch": "a", "extra_cuda_cflags": "-O3"}),
                "compile_cuda_binary: 'extra_cuda_cflags' must be a list of strings",
            ),
            (
                (function, {"arch": "a", "extra_cuda_cflags": [3]}),
                "compile_cuda_binary: 'extra_cuda_cflags' must be a list of strings",
            ),
        ):
            with self.assertRaises(ExecutionError) as caught:
                compile_call(*args)
            self.assertEqual((caught.exception.kind, caught.exception.message), ("parse", message))

    def test_timeout_not_a_number(self) -> None:
        """A timeout that is no number is a Python error (the worker's C{engine})."""
        with self.assertRaises(ValueError):
            compile_call(CudaFunction(KERNEL, "k"), {"arch": "a", "timeout_seconds": "x"})

    def test_split_cfg(self) -> None:
        """A trailing dict is the cfg."""
        cfg: dict[str, Any] = {"arch": "a"}
        self.assertEqual(split_cfg((1, cfg)), ((1,), cfg))
        self.assertEqual(split_cfg((1,)), ((1,), {}))


class CudaSourceTests(SynchronousTestCase):
    """C{get_function} on a CUDA module."""

    def test_names(self) -> None:
        """A C identifier other than C{main}; anything else is C{parse}."""
        source = CudaSource(KERNEL)
        self.assertEqual(source.get_function("k"), CudaFunction(KERNEL, "k"))
        for name in ("main", "1k", "a-b", ""):
            with self.assertRaises(ExecutionError) as caught:
                source.get_function(name)
            self.assertEqual(caught.exception.kind, "parse")
