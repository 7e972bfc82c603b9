# -*- test-case-name: tests.unit.test_gpu_builtins_cpu,tests.gpu.test_gpu_backend -*-
"""
GPU builtins: timing, correctness checks, tensor factories and kernel
launch handles.

These are the callables behind C{builtin.benchmark}, C{builtin.check_close},
C{builtin.assert_close}, C{builtin.randn}, C{builtin.empty},
C{builtin.zeros}, C{builtin.compile_cuda} and C{builtin.kernel}, and the
functions uploaded Python imports from C{kcoral.builtins}.

The device work goes through the worker's current L{GpuBackend}.  Everything
that needs no device (configuration parsing, iteration counts, statistics,
the closeness test, argument checking) is a plain function here and is
tested without a GPU.
"""

from __future__ import annotations

import math
import re
import statistics
import struct
import sys
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from kcoral.compilers.source import add_extern_c
from kcoral.errors import ExecutionError
from kcoral.worker.builtins import registered
from kcoral.worker.gpu import (
    FLOATING_DTYPES,
    check_shape,
    find_nvcc,
    numpy_dtype,
    to_host,
)

# ---------------------------------------------------------------------------
# Which backend and lease the builtins use


_explicit_backend: Any = None


def use_backend(backend: Any) -> None:
    """
    Make C{backend} the one builtins use when the worker runtime names none
    (tests, or kcoral used as a library outside a worker).
    """
    global _explicit_backend
    _explicit_backend = backend


def current_backend() -> Any:
    """
    The GPU backend of this worker (L{kcoral.worker.runtime}), else the one
    given to L{use_backend}.

    @raise ExecutionError: C{unavailable} when there is none.
    """
    from kcoral.worker import runtime

    backend = runtime.current_backend()
    if backend is None or getattr(backend, "name", None) != "gpu":
        backend = _explicit_backend
    if backend is None:
        raise ExecutionError("unavailable", "this builtin needs a GPU worker")
    return backend


def current_lease() -> Any:
    """The worker's lease client, or C{None} outside a worker."""
    from kcoral.worker import runtime

    return runtime.current_lease()


def _check_cfg(cfg: Any, what: str) -> dict[str, Any]:
    if cfg is None:
        return {}
    if not isinstance(cfg, dict):
        raise ExecutionError("parse", f"{what}: cfg must be an object, got {type(cfg).__name__}")
    return cfg


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )


# ---------------------------------------------------------------------------
# benchmark


@attrs.frozen
class BenchmarkConfig:
    """A parsed C{benchmark} cfg (protocol §10.1)."""

    warmup_ms: float = 25.0
    repeat_ms: float = 100.0
    warmup: int | None = None
    repeat: int | None = None
    flush_l2: bool = True

    @property
    def needs_estimate(self) -> bool:
        """Whether a count must be derived from a timing estimate."""
        return self.warmup is None or self.repeat is None


def parse_benchmark_cfg(cfg: Any) -> BenchmarkConfig:
    """
    Validate a C{benchmark} cfg.

    @raise ExecutionError: C{parse} for a wrong type or value.
    """
    cfg = _check_cfg(cfg, "benchmark")
    values: dict[str, Any] = {}
    for key in ("warmup_ms", "repeat_ms"):
        if key in cfg:
            value = cfg[key]
            if not _is_number(value) or not math.isfinite(value) or value < 0:
                raise ExecutionError(
                    "parse", f"benchmark: {key} must be a non-negative number, got {value!r}"
                )
            values[key] = float(value)
    for key in ("warmup", "repeat"):
        if key in cfg and cfg[key] is not None:
            value = cfg[key]
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                raise ExecutionError("parse", f"benchmark: {key} must be an integer, got {value!r}")
            if value < 1:
                raise ExecutionError("parse", f"benchmark: {key} must be at least 1, got {value}")
            values[key] = int(value)
    if "flush_l2" in cfg:
        value = cfg["flush_l2"]
        if not isinstance(value, (bool, np.bool_)):
            raise ExecutionError("parse", f"benchmark: flush_l2 must be a boolean, got {value!r}")
        values["flush_l2"] = bool(value)
    return BenchmarkConfig(**values)


