# -*- test-case-name: tests.unit.test_gpu_builtins_cpu -*-
"""
The host-side parts of L{kcoral.worker.gpu_builtins} and L{kcoral.worker.tensors}:
everything that needs no GPU, PyCUDA or torch.
"""

from __future__ import annotations

import contextlib
import struct
import sys
import types
from collections.abc import Iterator
from typing import Any
from unittest import mock

import ml_dtypes
import numpy as np
from twisted.trial.unittest import SynchronousTestCase

from kcoral.errors import ExecutionError
from kcoral.testing.fakes import FakeDeviceArray, FakeFunction
from kcoral.wire.values import numpy_dtype
from kcoral.worker import gpu_builtins, tensors
from kcoral.worker.gpu_builtins import (
    BenchmarkConfig,
    KernelHandle,
    add_extern_c,
    compare_arrays,
    iteration_count,
    kernel_signature,
    latency_stats,
    normalize_arg_types,
    parse_benchmark_cfg,
    parse_tensor_spec,
    parse_tolerances,
    plan_counts,
    split_cfg,
    timing,
)
from kcoral.worker.gpu_builtins.timing import MAX_RETRIES, disturbed, parse_compare_cfg


class BenchmarkConfigTests(SynchronousTestCase):
    """C{benchmark} cfg parsing and count planning (protocol §10.1)."""

    def test_defaults(self) -> None:
        """No cfg means 25 ms warm-up, 100 ms timed, flush on, estimate needed."""
        config = parse_benchmark_cfg(None)
        self.assertEqual(config, BenchmarkConfig(25.0, 100.0, None, None, True))
        self.assertTrue(config.needs_estimate)

    def test_explicit_counts_skip_estimate(self) -> None:
        """With both counts the estimate is skipped and the counts are used."""
        config = parse_benchmark_cfg({"warmup": 3, "repeat": 7, "flush_l2": False})
        self.assertFalse(config.needs_estimate)
        self.assertEqual(plan_counts(config, None), (3, 7))
        self.assertFalse(config.flush_l2)

    def test_retry_on_interference(self) -> None:
        """retry_on_interference is a count from 0 to MAX_RETRIES; anything else is refused."""
        self.assertEqual(parse_benchmark_cfg({}).retry_on_interference, 0)
        self.assertEqual(parse_benchmark_cfg({"retry_on_interference": 3}).retry_on_interference, 3)
        for bad in (True, -1, MAX_RETRIES + 1, 1.5, "2"):
            with self.assertRaises(ExecutionError) as caught:
                parse_benchmark_cfg({"retry_on_interference": bad})
            self.assertEqual(caught.exception.kind, "parse")

    def test_compare_cfg(self) -> None:
        """compare takes benchmark's counts, budgets and flush_l2, none of its options."""
        config = parse_compare_cfg({"warmup": 3, "repeat": 20, "flush_l2": False})
        self.assertEqual((config.warmup, config.repeat, config.flush_l2), (3, 20, False))
        for bad in ({"audit": abs}, {"rotate": 2}, {"repeat": 0}, {"retry_on_interference": 1}):
            with self.assertRaises(ExecutionError) as caught:
                parse_compare_cfg(bad)
            self.assertEqual(caught.exception.kind, "parse")

    def test_declared_work(self) -> None:
        """bytes and flops are positive numbers, kept for the parent's plausibility check."""
        config = parse_benchmark_cfg({"bytes": 1e9, "flops": 2})
        self.assertEqual((config.work_bytes, config.work_flops), (1e9, 2.0))
        for bad in (0, -1, "1", True, float("nan")):
            with self.assertRaises(ExecutionError):
                parse_benchmark_cfg({"bytes": bad})

    def test_disturbed(self) -> None:
        """Only the GPU monitor's reasons make a result worth measuring again."""
        flagged = {"validity": {"ok": False, "reasons": ["interference: process 9"]}}
        throttled = {"validity": {"ok": False, "reasons": ["throttled: sw_power_cap"]}}
        other = {"validity": {"ok": False, "reasons": ["envelope: too fast"]}}
        self.assertTrue(disturbed(flagged))
        self.assertTrue(disturbed(throttled))
        self.assertFalse(disturbed(other))
        self.assertFalse(disturbed({}))

    def test_one_count_still_needs_estimate(self) -> None:
        """Only C{repeat} given: the warm-up count comes from the estimate."""
        config = parse_benchmark_cfg({"repeat": 10, "warmup_ms": 10})
        self.assertTrue(config.needs_estimate)
        self.assertEqual(plan_counts(config, 2.0), (5, 10))

    def test_budgets(self) -> None:
        """Budgets become C{max(1, int(budget / estimate))}."""
        config = parse_benchmark_cfg({"warmup_ms": 25, "repeat_ms": 100})
        self.assertEqual(plan_counts(config, 0.3), (83, 333))
        self.assertEqual(plan_counts(config, 500.0), (1, 1))

    def test_zero_estimate(self) -> None:
        """An estimate of 0 gives 1000 calls."""
        self.assertEqual(iteration_count(100, 0.0), 1000)
        self.assertEqual(iteration_count(0, 1.0), 1)
        # No more than the parent accepts in one measurement.
        self.assertEqual(iteration_count(100, 1e-9), 1_000_000)

    def test_invalid(self) -> None:
        """Bad types and values are C{parse} errors."""
        for cfg in (
            {"warmup": 0},
            {"repeat": 1.5},
            {"repeat": True},
            {"warmup_ms": -1},
            {"repeat_ms": "10"},
            {"repeat_ms": float("nan")},
            {"flush_l2": 1},
            {"repeat": 1_000_001},
            [1],
        ):
            with self.assertRaises(ExecutionError) as e:
                parse_benchmark_cfg(cfg)
            self.assertEqual(e.exception.kind, "parse", cfg)

    def test_evaluator_options(self) -> None:
        """Fresh inputs, audit and fingerprint options (docs/trusted-timing.md)."""

        def factory(i: int) -> tuple[int, ...]:
            return (i,)

        def reference(*args: object) -> None:
            return None

        config = parse_benchmark_cfg(
            {
                "inputs": factory,
                "audit": reference,
                "audit_output": 1,
                "audit_rtol": 0.1,
                "fingerprint": True,
                "outputs": [1],
            }
        )
        self.assertIs(config.inputs, factory)
        self.assertIs(config.audit, reference)
        self.assertEqual((config.audit_output, config.audit_tolerances), (1, (0.1, 1e-3)))
        self.assertEqual((config.fingerprint, config.outputs), (True, (1,)))
        self.assertEqual(parse_benchmark_cfg({"rotate": 4}).rotate, 4)
        for cfg in (
            {"rotate": 0},
            {"rotate": 2000},
            {"rotate": True},
            {"inputs": 3},
            {"inputs": factory, "rotate": 2},
            {"audit": "x"},
            {"audit": reference, "audit_atol": -1},
            {"fingerprint": "yes"},
            {"outputs": [True]},
            {"outputs": 1},
        ):
            with self.assertRaises(ExecutionError) as e:
                parse_benchmark_cfg(cfg)
            self.assertEqual(e.exception.kind, "parse", cfg)

    def test_split_cfg(self) -> None:
        """A trailing dict is the cfg; other arguments stay."""
        self.assertEqual(split_cfg((1, 2, {"repeat": 1})), ((1, 2), {"repeat": 1}))
        self.assertEqual(split_cfg((1, 2)), ((1, 2), None))
        self.assertEqual(split_cfg(()), ((), None))

    def test_not_callable(self) -> None:
        """A non-callable C{fn} is C{runtime} with the reference's message."""
        with self.assertRaises(ExecutionError) as e:
            gpu_builtins.benchmark(42, {"repeat": 1})
        self.assertEqual(e.exception.kind, "runtime")
        self.assertEqual(e.exception.message, "benchmark expects a compiled module handle")


