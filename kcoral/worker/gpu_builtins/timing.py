# -*- test-case-name: tests.unit.test_gpu_builtins_cpu,tests.gpu.test_gpu_backend -*-
"""
C{builtin.benchmark}: cfg parsing, count planning, statistics (all host-side)
and the CUDA-event timer.
"""

from __future__ import annotations

import math
import statistics
import struct
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from kcoral.errors import ExecutionError
from kcoral.worker.gpu_builtins.common import check_cfg, cuda_errors, is_number
from kcoral.worker.runtime import gpu_backend


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
    cfg = check_cfg(cfg, "benchmark")
    values: dict[str, Any] = {}
    for key in ("warmup_ms", "repeat_ms"):
        if key in cfg:
            value = cfg[key]
            if not is_number(value) or not math.isfinite(value) or value < 0:
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
    backend = gpu_backend()
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
    except (RuntimeError, *cuda_errors()) as e:  # type: ignore[misc]
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