def split_cfg(args: Sequence[Any]) -> tuple[tuple[Any, ...], Any]:
    """C{(args, cfg)}: a trailing positional C{dict} is the cfg."""
    if args and isinstance(args[-1], dict):
        return tuple(args[:-1]), args[-1]
    return tuple(args), None


def iteration_count(budget_ms: float, estimate_ms: float) -> int:
    """
    Calls that fit C{budget_ms} when one takes C{estimate_ms}:
    C{max(1, int(budget / estimate))}, 1000 when the estimate is 0.
    """
    if estimate_ms <= 0:
        return 1000
    return max(1, int(budget_ms / estimate_ms))


def plan_counts(config: BenchmarkConfig, estimate_ms: float | None) -> tuple[int, int]:
    """C{(warmup, repeat)}: explicit counts win, budgets use the estimate."""
    if config.needs_estimate and estimate_ms is None:
        raise ValueError("an estimate is needed")
    warmup = config.warmup
    if warmup is None:
        warmup = iteration_count(config.warmup_ms, estimate_ms or 0.0)
    repeat = config.repeat
    if repeat is None:
        repeat = iteration_count(config.repeat_ms, estimate_ms or 0.0)
    return warmup, repeat


#: A coefficient of variation below this marks a measurement C{stable}.
STABLE_CV = 0.05


def latency_stats(samples_ms: Sequence[float]) -> dict[str, Any]:
    """Median, mean, min, max, standard deviation, CV and stability of samples."""
    if not samples_ms:
        raise ValueError("no samples")
    mean = statistics.fmean(samples_ms)
    stdev = statistics.pstdev(samples_ms) if len(samples_ms) > 1 else 0.0
    cv = stdev / mean if mean > 0 else 0.0
    return {
        "latency_ms_median": float(statistics.median(samples_ms)),
        "latency_ms_mean": float(mean),
        "latency_ms_min": float(min(samples_ms)),
        "latency_ms_max": float(max(samples_ms)),
        "latency_ms_stdev": float(stdev),
        "cv": float(cv),
        "stable": bool(cv < STABLE_CV),
    }


#: With C{flush_l2} off, how long the GPU is kept busy before each call.
SPIN_NS = 50_000


class EventTimer:
    """
    Times calls with pairs of CUDA events on the legacy default stream.

    Before each call, outside its timed span, the GPU is given work that
    lets the host enqueue the start event and the call's launches before
    the GPU reaches them: zeroing the L2 flush buffer when C{flush} is on,
    else a short spin kernel.  Without that, an idle GPU would run the start
    event at once and the span would include the host's launch overhead.
    Events are recorded without waiting; the host synchronizes once per
    batch of C{batch} calls to read the spans.
    """

    def __init__(self, backend: Any, flush: bool, batch: int = 512) -> None:
        import pycuda.driver as drv

        self._drv = drv
        self._flush = backend.l2_flush_buffer() if flush else None
        self._spin = None if flush else backend.spin_function()
        self._spin_args = struct.pack("@Q", SPIN_NS)
        self._batch = batch
        self._events: list[tuple[Any, Any]] = []

    def _pairs(self, count: int) -> list[tuple[Any, Any]]:
        while len(self._events) < count:
            self._events.append((self._drv.Event(), self._drv.Event()))
        return self._events[:count]

    def _before(self) -> None:
        if self._flush is not None:
            buffer, size = self._flush
            self._drv.memset_d32_async(buffer, 0, size // 4)
        elif self._spin is not None:
            self._spin._launch_kernel((1, 1, 1), (1, 1, 1), self._spin_args, 0, None)

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], count: int) -> list[float]:
        """Call C{fn(*args)} C{count} times; each call's span in ms."""
        spans: list[float] = []
        done = 0
        while done < count:
            n = min(self._batch, count - done)
            pairs = self._pairs(n)
            for start, end in pairs:
                self._before()
                start.record()
                fn(*args)
                end.record()
            pairs[-1][1].synchronize()
            spans.extend(end.time_since(start) for start, end in pairs)
            done += n
        return spans