class LatencyStatsTests(SynchronousTestCase):
    """Statistics of the per-call spans."""

    def test_values(self) -> None:
        """Median, mean, min, max and the stability flag."""
        stats = latency_stats([1.0, 2.0, 3.0, 4.0])
        self.assertEqual(stats["latency_ms_median"], 2.5)
        self.assertEqual(stats["latency_ms_mean"], 2.5)
        self.assertEqual(stats["latency_ms_min"], 1.0)
        self.assertEqual(stats["latency_ms_max"], 4.0)
        self.assertFalse(stats["stable"])

    def test_stable(self) -> None:
        """A CV under 5% is stable; a single sample has CV 0."""
        self.assertTrue(latency_stats([1.0, 1.01, 0.99, 1.0])["stable"])
        self.assertEqual(latency_stats([2.0])["cv"], 0.0)


class CloseTests(SynchronousTestCase):
    """The closeness test of C{check_close}."""

    def test_pass_and_errors(self) -> None:
        """Within tolerance passes; the errors are the maxima."""
        actual = np.array([1.0, 2.0, 0.0])
        expected = np.array([1.005, 2.0, 0.0005])
        result = compare_arrays(actual, expected, 1e-2, 1e-3)
        self.assertTrue(result["passed"])
        self.assertAlmostEqual(result["max_abs_err"], 0.005)
        self.assertAlmostEqual(result["max_rel_err"], 1.0)
        self.assertEqual((result["rtol"], result["atol"]), (1e-2, 1e-3))

    def test_fail(self) -> None:
        """Outside tolerance fails and counts mismatches."""
        result = compare_arrays(np.array([1.0, 2.0]), np.array([1.0, 2.5]), 1e-2, 1e-3)
        self.assertFalse(result["passed"])
        self.assertEqual(result["mismatched"], 1)
        self.assertAlmostEqual(result["max_abs_err"], 0.5)

    def test_non_finite(self) -> None:
        """Equal infinities match, NaN never does; errors stay finite."""
        inf, nan = float("inf"), float("nan")
        ok = compare_arrays(np.array([inf, 1.0]), np.array([inf, 1.0]), 0, 0)
        self.assertTrue(ok["passed"])
        bad = compare_arrays(np.array([nan, 1.0]), np.array([nan, 1.0]), 0, 0)
        self.assertFalse(bad["passed"])
        self.assertEqual(bad["max_abs_err"], 0.0)

    def test_shape_mismatch(self) -> None:
        """Different shapes are a C{correctness} failure."""
        with self.assertRaises(ExecutionError) as e:
            compare_arrays(np.zeros(3), np.zeros(4), 0, 0)
        self.assertEqual(e.exception.kind, "correctness")

    def test_host_inputs(self) -> None:
        """C{check_close} accepts host arrays and lists; bfloat16 is widened."""
        a = np.array([1.0, 2.0], dtype=ml_dtypes.bfloat16)
        self.assertTrue(gpu_builtins.check_close(a, [1.0, 2.0])["passed"])

    def test_assert_close_message(self) -> None:
        """A mismatch raises C{correctness} with the documented message."""
        with self.assertRaises(ExecutionError) as e:
            gpu_builtins.assert_close(np.array([1.0]), np.array([2.0]), {"atol": 0.5, "rtol": 0})
        self.assertEqual(e.exception.kind, "correctness")
        self.assertTrue(
            e.exception.message.startswith("outputs differ: max_abs_err=1 exceeds atol=0.5, rtol=0")
        )

    def test_tolerances(self) -> None:
        """Defaults are 1e-2 / 1e-3; negative values are C{parse}."""
        self.assertEqual(parse_tolerances(None), (1e-2, 1e-3))
        self.assertEqual(parse_tolerances({"rtol": 0, "atol": 1}), (0.0, 1.0))
        with self.assertRaises(ExecutionError) as e:
            parse_tolerances({"atol": -1})
        self.assertEqual(e.exception.kind, "parse")


