# -*- test-case-name: tests.gpu.test_gpu_backend -*-
"""
L{kcoral.worker.gpu.GpuBackend} and the GPU builtins on a real device.

Skipped (by C{conftest.py}, and by C{skip} under trial) without PyCUDA or a
CUDA device.
"""

from __future__ import annotations

import gc
import importlib.util
import os

import numpy as np
import pytest
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from kcoral.errors import ExecutionError
from kcoral.wire.program import DTYPES
from kcoral.worker import gpu_builtins
from kcoral.worker.builtins import CudaFunction
from kcoral.worker.interfaces import IDeviceBackend
from tests.gpu.conftest import gpu_unavailable_reason

_SKIP = gpu_unavailable_reason()
_HAS_TORCH = importlib.util.find_spec("torch") is not None
_HAS_CUPY = importlib.util.find_spec("cupy") is not None

SAXPY = """
__global__ void saxpy(float *y, const float *x, float a, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"""

_backends: dict[str, object] = {}


def backend(tensor_api: str = "pycuda"):
    """One L{GpuBackend} per tensor API for the whole test run."""
    from kcoral.worker.gpu import GpuBackend

    if tensor_api not in _backends:
        _backends[tensor_api] = GpuBackend(0, tensor_api=tensor_api)
    return _backends[tensor_api]