#: How many calls the count estimate times.
ESTIMATE_CALLS = 5


def benchmark(fn: Any, *args: Any) -> dict[str, Any]:
    """
    Time C{fn(*args)} on the GPU (protocol §10.1); a trailing C{dict} in
    C{args} is the cfg.

    Each call's latency is the time between two CUDA events recorded on the
    default stream just before and just after the call; with C{flush_l2} the
    L2 flush runs before the first event.
    """
    args, cfg = split_cfg(args)
    if not callable(fn):
        raise ExecutionError("runtime", "benchmark expects a compiled module handle")
    config = parse_benchmark_cfg(cfg)
    backend = current_backend()
    timer = EventTimer(backend, config.flush_l2)
    try:
        estimate = None
        if config.needs_estimate:
            estimate = statistics.fmean(timer.run(fn, args, ESTIMATE_CALLS))
        warmup, repeat = plan_counts(config, estimate)
        timer.run(fn, args, warmup)
        spans = timer.run(fn, args, repeat)
    except ExecutionError:
        raise
    except (RuntimeError, *_cuda_errors()) as e:  # type: ignore[misc]
        raise ExecutionError("runtime", f"{type(e).__name__}: {e}") from e
    result = latency_stats(spans)
    result.update(
        {
            "activities_stable": all(math.isfinite(s) and s > 0 for s in spans),
            "flush_l2": config.flush_l2,
            "warmup": warmup,
            "repeat": repeat,
            "timing": "cuda_events",
        }
    )
    return result


def _cuda_errors() -> tuple[type[BaseException], ...]:
    drv = sys.modules.get("pycuda.driver")
    return (drv.Error,) if drv is not None else ()


# ---------------------------------------------------------------------------
# check_close / assert_close


def parse_tolerances(cfg: Any, what: str = "check_close") -> tuple[float, float]:
    """C{(rtol, atol)} from a cfg; defaults 1e-2 and 1e-3."""
    cfg = _check_cfg(cfg, what)
    out = []
    for key, default in (("rtol", 1e-2), ("atol", 1e-3)):
        value = cfg.get(key, default)
        if not _is_number(value) or not math.isfinite(value) or value < 0:
            raise ExecutionError(
                "parse", f"{what}: {key} must be a non-negative number, got {value!r}"
            )
        out.append(float(value))
    return out[0], out[1]


def _as_float64(value: Any, role: str) -> np.ndarray:
    host = to_host(value)
    if host is None:
        if isinstance(value, (list, tuple, int, float, bool)):
            host = np.asarray(value)
        else:
            raise ExecutionError(
                "runtime", f"check_close: {role} must be a tensor, got {type(value).__name__}"
            )
    try:
        return np.asarray(host).astype(np.float64)
    except (TypeError, ValueError) as e:
        raise ExecutionError(
            "runtime", f"check_close: cannot compare {role} of dtype {host.dtype}: {e}"
        ) from e


def compare_arrays(
    actual: np.ndarray, expected: np.ndarray, rtol: float, atol: float
) -> dict[str, Any]:
    """
    Elementwise C{|actual - expected| <= atol + rtol * |expected|} on host
    float64 arrays of one shape.

    Infinities must match exactly and NaN never matches.  The reported
    errors are over the elements where both are finite (so they stay
    finite); C{max_rel_err} skips elements whose expected value is zero.
    """
    if actual.shape != expected.shape:
        raise ExecutionError(
            "correctness",
            f"shapes differ: actual {list(actual.shape)} vs expected {list(expected.shape)}",
        )
    finite = np.isfinite(actual) & np.isfinite(expected)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(actual - expected)
        close = np.where(finite, diff <= atol + rtol * np.abs(expected), actual == expected)
    diff_f = diff[finite]
    exp_f = np.abs(expected[finite])
    max_abs = float(diff_f.max()) if diff_f.size else 0.0
    nonzero = exp_f > 0
    max_rel = float((diff_f[nonzero] / exp_f[nonzero]).max()) if nonzero.any() else 0.0
    mismatched = int(close.size - np.count_nonzero(close))
    return {
        "passed": mismatched == 0,
        "max_abs_err": max_abs,
        "max_rel_err": max_rel,
        "rtol": rtol,
        "atol": atol,
        "mismatched": mismatched,
        "numel": int(close.size),
    }