class TensorSpecTests(SynchronousTestCase):
    """C{{shape, dtype?}} of the factories and the host random numbers."""

    def test_defaults(self) -> None:
        """dtype defaults to float16; a bare int shape is one dimension."""
        self.assertEqual(parse_tensor_spec({"shape": [2, 3]}, {}, "zeros"), ((2, 3), "float16"))
        self.assertEqual(parse_tensor_spec({"shape": 4}, {}, "zeros"), ((4,), "float16"))
        self.assertEqual(
            parse_tensor_spec({"shape": [], "dtype": "torch.int32"}, {}, "zeros"), ((), "int32")
        )

    def test_invalid(self) -> None:
        """Missing shape, negative dims, unknown dtypes are C{parse}."""
        for spec in ({}, {"shape": [-1]}, {"shape": [1.5]}, {"shape": [2], "dtype": "uint16"}):
            with self.assertRaises(ExecutionError) as e:
                parse_tensor_spec(spec, {}, "zeros")
            self.assertEqual(e.exception.kind, "parse", spec)

    def test_randn_floating_only(self) -> None:
        """randn refuses integer dtypes."""
        with self.assertRaises(ExecutionError) as e:
            parse_tensor_spec({"shape": [2], "dtype": "int32"}, {}, "randn", floating=True)
        self.assertEqual(e.exception.kind, "parse")

    def test_host_randn_reproducible(self) -> None:
        """The same seed gives the same bits, for every floating dtype."""
        for dtype in sorted(tensors.FLOATING_DTYPES):
            a = gpu_builtins.host_randn((4, 5), dtype, 7)
            b = gpu_builtins.host_randn((4, 5), dtype, 7)
            self.assertEqual(a.tobytes(), b.tobytes())
            self.assertEqual(a.dtype, numpy_dtype(dtype))
        c = gpu_builtins.host_randn((4, 5), "float32", 8)
        self.assertNotEqual(c.tobytes(), gpu_builtins.host_randn((4, 5), "float32", 7).tobytes())