class _Lease:
    """Records what C{compile_cuda} does with the lease."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.held = True

    def acquire(self) -> None:
        self.calls.append("acquire")
        self.held = True

    def release(self) -> None:
        self.calls.append("release")
        self.held = False


def _random_bytes(dtype: str, shape: tuple[int, ...], seed: int = 0) -> bytes:
    n = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype]
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    if dtype == "bool":
        data &= 1
    return data.tobytes()


def _part_bytes(part) -> bytes:
    """The bytes of a tensor_parts result (a shared buffer for large device tensors)."""
    from kcoral.ipc import shared

    return part.tobytes() if isinstance(part, shared.SharedBuffer) else bytes(part)


@pytest.mark.gpu
class BackendTests(SynchronousTestCase):
    """Facts, transfers and lifecycle."""

    skip = _SKIP

    def setUp(self) -> None:
        gpu_builtins.use_backend(backend("pycuda"))

    def test_interface(self) -> None:
        """The backend provides L{IDeviceBackend}."""
        b = backend("pycuda")
        self.assertTrue(verifyObject(IDeviceBackend, b))
        self.assertEqual(b.name, "gpu")
        self.assertTrue(b.uses_lease)

    def test_target_and_versions(self) -> None:
        """The arch is C{sm_XY} (with C{a} from Hopper on); versions are strings."""
        b = backend("pycuda")
        arch = b.target()["arch"]
        self.assertRegex(arch, r"^sm_\d+a?$")
        major = int(arch[3:].rstrip("a")) // 10
        self.assertEqual(arch.endswith("a"), major >= 9)
        versions = b.versions()
        for key in ("cuda_driver", "pycuda", "numpy", "python"):
            self.assertIsInstance(versions[key], str)
        print("target", b.target(), "versions", versions, "device", b.device_name())

    def test_round_trip_all_dtypes(self) -> None:
        """Every dtype uploads and comes back byte-exact, in both tensor APIs."""
        apis = ["pycuda"] + (["torch"] if _HAS_TORCH else [])
        for api in apis:
            b = backend(api)
            for i, dtype in enumerate(DTYPES):
                for shape in ((3, 5), (), (0, 4), (2, 3, 4)):
                    data = _random_bytes(dtype, shape, seed=i)
                    value = b.upload_tensor(data, dtype, shape)
                    parts = b.tensor_parts(value)
                    self.assertEqual(parts, (dtype, shape, data), (api, dtype, shape))

    def test_large_tensors_through_shared_buffers(self) -> None:
        """
        As a worker moves them: uploaded from a read-only memfd mapping
        (page-locked for the copy, see REGISTER_HOST_BYTES) and back through
        a host view; byte-exact in both tensor APIs.
        """
        from kcoral.ipc import shared

        shape = (512, 1024)
        for api in ["pycuda"] + (["torch"] if _HAS_TORCH else []):
            for dtype in ("float32", "bfloat16", "int8"):
                data = _random_bytes(dtype, shape, seed=3)
                value = backend(api).upload_tensor(shared.share(data).map(), dtype, shape)
                name, got_shape, part = backend(api).tensor_parts(value)
                self.assertEqual((name, got_shape, bytes(part)), (dtype, shape, data), (api, dtype))

    def test_large_device_tensors_returned_through_page_locked_buffers(self) -> None:
        """
        A contiguous device tensor of REGISTER_HOST_BYTES or more is copied
        at pinned-memory speed, each way (KCORAL_DTOH_COPY): staging gives a
        view of the worker's page-locked staging buffer (reused after
        returned()), registered a sealed shared buffer, pageable host bytes;
        byte-exact at the threshold and at 64 MiB, in both tensor APIs; a
        non-contiguous one and a smaller one come back as host bytes.
        """
        from kcoral.ipc import shared
        from kcoral.worker import gpu

        threshold = gpu.REGISTER_HOST_BYTES
        cases = (("float32", threshold), ("uint8", 64 << 20), ("int8", threshold - 1))
        for api in ["pycuda"] + (["torch"] if _HAS_TORCH else []):
            b = backend(api)
            default = b._dtoh_copy
            try:
                for how in gpu.DTOH_COPIES:
                    b._dtoh_copy = how
                    for dtype, nbytes in cases:
                        rng = np.random.default_rng(nbytes)
                        data = rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()
                        shape = (nbytes // (4 if dtype == "float32" else 1),)
                        value = b.upload_tensor(shared.share(data).map(), dtype, shape)
                        name, got_shape, part = b.tensor_parts(value)
                        label = (api, how, dtype, nbytes)
                        self.assertEqual((name, got_shape), (dtype, shape), label)
                        large = nbytes >= threshold
                        self.assertEqual(
                            isinstance(part, shared.SharedBuffer),
                            large and how == "registered",
                            label,
                        )
                        if large and how == "staging":
                            self.assertTrue(np.shares_memory(part.obj, b._staging.buffer), label)
                        self.assertEqual(_part_bytes(part), data, label)
                        b.returned()
            finally:
                b._dtoh_copy = default
            self.assertIsNone(gpu._dtoh_refused)
        if _HAS_TORCH:
            import torch

            b = backend("torch")
            default = b._dtoh_copy
            t = torch.arange(2 << 20, dtype=torch.float32, device="cuda").reshape(1024, 2048)
            name, shape, part = b.tensor_parts(t.t())  # non-contiguous
            self.assertEqual(bytes(part), t.t().contiguous().cpu().numpy().tobytes())
            computed = t * 2  # fresh work on torch's stream, finished before the copy
            for how in ("staging", "registered"):
                b._dtoh_copy = how
                try:
                    name, shape, part = b.tensor_parts(computed)
                    self.assertEqual(_part_bytes(part), computed.cpu().numpy().tobytes(), how)
                finally:
                    b.returned()
                    b._dtoh_copy = default

    def test_upload_size_mismatch(self) -> None:
        """Data of the wrong length is C{runtime}."""
        with self.assertRaises(ExecutionError) as e:
            backend("pycuda").upload_tensor(b"\0" * 3, "float32", (1,))
        self.assertEqual(e.exception.kind, "runtime")

    def test_tensor_api_modes(self) -> None:
        """pycuda gives GPUArray; torch (and auto with torch) give torch tensors."""
        from pycuda.gpuarray import GPUArray

        data = np.arange(4, dtype=np.float32).tobytes()
        self.assertIsInstance(backend("pycuda").upload_tensor(data, "float32", (4,)), GPUArray)
        auto = backend("auto")
        if _HAS_TORCH:
            import torch

            self.assertEqual(auto.tensor_api, "torch")
            t = backend("torch").upload_tensor(data, "float32", (4,))
            self.assertIsInstance(t, torch.Tensor)
            self.assertTrue(t.is_cuda)
            self.assertEqual(t.tolist(), [0.0, 1.0, 2.0, 3.0])
        else:
            self.assertEqual(auto.tensor_api, "pycuda")

    def test_torch_shares_allocation(self) -> None:
        """A torch tensor aliases the PyCUDA allocation and keeps it alive."""
        if not _HAS_TORCH:
            raise self.skipTest("torch is not installed")
        import torch

        b = backend("torch")
        array = b.allocate("float32", (1024,))
        tensor = b.as_torch(array)
        self.assertEqual(tensor.data_ptr(), int(array.gpudata))
        tensor.fill_(3.0)
        torch.cuda.synchronize()
        self.assertTrue((array.get() == 3.0).all())
        del array
        gc.collect()
        import pycuda.driver as drv

        scratch = b.allocate("float32", (1024,))  # would reuse freed memory
        drv.memset_d32(scratch.gpudata, 0x40E00000, 1024)  # 7.0f
        self.assertEqual(float(tensor.sum()), 3.0 * 1024)
        for dtype in ("bfloat16", "float8_e4m3fn", "float8_e5m2", "bool"):
            t = b.as_torch(b.allocate(dtype, (4,)))
            self.assertEqual(str(t.dtype), f"torch.{dtype}")

    def test_tensor_parts_other_types(self) -> None:
        """CPU torch tensors, numpy and cupy arrays; other dtypes are left to the encoder."""
        b = backend("pycuda")
        a = np.arange(6, dtype=np.int16).reshape(2, 3)
        self.assertEqual(b.tensor_parts(a), ("int16", (2, 3), a.tobytes()))
        self.assertIsNone(b.tensor_parts("text"))
        if _HAS_TORCH:
            import torch

            t = torch.arange(6, dtype=torch.bfloat16).reshape(3, 2)
            name, shape, data = b.tensor_parts(t.t())  # non-contiguous
            self.assertEqual((name, shape), ("bfloat16", (2, 3)))
            self.assertEqual(data, t.t().contiguous().view(torch.int16).numpy().tobytes())
            self.assertEqual(
                b.tensor_parts(torch.zeros(2, dtype=torch.complex64, device="cuda")),
                ("complex64", (2,), b""),
            )
        if _HAS_CUPY:
            import cupy

            c = cupy.arange(5, dtype=cupy.float32)
            self.assertEqual(
                b.tensor_parts(c), ("float32", (5,), np.arange(5, dtype=np.float32).tobytes())
            )

    def test_every_visible_device_has_its_context(self) -> None:
        """A backend retains the primary context of every other device it sees (multi-GPU)."""
        import pycuda.driver as drv

        b = backend("pycuda")
        self.assertEqual(len(b.other_contexts), drv.Device.count() - 1)
        seen = set()
        for context in b.other_contexts:
            # Context.get_device() names the *current* context's device.
            context.push()
            try:
                seen.add(drv.Context.get_device().pci_bus_id())
            finally:
                drv.Context.pop()
        self.assertNotIn(b.device.pci_bus_id(), seen)
        self.assertEqual(len(seen), len(b.other_contexts))

    def test_lifecycle(self) -> None:
        """drain, cleanup and reset succeed on a healthy context."""
        b = backend("pycuda")
        b.upload_tensor(b"\0" * 16, "float32", (4,))
        b.drain()
        self.assertIsNone(b.cleanup())
        b.reset()


@pytest.mark.gpu
class FactoryTests(SynchronousTestCase):
    """randn, empty, zeros, check_close, assert_close."""

    skip = _SKIP

    def setUp(self) -> None:
        gpu_builtins.use_backend(backend("pycuda"))

    def _bytes(self, value) -> bytes:
        return _part_bytes(backend("pycuda").tensor_parts(value)[2])

    def test_randn_seeded(self) -> None:
        """The same seed gives the same bits; default dtype float16."""
        a = gpu_builtins.randn({"shape": [256, 64], "seed": 42})
        b = gpu_builtins.randn({"shape": [256, 64], "seed": 42})
        c = gpu_builtins.randn({"shape": [256, 64], "seed": 43})
        self.assertEqual(str(a.dtype), "float16")
        self.assertEqual(self._bytes(a), self._bytes(b))
        self.assertNotEqual(self._bytes(a), self._bytes(c))
        values = a.get().astype(np.float64)
        self.assertLess(abs(values.mean()), 0.05)
        self.assertLess(abs(values.std() - 1.0), 0.05)
        with self.assertRaises(ExecutionError) as e:
            gpu_builtins.randn({"shape": [2], "dtype": "int32"})
        self.assertEqual(e.exception.kind, "parse")

    def test_zeros_empty(self) -> None:
        """zeros is zero-filled; empty has the shape and dtype asked for."""
        z = gpu_builtins.zeros({"shape": [3, 7], "dtype": "bfloat16"})
        self.assertEqual(self._bytes(z), b"\0" * 42)
        e = gpu_builtins.empty({"shape": [5], "dtype": "int64"})
        self.assertEqual((e.shape, str(e.dtype)), ((5,), "int64"))
        self.assertEqual(self._bytes(gpu_builtins.zeros({"shape": [0]})), b"")

    def test_check_close(self) -> None:
        """Device vs host comparison, pass and fail."""
        x = gpu_builtins.randn({"shape": [1000], "dtype": "float32", "seed": 1})
        host = x.get()
        ok = gpu_builtins.check_close(x, host)
        self.assertEqual(
            (ok["passed"], ok["max_abs_err"], ok["rtol"], ok["atol"]), (True, 0.0, 1e-2, 1e-3)
        )
        bad = gpu_builtins.check_close(x, host + 0.5, {"atol": 0.1, "rtol": 0})
        self.assertFalse(bad["passed"])
        self.assertAlmostEqual(bad["max_abs_err"], 0.5, places=5)
        self.assertTrue(gpu_builtins.assert_close(x, x)["passed"])
        with self.assertRaises(ExecutionError) as e:
            gpu_builtins.assert_close(x, host + 0.5)
        self.assertEqual(e.exception.kind, "correctness")
        self.assertTrue(e.exception.message.startswith("outputs differ: max_abs_err=0.5"))


@pytest.mark.gpu
class KernelTests(SynchronousTestCase):
    """compile_cuda, launch handles, benchmark and library uploads."""

    skip = _SKIP

    def setUp(self) -> None:
        gpu_builtins.use_backend(backend("pycuda"))

    def _saxpy(self, **cfg):
        n = 1 << 20
        cfg.setdefault("grid", [(n + 255) // 256])
        cfg.setdefault("block", [256])
        return n, gpu_builtins.compile_cuda(CudaFunction(SAXPY, "saxpy"), cfg, lease=_Lease())

    def test_compile_and_launch(self) -> None:
        """The compiled kernel computes saxpy; nvcc ran off the lease."""
        lease = _Lease()
        n = 1 << 20
        handle = gpu_builtins.compile_cuda(
            CudaFunction(SAXPY, "saxpy"), {"grid": [n // 256], "block": [256]}, lease=lease
        )
        self.assertEqual(lease.calls, ["release", "acquire"])
        self.assertEqual(
            [k for _, k in handle.params], ["ptr", "ptr", "f32", "i32"]
        )  # read from the C signature
        x = gpu_builtins.randn({"shape": [n], "dtype": "float32", "seed": 2})
        y = gpu_builtins.randn({"shape": [n], "dtype": "float32", "seed": 3})
        expected = 2.0 * x.get() + y.get()
        handle(y, x, 2.0, n)
        gpu_builtins.assert_close(y, expected, {"rtol": 1e-6, "atol": 1e-6})

    def test_torch_arguments(self) -> None:
        """Torch tensors are accepted as pointers; CPU tensors are refused."""
        if not _HAS_TORCH:
            raise self.skipTest("torch is not installed")
        import torch

        n, handle = self._saxpy(arg_types=["y:ptr", "x:ptr", "a:f32", "n:i32"])
        x = torch.ones(n, device="cuda")
        y = torch.ones(n, device="cuda")
        handle(y, x, 3.0, n)
        torch.cuda.synchronize()
        self.assertEqual(float(y.sum()), 4.0 * n)
        with self.assertRaises(ExecutionError) as e:
            handle(y.cpu(), x, 3.0, n)
        self.assertIn(
            "parameter 0 (y) expects a device tensor (ptr), got a CPU torch.Tensor",
            e.exception.message,
        )

    def test_wrong_argument(self) -> None:
        """A wrong scalar type names the parameter; nothing is launched."""
        n, handle = self._saxpy()
        x = gpu_builtins.zeros({"shape": [n], "dtype": "float32"})
        with self.assertRaises(ExecutionError) as e:
            handle(x, x, 1.0, float(n))
        self.assertEqual(e.exception.kind, "runtime")
        self.assertIn("parameter 3 (n) expects i32", e.exception.message)
        with self.assertRaises(ExecutionError) as e:
            handle(x, x, 1.0)
        self.assertEqual(e.exception.kind, "runtime")

    def test_compile_error(self) -> None:
        """nvcc diagnostics are C{compile}."""
        with self.assertRaises(ExecutionError) as e:
            gpu_builtins.compile_cuda(
                CudaFunction("__global__ void k(int n) { undefined_thing(); }", "k"),
                {"grid": 1, "block": 1},
                lease=_Lease(),
            )
        self.assertEqual(e.exception.kind, "compile")
        self.assertIn("undefined_thing", e.exception.message)

    def test_benchmark(self) -> None:
        """Explicit counts, estimated counts, latencies > 0."""
        n, handle = self._saxpy()
        x = gpu_builtins.zeros({"shape": [n], "dtype": "float32"})
        y = gpu_builtins.zeros({"shape": [n], "dtype": "float32"})
        result = gpu_builtins.benchmark(handle, y, x, 1.0, n, {"warmup": 3, "repeat": 50})
        self.assertEqual((result["warmup"], result["repeat"]), (3, 50))
        self.assertTrue(result["flush_l2"])
        self.assertTrue(result["activities_stable"])
        self.assertEqual(result["timing"], "cupti_activity")
        self.assertEqual(result["iterations_with_activity"], 50)
        self.assertEqual(result["validity"], {"ok": True, "reasons": []})
        for key in ("latency_ms_median", "latency_ms_mean", "latency_ms_min", "latency_ms_max"):
            self.assertGreater(result[key], 0.0)
        self.assertLessEqual(result["latency_ms_min"], result["latency_ms_median"])
        self.assertLessEqual(result["latency_ms_median"], result["latency_ms_max"])
        estimated = gpu_builtins.benchmark(handle, y, x, 1.0, n, {"warmup_ms": 5, "repeat_ms": 20})
        self.assertGreater(estimated["repeat"], 1)
        noflush = gpu_builtins.benchmark(handle, y, x, 1.0, n, {"repeat": 200, "flush_l2": False})
        print("benchmark saxpy 1M:", result, estimated, noflush)
        self.assertIsNotNone(backend("pycuda").spin_function())
        self.assertFalse(noflush["flush_l2"])
        self.assertEqual(noflush["repeat"], 200)

    def test_benchmark_errors(self) -> None:
        """A RuntimeError in the calls is C{runtime}."""

        def boom() -> None:
            raise RuntimeError("kaput")

        with self.assertRaises(ExecutionError) as e:
            gpu_builtins.benchmark(boom, {"warmup": 1, "repeat": 1})
        self.assertEqual(
            (e.exception.kind, e.exception.message), ("runtime", "RuntimeError: kaput")
        )

    def test_library(self) -> None:
        """A cubin from pycuda.compiler loads, exports its kernels and launches."""
        from pycuda.compiler import compile as pycuda_compile

        from kcoral.compilers.nvcc import find_nvcc

        b = backend("pycuda")
        cubin = pycuda_compile(SAXPY, nvcc=find_nvcc()[0], arch=b.arch, cache_dir=False)
        library = b.load_library(cubin)
        function = library.get_function("saxpy")
        n = 4096
        x = gpu_builtins.randn({"shape": [n], "dtype": "float32", "seed": 5})
        y = gpu_builtins.zeros({"shape": [n], "dtype": "float32"})
        function(y, x, np.float32(2.0), np.int32(n), block=(256, 1, 1), grid=(n // 256, 1))
        gpu_builtins.assert_close(y, 2.0 * x.get(), {"rtol": 1e-6, "atol": 0})
        handle = gpu_builtins.launcher(
            library,
            "saxpy",
            {"grid": [n // 256], "block": [256], "arg_types": ["y:ptr", "x:ptr", "a:f32", "n:i32"]},
        )
        handle(y, x, 1.0, n)
        gpu_builtins.assert_close(y, 3.0 * x.get(), {"rtol": 1e-6, "atol": 0})
        self.assertIs(
            gpu_builtins.launcher(function, {"arg_types": ["ptr"], "grid": 1, "block": 1}).function,
            function.function,
        )
        with self.assertRaises(ExecutionError) as e:
            library.get_function("nope")
        self.assertEqual(e.exception.kind, "compile")
        with self.assertRaises(ExecutionError) as e:
            b.load_library(b"not a cubin")
        self.assertEqual(e.exception.kind, "compile")


def close_backends() -> None:
    """
    Close the cached backends (popping their contexts), so PyCUDA's exit
    finds an empty context stack; every module that uses L{backend} calls it
    at its end.
    """
    for b in list(_backends.values()):
        b.close()
    _backends.clear()
    gpu_builtins.use_backend(None)


def teardown_module() -> None:
    close_backends()


if os.environ.get("KCORAL_GPU_TEST_DEBUG"):
    print("gpu tests:", _SKIP or "enabled")