def check_close(actual: Any, expected: Any, cfg: Any = None) -> dict[str, Any]:
    """
    Compare two tensors (device or host) within C{rtol}/C{atol}
    (C{builtin.check_close}).
    """
    rtol, atol = parse_tolerances(cfg)
    return compare_arrays(
        _as_float64(actual, "actual"), _as_float64(expected, "expected"), rtol, atol
    )


def assert_close(actual: Any, expected: Any, cfg: Any = None) -> dict[str, Any]:
    """
    L{check_close}, failing the instruction with C{correctness} on mismatch.
    """
    result = check_close(actual, expected, cfg)
    if not result["passed"]:
        raise ExecutionError("correctness", mismatch_message(result))
    return result


def mismatch_message(result: dict[str, Any]) -> str:
    """The C{correctness} message of a failed comparison."""
    return (
        f"outputs differ: max_abs_err={result['max_abs_err']:.6g} exceeds "
        f"atol={result['atol']:g}, rtol={result['rtol']:g} "
        f"({result['mismatched']} of {result['numel']} elements mismatched)"
    )


# ---------------------------------------------------------------------------
# Tensor factories


def _tensor_spec(spec: Any, kwargs: dict[str, Any], what: str) -> dict[str, Any]:
    merged = dict(_check_cfg(spec, what))
    merged.update(kwargs)
    if "shape" not in merged:
        raise ExecutionError("parse", f"{what}: 'shape' is required")
    return merged


def parse_tensor_spec(
    spec: Any, kwargs: dict[str, Any], what: str, floating: bool = False
) -> tuple[tuple[int, ...], str]:
    """C{(shape, dtype)} of a factory's C{{shape, dtype?}} argument."""
    merged = _tensor_spec(spec, kwargs, what)
    shape = check_shape(merged["shape"])
    dtype = merged.get("dtype", "float16")
    if not isinstance(dtype, str):
        raise ExecutionError("parse", f"{what}: dtype must be a string, got {dtype!r}")
    if dtype.startswith("torch."):
        dtype = dtype[len("torch.") :]
    try:
        numpy_dtype(dtype)
    except KeyError:
        raise ExecutionError("parse", f"{what}: unsupported dtype {dtype!r}") from None
    if floating and dtype not in FLOATING_DTYPES:
        raise ExecutionError("parse", f"{what}: dtype must be floating point, got {dtype!r}")
    return shape, dtype


def host_randn(shape: tuple[int, ...], dtype: str, seed: int | None) -> np.ndarray:
    """Standard normal samples from numpy's PCG64, cast to C{dtype}."""
    rng = np.random.default_rng(seed)
    work = np.float64 if dtype == "float64" else np.float32
    return rng.standard_normal(shape, dtype=work).astype(numpy_dtype(dtype))


def randn(spec: Any = None, /, **kwargs: Any) -> Any:
    """
    A new device tensor of standard normal samples (C{builtin.randn}):
    C{{shape, dtype?: "float16", seed?}}.  The same seed gives the same bits.
    """
    shape, dtype = parse_tensor_spec(spec, kwargs, "randn", floating=True)
    seed = _tensor_spec(spec, kwargs, "randn").get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
        raise ExecutionError("parse", f"randn: seed must be an integer, got {seed!r}")
    if seed is not None and seed < 0:
        raise ExecutionError("parse", f"randn: seed must be non-negative, got {seed}")
    host = host_randn(shape, dtype, None if seed is None else int(seed))
    return current_backend().upload_tensor(host.tobytes(), dtype, shape)


def empty(spec: Any = None, /, **kwargs: Any) -> Any:
    """A new uninitialized device tensor (C{builtin.empty}): C{{shape, dtype?}}."""
    shape, dtype = parse_tensor_spec(spec, kwargs, "empty")
    backend = current_backend()
    return backend.wrap(backend.allocate(dtype, shape))