class DtypeTests(SynchronousTestCase):
    """The twelve dtypes on the host."""

    def test_numpy_dtypes(self) -> None:
        """Every protocol name maps to a numpy dtype of its item size and back."""
        from kcoral.wire.program import DTYPES

        for name, size in DTYPES.items():
            dtype = numpy_dtype(name)
            self.assertEqual(dtype.itemsize, size)
            self.assertEqual(tensors.dtype_name(dtype), name)

    def test_unknown(self) -> None:
        """Other dtypes are C{serialization} errors."""
        with self.assertRaises(ExecutionError) as e:
            tensors.dtype_name(np.dtype(np.complex64))
        self.assertEqual(e.exception.kind, "serialization")
        self.assertEqual(e.exception.message, "cannot return tensor dtype complex64")

    def test_numpy_parts_big_endian(self) -> None:
        """Big-endian arrays are returned little-endian and C-contiguous."""
        a = np.arange(6, dtype=">i4").reshape(2, 3).T
        name, shape, data = tensors.numpy_parts(a)
        self.assertEqual((name, shape), ("int32", (3, 2)))
        self.assertEqual(data, np.ascontiguousarray(a.astype("<i4")).tobytes())


class KernelHandleTests(SynchronousTestCase):
    """Argument checking and packing of L{KernelHandle}, with a fake function."""

    def _handle(self, **kwargs) -> tuple[KernelHandle, FakeFunction]:
        function = FakeFunction()
        handle = KernelHandle(
            function,
            grid=kwargs.pop("grid", [4]),
            block=kwargs.pop("block", (128, 1)),
            arg_types=kwargs.pop("arg_types", ["x:ptr", "y:ptr", "n:i32", "a:f32"]),
            name="saxpy",
            **kwargs,
        )
        return handle, function

    def test_launch(self) -> None:
        """Tensors become pointers, scalars are packed with C alignment."""
        handle, function = self._handle()
        handle(FakeDeviceArray(), FakeDeviceArray(), 10, 2)
        [(grid, block, buffer, shared, stream)] = function.launches
        self.assertEqual((grid, block, shared, stream), ((4, 1, 1), (128, 1, 1), 0, None))
        self.assertEqual(buffer, struct.pack("@PPif", 0x7000, 0x7000, 10, 2.0))

    def test_alignment(self) -> None:
        """An i32 before a pointer is padded to the pointer's alignment."""
        handle, function = self._handle(arg_types=["i32", "ptr"])
        handle(1, FakeDeviceArray())
        self.assertEqual(len(function.launches[0][2]), 16)

    def test_wrong_type(self) -> None:
        """A float for an i32 names the parameter."""
        handle, function = self._handle()
        with self.assertRaises(ExecutionError) as e:
            handle(FakeDeviceArray(), FakeDeviceArray(), 1.5, 2.0)
        self.assertEqual(e.exception.kind, "runtime")
        self.assertIn("parameter 2 (n) expects i32", e.exception.message)
        self.assertEqual(function.launches, [])

    def test_host_array_for_pointer(self) -> None:
        """A host array is not a device tensor."""
        handle, _ = self._handle()
        with self.assertRaises(ExecutionError) as e:
            handle(np.zeros(4), FakeDeviceArray(), 1, 2.0)
        self.assertIn(
            "parameter 0 (x) expects a device tensor (ptr), got a host numpy array",
            e.exception.message,
        )

    def test_out_of_range_and_bool(self) -> None:
        """Values outside the type's range, and booleans, are refused."""
        handle, _ = self._handle(arg_types=["u32"])
        for value in (-1, 2**32, True):
            with self.assertRaises(ExecutionError):
                handle(value)

    def test_count(self) -> None:
        """A wrong number of arguments is C{runtime} showing the signature."""
        handle, _ = self._handle()
        with self.assertRaises(ExecutionError) as e:
            handle(1)
        self.assertEqual(e.exception.kind, "runtime")
        self.assertIn(
            "saxpy(x: ptr, y: ptr, n: i32, a: f32) takes 4 argument(s), got 1", e.exception.message
        )

    def test_geometry_at_call(self) -> None:
        """Without fixed geometry the call must give it."""
        function = FakeFunction()
        handle = KernelHandle(function, arg_types=["i32"])
        with self.assertRaises(ExecutionError):
            handle(1)
        handle(1, grid=2, block=[32])
        self.assertEqual(function.launches[0][:2], ((2, 1, 1), (32, 1, 1)))

    def test_bad_cfg(self) -> None:
        """Bad geometry and unknown types are C{parse}."""
        for kwargs in ({"grid": [0]}, {"block": [1, 2, 3, 4]}, {"arg_types": ["f16"]}):
            with self.assertRaises(ExecutionError) as e:
                self._handle(**kwargs)
            self.assertEqual(e.exception.kind, "parse")

    def test_arg_types(self) -> None:
        """Aliases, C{name:type} entries and C{arg_names}."""
        self.assertEqual(
            normalize_arg_types(["float*:ptr", "int", "n:uint64"]),
            (("float*", "ptr"), ("arg1", "i32"), ("n", "u64")),
        )
        self.assertEqual(normalize_arg_types(["ptr"], ["out"]), (("out", "ptr"),))


class SourceTests(SynchronousTestCase):
    """Reading kernel signatures and adding C linkage."""

    SOURCE = """
    #include <cuda_fp16.h>
    template <typename T> __global__ void generic(T* x) {}
    __global__ void __launch_bounds__(256) scale(const float* __restrict__ x,
            float *y, int n, /* count */ float alpha, unsigned int flags, size_t m) {}
    """

    def test_signature(self) -> None:
        """Pointers, qualifiers, comments and C scalar types."""
        self.assertEqual(
            kernel_signature(self.SOURCE, "scale"),
            (
                ("x", "ptr"),
                ("y", "ptr"),
                ("n", "i32"),
                ("alpha", "f32"),
                ("flags", "u32"),
                ("m", "u64"),
            ),
        )
        self.assertIsNone(kernel_signature(self.SOURCE, "missing"))
        self.assertIsNone(kernel_signature("__global__ void k(half h) {}", "k"))
        self.assertEqual(kernel_signature("__global__ void k() {}", "k"), ())

    def test_extern_c(self) -> None:
        """Non-template kernels get C{extern "C"}; templates do not."""
        out = add_extern_c(self.SOURCE)
        self.assertIn('extern "C" __global__ void __launch_bounds__', out)
        self.assertIn("template <typename T> __global__", out)
        already = 'extern "C" __global__ void k() {}'
        self.assertEqual(add_extern_c(already), already)

    def test_compile_cuda_bad_handle(self) -> None:
        """Something that is not a CUDA function handle is C{runtime}."""
        with self.assertRaises(ExecutionError) as e:
            gpu_builtins.compile_cuda(object(), {})
        self.assertEqual(e.exception.kind, "runtime")


class _Timeline:
    """
    A simulated GPU whose work runs when it is launched, on one clock
    (ns) shared with the trace's timestamps; work a "thread" launches late
    runs at the next L2 flush, between two iterations.
    """

    FLUSH_BYTES = 1 << 20

    def __init__(self) -> None:
        self.now = 0
        self.gpu: list[tuple[int, int, str]] = []
        self.pending: list[tuple[str, int]] = []

    def tick(self, ns: int = 1_000) -> int:
        self.now += ns
        return self.now

    def run(self, label: str, ns: int) -> None:
        start = self.tick(10_000)
        self.gpu.append((start, self.tick(ns), label))

    def memset_d32_async(self, buffer: int, value: int, words: int) -> None:
        for label, ns in self.pending:
            self.run(label, ns)
        self.pending.clear()
        self.run(f"memset:{words * 4}", 30_000)