def zeros(spec: Any = None, /, **kwargs: Any) -> Any:
    """A new zero-filled device tensor (C{builtin.zeros}): C{{shape, dtype?}}."""
    import pycuda.driver as drv

    shape, dtype = parse_tensor_spec(spec, kwargs, "zeros")
    backend = current_backend()
    array = backend.allocate(dtype, shape)
    if array.nbytes:
        drv.memset_d8(array.gpudata, 0, array.nbytes)
    return backend.wrap(array)


# ---------------------------------------------------------------------------
# Launch handles

#: Argument type names and their C{struct} codes.
ARG_TYPES: dict[str, str] = {
    "ptr": "P",
    "i8": "b",
    "u8": "B",
    "i16": "h",
    "u16": "H",
    "i32": "i",
    "u32": "I",
    "i64": "q",
    "u64": "Q",
    "f32": "f",
    "f64": "d",
}

_ALIASES = {
    "pointer": "ptr",
    "tensor": "ptr",
    "int8": "i8",
    "uint8": "u8",
    "int16": "i16",
    "uint16": "u16",
    "int": "i32",
    "int32": "i32",
    "uint32": "u32",
    "int64": "i64",
    "uint64": "u64",
    "float": "f32",
    "float32": "f32",
    "double": "f64",
    "float64": "f64",
}

_INT_RANGES = {
    "i8": (-(2**7), 2**7 - 1),
    "u8": (0, 2**8 - 1),
    "i16": (-(2**15), 2**15 - 1),
    "u16": (0, 2**16 - 1),
    "i32": (-(2**31), 2**31 - 1),
    "u32": (0, 2**32 - 1),
    "i64": (-(2**63), 2**63 - 1),
    "u64": (0, 2**64 - 1),
}


def normalize_arg_types(arg_types: Any, arg_names: Any = None) -> tuple[tuple[str, str], ...]:
    """
    C{((name, type), ...)} from a list of C{"i32"} or C{"n:i32"} entries
    (names from C{arg_names}, else C{arg0}, C{arg1}, ...).

    @raise ExecutionError: C{parse} for an unknown type or a bad list.
    """
    if not isinstance(arg_types, (list, tuple)):
        raise ExecutionError("parse", f"arg_types must be a list of type names, got {arg_types!r}")
    if arg_names is not None and (
        not isinstance(arg_names, (list, tuple)) or len(arg_names) != len(arg_types)
    ):
        raise ExecutionError("parse", "arg_names must be a list as long as arg_types")
    out = []
    for i, entry in enumerate(arg_types):
        if not isinstance(entry, str):
            raise ExecutionError("parse", f"arg_types[{i}] must be a string, got {entry!r}")
        name, sep, kind = entry.rpartition(":")
        kind = kind.strip().lower()
        kind = _ALIASES.get(kind, kind)
        if kind not in ARG_TYPES:
            raise ExecutionError(
                "parse",
                f"arg_types[{i}]: unknown type {entry!r} (one of {', '.join(ARG_TYPES)})",
            )
        if not sep:
            name = str(arg_names[i]) if arg_names is not None else f"arg{i}"
        out.append((name.strip(), kind))
    return tuple(out)


def _dims(value: Any, what: str) -> tuple[int, int, int]:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = [value]
    if (
        not isinstance(value, (list, tuple))
        or not 1 <= len(value) <= 3
        or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1 for v in value)
    ):
        raise ExecutionError("parse", f"{what} must be 1 to 3 positive integers, got {value!r}")
    dims = [int(v) for v in value] + [1] * (3 - len(value))
    return dims[0], dims[1], dims[2]