class _SimulatedTrace:
    def __init__(self, timeline: _Timeline) -> None:
        self.timeline = timeline
        self.gpu: list[tuple[int, int, str]] = []

    def now(self) -> int:
        return self.timeline.tick()

    @contextlib.contextmanager
    def session(self, driver: Any) -> Iterator[_SimulatedTrace]:
        self.timeline.gpu = []
        yield self
        # The closing synchronize: what was launched late runs now.
        for label, ns in self.timeline.pending:
            self.timeline.run(label, ns)
        self.gpu = list(self.timeline.gpu)


class _SimulatedDriver:
    def synchronize(self) -> None:
        pass

    def event(self) -> object:
        return object()

    def destroy(self, event: object) -> None:
        pass

    def mark(self, event: object, stream: int) -> None:
        pass

    def persisting_limit(self) -> int:
        return 0

    def clear_persisting(self) -> None:
        pass


class _Backend:
    def l2_flush_buffer(self) -> tuple[int, int]:
        return 0x1000, _Timeline.FLUSH_BYTES

    def spin_function(self) -> None:
        return None


class _Measurer:
    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


class TimedLoopTests(SynchronousTestCase):
    """
    L{timing._TimedLoop} over a simulated GPU: each call's activity is what
    started in its window, the flush is in none, and what started between
    iterations is flagged unless the evaluator's options put work there.
    """

    def measure(self, kernel: Any, cfg: dict[str, Any], timeline: _Timeline | None = None) -> Any:
        timeline = timeline or _Timeline()
        pycuda = types.ModuleType("pycuda")
        driver = types.ModuleType("pycuda.driver")
        driver.memset_d32_async = timeline.memset_d32_async  # type: ignore[attr-defined]
        pycuda.driver = driver  # type: ignore[attr-defined]
        self.patch(timing, "activity_trace", lambda: _SimulatedTrace(timeline))
        config = parse_benchmark_cfg({"warmup": 2, "repeat": 4, **cfg})
        with mock.patch.dict(sys.modules, {"pycuda": pycuda, "pycuda.driver": driver}):
            loop = timing._TimedLoop(
                _Backend(),
                config,
                timing._Inputs((timeline,), config),
                driver=_SimulatedDriver(),  # type: ignore[arg-type]
            )
            return loop.measure(kernel, _Measurer())

    def test_honest(self) -> None:
        """Each span is the call's own kernel: the flush before it is left out."""
        raw = self.measure(lambda t: t.run("kernel:gemm", 300_000), {})
        self.assertEqual(raw.spans_ms, (0.3, 0.3, 0.3, 0.3))
        self.assertEqual(raw.signatures, ((("kernel:gemm", 1),),))
        self.assertEqual(raw.signature_of, (0, 0, 0, 0))
        self.assertEqual(raw.flags, ())
        self.assertEqual(raw.first_call_main, "kernel:gemm")

    def test_launched_late(self) -> None:
        """Work that starts after an iteration's synchronize flags the iteration."""

        def kernel(t: _Timeline) -> None:
            t.run("kernel:decoy", 1_000)
            t.pending.append(("kernel:gemm", 300_000))

        raw = self.measure(kernel, {})
        self.assertEqual(raw.signatures, ((("kernel:decoy", 1),),))
        late = [(i, code) for i, code, _ in raw.flags]
        self.assertEqual(late, [(i, "outlived_iteration") for i in range(4)])
        self.assertEqual(raw.flags[0][2], "kernel:gemm started after it")

    def test_options_in_between(self) -> None:
        """The input factory's own GPU work between iterations is not flagged."""

        def inputs(i: int) -> tuple[Any, ...]:
            timeline.run("kernel:fill", 50_000)
            return (timeline,)

        timeline = _Timeline()
        raw = self.measure(lambda t: t.run("kernel:gemm", 300_000), {"inputs": inputs}, timeline)
        self.assertEqual(raw.flags, ())
        self.assertEqual(raw.spans_ms, (0.3, 0.3, 0.3, 0.3))