def device_pointer(value: Any) -> int | None:
    """The device address of a tensor-like value, or C{None} if it is none."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return int(value.data_ptr()) if value.is_cuda else None
    gpudata = getattr(value, "gpudata", _MISSING)
    if gpudata is not _MISSING:
        return int(gpudata) if gpudata is not None else 0  # type: ignore[call-overload]
    cai = getattr(value, "__cuda_array_interface__", None)
    if isinstance(cai, dict):
        return int(cai["data"][0])
    drv = sys.modules.get("pycuda.driver")
    if drv is not None and isinstance(value, (drv.DeviceAllocation, drv.PooledDeviceAllocation)):
        return int(value)
    return None


_MISSING = object()


def _describe(value: Any) -> str:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor) and not value.is_cuda:
        return "a CPU torch.Tensor"
    if isinstance(value, np.ndarray):
        return "a host numpy array"
    return f"{type(value).__name__} {value!r}" if _is_number(value) else type(value).__name__


def convert_argument(kind: str, value: Any) -> int | float | None:
    """
    C{value} as a kernel argument of C{kind}, or C{None} when it does not
    fit (wrong type or out of range).
    """
    if kind == "ptr":
        return device_pointer(value)
    if kind in ("f32", "f64"):
        return float(value) if _is_number(value) else None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        return None
    low, high = _INT_RANGES[kind]
    return int(value) if low <= value <= high else None


class KernelHandle:
    """
    A kernel with its launch geometry and argument types fixed when made.

    Calling it with tensors (GPUArray, torch CUDA tensors, cupy arrays or any
    C{__cuda_array_interface__} exporter) and scalars launches the kernel on
    the default stream.  C{grid}, C{block} and C{shared_mem} may be given (or
    overridden) as keywords of a call.
    """

    def __init__(
        self,
        function: Any,
        grid: Any = None,
        block: Any = None,
        shared_mem: int = 0,
        arg_types: Any = (),
        arg_names: Any = None,
        name: str | None = None,
    ) -> None:
        self.function = function
        self.name = name or getattr(function, "name", None) or "kernel"
        self.grid = None if grid is None else _dims(grid, "grid")
        self.block = None if block is None else _dims(block, "block")
        self.shared_mem = _shared(shared_mem)
        self.params = normalize_arg_types(arg_types, arg_names)
        self._format = "@" + "".join(ARG_TYPES[kind] for _, kind in self.params)
        self._configured_shared = 0

    @property
    def signature(self) -> str:
        """C{"name(x: ptr, n: i32)"}."""
        inner = ", ".join(f"{n}: {k}" for n, k in self.params)
        return f"{self.name}({inner})"

    def pack(self, args: Sequence[Any]) -> bytes:
        """
        The kernel's parameter buffer for C{args}.

        @raise ExecutionError: C{runtime} naming the first parameter that
            does not fit, or for a wrong number of arguments.
        """
        if len(args) != len(self.params):
            raise ExecutionError(
                "runtime",
                f"{self.signature} takes {len(self.params)} argument(s), got {len(args)}",
            )
        values = []
        for i, ((pname, kind), value) in enumerate(zip(self.params, args, strict=True)):
            converted = convert_argument(kind, value)
            if converted is None:
                expects = "a device tensor (ptr)" if kind == "ptr" else kind
                raise ExecutionError(
                    "runtime",
                    f"{self.name}: parameter {i} ({pname}) expects {expects}, "
                    f"got {_describe(value)}",
                )
            values.append(converted)
        return struct.pack(self._format, *values)

    def __call__(
        self, *args: Any, grid: Any = None, block: Any = None, shared_mem: Any = None
    ) -> None:
        buffer = self.pack(args)
        grid3 = _dims(grid, "grid") if grid is not None else self.grid
        block3 = _dims(block, "block") if block is not None else self.block
        if grid3 is None or block3 is None:
            raise ExecutionError(
                "runtime", f"{self.name}: no launch geometry (give grid and block in cfg)"
            )
        shared = _shared(shared_mem) if shared_mem is not None else self.shared_mem
        self._launch(grid3, block3, shared, buffer)

    def _launch(
        self, grid: tuple[int, int, int], block: tuple[int, int, int], shared: int, buffer: bytes
    ) -> None:
        if shared > 48 * 1024 and shared > self._configured_shared:
            import pycuda.driver as drv

            self.function.set_attribute(
                drv.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, shared
            )
            self._configured_shared = shared
        try:
            self.function._launch_kernel(grid, block, buffer, shared, None)
        except _cuda_errors() as e:
            raise ExecutionError("runtime", f"{self.name}: launch failed: {e}") from e

    def __repr__(self) -> str:
        return f"<KernelHandle {self.signature} grid={self.grid} block={self.block}>"


def _shared(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ExecutionError("parse", f"shared_mem must be a non-negative integer, got {value!r}")
    return int(value)


def launcher(library: Any, name: Any = None, cfg: Any = None) -> KernelHandle:
    """
    C{builtin.kernel}: a L{KernelHandle} for kernel C{name} of an uploaded
    library, or for a function handle from C{get_function} (then C{name}
    may be omitted).  C{cfg = {grid, block, shared_mem?, arg_types,
    arg_names?}}.
    """
    if isinstance(name, dict) and cfg is None:
        name, cfg = None, name
    cfg = _check_cfg(cfg, "kernel")
    if "arg_types" not in cfg:
        raise ExecutionError("parse", "kernel: cfg.arg_types is required")
    if name is None:
        function = getattr(library, "function", None)
        if function is None:
            raise ExecutionError(
                "runtime", "kernel expects a library handle and a name, or a library function"
            )
        name = getattr(library, "name", None)
    else:
        if not isinstance(name, str):
            raise ExecutionError("parse", f"kernel: name must be a string, got {name!r}")
        if not hasattr(library, "get_function"):
            raise ExecutionError("runtime", "kernel expects an uploaded library handle")
        function = library.get_function(name)
        function = getattr(function, "function", function)
    return _make_handle(function, name, cfg, cfg["arg_types"], cfg.get("arg_names"))


def _make_handle(
    function: Any, name: str | None, cfg: dict[str, Any], arg_types: Any, arg_names: Any
) -> KernelHandle:
    return KernelHandle(
        function,
        grid=cfg.get("grid"),
        block=cfg.get("block"),
        shared_mem=cfg.get("shared_mem", 0),
        arg_types=arg_types,
        arg_names=arg_names,
        name=name,
    )


# ---------------------------------------------------------------------------
# compile_cuda

_C_TYPES = {
    "char": "i8",
    "signed char": "i8",
    "unsigned char": "u8",
    "int8_t": "i8",
    "uint8_t": "u8",
    "short": "i16",
    "unsigned short": "u16",
    "int16_t": "i16",
    "uint16_t": "u16",
    "int": "i32",
    "signed": "i32",
    "signed int": "i32",
    "unsigned": "u32",
    "unsigned int": "u32",
    "int32_t": "i32",
    "uint32_t": "u32",
    "long": "i64",
    "long long": "i64",
    "long int": "i64",
    "long long int": "i64",
    "unsigned long": "u64",
    "unsigned long long": "u64",
    "int64_t": "i64",
    "uint64_t": "u64",
    "size_t": "u64",
    "ptrdiff_t": "i64",
    "float": "f32",
    "double": "f64",
}

_QUALIFIERS = re.compile(r"\b(const|volatile|__restrict__|__restrict|restrict)\b")


def kernel_signature(source: str, name: str) -> tuple[tuple[str, str], ...] | None:
    """
    C{((name, type), ...)} of the parameters of C{__global__} kernel
    C{name} in C{source}, or C{None} when they cannot be read (templates,
    unknown types, macros).
    """
    pattern = re.compile(
        r"__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+"
        r"(?:__launch_bounds__\s*\([^)]*\)\s*)?" + re.escape(name) + r"\s*\(([^)]*)\)"
    )
    match = pattern.search(source)
    if match is None:
        return None
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", match.group(1), flags=re.S).strip()
    if not text or text == "void":
        return ()
    params = []
    for i, raw in enumerate(text.split(",")):
        decl = " ".join(_QUALIFIERS.sub(" ", raw).split())
        pointer = "*" in decl
        decl = decl.replace("*", " ").replace("&", " ")
        words = decl.split()
        if not words:
            return None
        pname = words[-1] if len(words) > 1 else f"arg{i}"
        ctype = " ".join(words[:-1]) if len(words) > 1 else words[0]
        if pointer:
            params.append((pname, "ptr"))
        elif ctype in _C_TYPES:
            params.append((pname, _C_TYPES[ctype]))
        else:
            return None
    return tuple(params)


def parse_compile_cfg(cfg: Any) -> list[str]:
    """The validated C{extra_cuda_cflags} of a C{compile_cuda} cfg."""
    cfg = _check_cfg(cfg, "compile_cuda")
    flags = cfg.get("extra_cuda_cflags", [])
    if not isinstance(flags, (list, tuple)) or not all(isinstance(f, str) for f in flags):
        raise ExecutionError("parse", "compile_cuda: extra_cuda_cflags must be a list of strings")
    return list(flags)


def compile_image(source: str, arch: str, flags: Sequence[str]) -> bytes:
    """
    Compile CUDA C to a cubin for C{arch} with PyCUDA's compiler front end
    (no device needed).

    @raise ExecutionError: C{compile} with nvcc's diagnostics,
        C{unavailable} without nvcc.
    """
    nvcc = find_nvcc()
    if nvcc is None:
        raise ExecutionError("unavailable", "compile_cuda needs nvcc, which is not installed")
    import pycuda.driver as drv
    from pycuda.compiler import compile as pycuda_compile

    try:
        return pycuda_compile(
            source,
            nvcc=nvcc,
            options=["-O3", *flags],
            arch=arch,
            no_extern_c=True,
            cache_dir=False,
        )
    except drv.CompileError as e:
        detail = (getattr(e, "stderr", "") or getattr(e, "stdout", "") or str(e)).strip()
        raise ExecutionError("compile", f"nvcc failed:\n{detail}") from e


def compile_cuda(source_fn: Any, cfg: Any = None, *, lease: Any = None) -> KernelHandle:
    """
    C{builtin.compile_cuda}: compile the kernel of a C{language: "cuda"}
    module handle for this device and return a L{KernelHandle}.

    C{cfg = {grid?, block?, shared_mem?, arg_types?, arg_names?,
    extra_cuda_cflags?}}; without C{arg_types} they are read from the
    kernel's C signature.  nvcc runs without the GPU lease; the lease is
    acquired again before the image is loaded.
    """
    source = getattr(source_fn, "source", None)
    name = getattr(source_fn, "name", None)
    if isinstance(source_fn, str):
        source, name = source_fn, _check_cfg(cfg, "compile_cuda").get("name")
    if not isinstance(source, str) or not isinstance(name, str):
        raise ExecutionError(
            "runtime", "compile_cuda expects the get_function handle of a CUDA module"
        )
    config = _check_cfg(cfg, "compile_cuda")
    flags = parse_compile_cfg(config)
    if "arg_types" in config:
        params = normalize_arg_types(config["arg_types"], config.get("arg_names"))
    else:
        found = kernel_signature(source, name)
        if found is None:
            raise ExecutionError(
                "parse",
                f"compile_cuda: cannot read the parameters of {name!r}; give cfg.arg_types",
            )
        params = found
    backend = current_backend()
    if lease is None:
        lease = current_lease()
    if lease is not None:
        lease.release()
    image = compile_image(add_extern_c(source), backend.arch, flags)
    if lease is not None:
        lease.acquire()
    library = backend.load_library(image)
    try:
        function = library.get_function(name)
    except ExecutionError:
        raise ExecutionError(
            "compile", f"compile_cuda: the compiled module has no kernel {name!r}"
        ) from None
    return _make_handle(function.function, name, config, [f"{n}:{k}" for n, k in params], None)


#: The GPU worker's builtins by wire name (their C{cpu_only} flags come
#: from L{kcoral.wire.program.BUILTINS}, protocol §10.2).
GPU_BUILTINS: dict[str, tuple[Callable[..., Any], bool]] = registered(
    {
        "builtin.benchmark": benchmark,
        "builtin.check_close": check_close,
        "builtin.assert_close": assert_close,
        "builtin.randn": randn,
        "builtin.empty": empty,
        "builtin.zeros": zeros,
        "builtin.compile_cuda": compile_cuda,
        "builtin.kernel": launcher,
    }
)
