# -*- test-case-name: tests.unit.test_gpu_builtins_cpu,tests.gpu.test_gpu_backend -*-
"""
C{builtin.benchmark}: cfg parsing, count planning, the timed loop over CUPTI
activity records (L{kcoral.worker.gpu_builtins.activity}), and the CUDA-event
timer it falls back to (and estimates counts with).

The loop only observes: the statistics and the C{validity} are computed by
the parent (L{kcoral.measurement}), which the uploaded code cannot reach.
"""

from __future__ import annotations

import math
import secrets
import struct
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from kcoral.errors import ExecutionError
from kcoral.measurement import (
    MAX_ITERATIONS,
    STABLE_CV,
    TIMER_CUPTI,
    TIMER_EVENTS,
    RawMeasurement,
    latency_stats,
)
from kcoral.worker.gpu_builtins.activity import (
    Driver,
    IterationActivity,
    Window,
    activity_trace,
    after_windows,
    attribute,
    calling_stream,
    started_late,
    summarize,
)
from kcoral.worker.gpu_builtins.closeness import check_close, mismatch_message, parse_tolerances
from kcoral.worker.gpu_builtins.common import check_cfg, cuda_errors, is_number
from kcoral.worker.runtime import current_measurer, gpu_backend
from kcoral.worker.tensors import is_cupy_array, is_gpuarray, is_torch_tensor

__all__ = [
    "ESTIMATE_CALLS",
    "SPIN_NS",
    "STABLE_CV",
    "BenchmarkConfig",
    "EventTimer",
    "benchmark",
    "iteration_count",
    "latency_stats",
    "parse_benchmark_cfg",
    "plan_counts",
    "split_cfg",
]


@attrs.frozen
class BenchmarkConfig:
    """A parsed C{benchmark} cfg (protocol §10.1)."""

    warmup_ms: float = 25.0
    repeat_ms: float = 100.0
    warmup: int | None = None
    repeat: int | None = None
    flush_l2: bool = True
    #: Fresh inputs: rotate this many copies of the arguments (each at its
    #: own addresses), or call C{inputs(i)} for each iteration's arguments.
    rotate: int = 1
    inputs: Callable[[int], Any] | None = None
    #: Audit: check one iteration, chosen with C{secrets}, against
    #: C{audit(*args)} (the expected value of argument C{audit_output}).
    audit: Callable[..., Any] | None = None
    audit_output: int = -1
    audit_tolerances: tuple[float, float] = (1e-2, 1e-3)
    #: Fingerprint every device tensor argument after each call returned,
    #: after filling the arguments at C{outputs} with a sentinel first.
    fingerprint: bool = False
    outputs: tuple[int, ...] = ()
    #: The work one call does, as the evaluator declares it (bytes moved,
    #: FLOPs): the parent checks the time against the device's peaks.
    work_bytes: float | None = None
    work_flops: float | None = None
    #: Measure again, up to this many times, while the parent's GPU monitor
    #: flags the result (C{interference} or C{throttled}: issue 34).
    retry_on_interference: int = 0

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
            if value > MAX_ITERATIONS:
                raise ExecutionError(
                    "parse", f"benchmark: {key} must be at most {MAX_ITERATIONS}, got {value}"
                )
            values[key] = int(value)
    if "flush_l2" in cfg:
        value = cfg["flush_l2"]
        if not isinstance(value, (bool, np.bool_)):
            raise ExecutionError("parse", f"benchmark: flush_l2 must be a boolean, got {value!r}")
        values["flush_l2"] = bool(value)
    _parse_options(cfg, values)
    if "retry_on_interference" in cfg:
        value = cfg["retry_on_interference"]
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise ExecutionError(
                "parse", f"benchmark: retry_on_interference must be an integer, got {value!r}"
            )
        if not 0 <= value <= MAX_RETRIES:
            raise ExecutionError(
                "parse",
                f"benchmark: retry_on_interference must be from 0 to {MAX_RETRIES}, got {value}",
            )
        values["retry_on_interference"] = int(value)
    return BenchmarkConfig(**values)


#: The most re-measurements C{retry_on_interference} may ask for.
MAX_RETRIES = 10

#: The C{validity} reasons that a re-measurement may cure: the parent's GPU
#: monitor saw another process on the GPU, or throttled clocks.
DISTURBED = ("interference:", "throttled:")


def disturbed(result: dict[str, Any]) -> bool:
    """Whether the parent's GPU monitor flagged C{result} (L{DISTURBED})."""
    reasons = result.get("validity", {}).get("reasons", [])
    return any(isinstance(r, str) and r.startswith(DISTURBED) for r in reasons)


def _index_list(value: Any, key: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_)) for i in value
    ):
        raise ExecutionError("parse", f"benchmark: {key} must be a list of argument indices")
    return tuple(int(i) for i in value)


def _parse_options(cfg: dict[str, Any], values: dict[str, Any]) -> None:
    """The evaluator's options: fresh inputs, audit, fingerprint."""
    if "rotate" in cfg:
        value = cfg["rotate"]
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise ExecutionError("parse", f"benchmark: rotate must be an integer, got {value!r}")
        if not 1 <= value <= 1024:
            raise ExecutionError("parse", f"benchmark: rotate must be from 1 to 1024, got {value}")
        values["rotate"] = int(value)
    if cfg.get("inputs") is not None:
        if not callable(cfg["inputs"]):
            raise ExecutionError("parse", "benchmark: inputs must be a callable (i -> args)")
        if values.get("rotate", 1) > 1:
            raise ExecutionError("parse", "benchmark: give rotate or inputs, not both")
        values["inputs"] = cfg["inputs"]
    if cfg.get("audit") is not None:
        if not callable(cfg["audit"]):
            raise ExecutionError("parse", "benchmark: audit must be a callable (*args -> expected)")
        values["audit"] = cfg["audit"]
        if "audit_output" in cfg:
            values["audit_output"] = _index_list([cfg["audit_output"]], "audit_output")[0]
        values["audit_tolerances"] = parse_tolerances(
            {k: cfg[f"audit_{k}"] for k in ("rtol", "atol") if f"audit_{k}" in cfg},
            "benchmark audit",
        )
    if "fingerprint" in cfg:
        value = cfg["fingerprint"]
        if not isinstance(value, (bool, np.bool_)):
            raise ExecutionError(
                "parse", f"benchmark: fingerprint must be a boolean, got {value!r}"
            )
        values["fingerprint"] = bool(value)
    if "outputs" in cfg:
        values["outputs"] = _index_list(cfg["outputs"], "outputs")
    for key in ("bytes", "flops"):
        if cfg.get(key) is not None:
            value = cfg[key]
            if not is_number(value) or not math.isfinite(value) or value <= 0:
                raise ExecutionError(
                    "parse", f"benchmark: {key} must be a positive number, got {value!r}"
                )
            values[f"work_{key}"] = float(value)


def split_cfg(args: Sequence[Any]) -> tuple[tuple[Any, ...], Any]:
    """C{(args, cfg)}: a trailing positional C{dict} is the cfg."""
    if args and isinstance(args[-1], dict):
        return tuple(args[:-1]), args[-1]
    return tuple(args), None


def iteration_count(budget_ms: float, estimate_ms: float) -> int:
    """
    Calls that fit C{budget_ms} when one takes C{estimate_ms}:
    C{max(1, int(budget / estimate))}, 1000 when the estimate is 0, and at
    most L{MAX_ITERATIONS} (what the parent accepts in one measurement).
    """
    if estimate_ms <= 0:
        return 1000
    return min(MAX_ITERATIONS, max(1, int(budget_ms / estimate_ms)))


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

#: How many iterations around a call that does nothing calibrate the
#: per-iteration overhead (flush, synchronizes, timestamps) the parent's
#: wall-clock envelope takes off.
CALIBRATION_CALLS = 5


#: The wall time (ms) of each phase of this process's last measurement:
#: what bench/trusted_timing.py reports as the loop's cost.
LAST_PHASES: dict[str, float] = {}


def benchmark(fn: Any, *args: Any) -> dict[str, Any]:
    """
    Time C{fn(*args)} on the GPU (protocol §10.1); a trailing C{dict} in
    C{args} is the cfg.

    Each timed call is one iteration of L{_TimedLoop}: its span runs from
    the first GPU activity it caused to the last, on any stream, from CUPTI
    activity records.  The raw spans and activity summaries go to the
    parent (L{kcoral.worker.runtime.current_measurer}), which computes the
    result and its C{validity}.
    """
    args, cfg = split_cfg(args)
    if not callable(fn):
        raise ExecutionError("runtime", "benchmark expects a compiled module handle")
    config = parse_benchmark_cfg(cfg)
    backend = gpu_backend()
    attempt = 0
    while True:
        try:
            loop = _TimedLoop(backend, config, _Inputs(args, config))
            LAST_PHASES.clear()
            raw = loop.measure(fn, current_measurer())
            LAST_PHASES.update(loop.phases)
        except ExecutionError:
            raise
        except (RuntimeError, *cuda_errors()) as e:  # type: ignore[misc]
            raise ExecutionError("runtime", f"{type(e).__name__}: {e}") from e
        result = loop.submit(raw)
        attempt += 1
        if attempt > config.retry_on_interference or not disturbed(result):
            break
    if config.retry_on_interference:
        # Every attempt is in the parent's record (the response's measurements).
        result["attempts"] = attempt
    return result


def parse_compare_cfg(cfg: Any) -> BenchmarkConfig:
    """
    Validate a C{compare} cfg: C{benchmark}'s counts, budgets and
    C{flush_l2} (the counts are per function); none of its evaluator's
    options.

    @raise ExecutionError: C{parse} for a wrong type or value, or an option.
    """
    cfg = check_cfg(cfg, "compare")
    allowed = {"warmup_ms", "repeat_ms", "warmup", "repeat", "flush_l2"}
    unknown = sorted(set(cfg) - allowed)
    if unknown:
        raise ExecutionError(
            "parse", f"compare: unknown cfg key(s) {unknown} (allowed: {sorted(allowed)})"
        )
    return parse_benchmark_cfg(cfg)


def compare(a: Any, b: Any, *args: Any) -> dict[str, Any]:
    """
    Is C{b} faster than C{a}?  Both are called with the same C{args} (a
    trailing C{dict} is the cfg), their timed iterations interleaved in a
    random order under one lease; the parent computes each one's
    statistics, the ratio of B's median to A's, its 95 % bootstrap
    interval and the verdict (L{kcoral.measurement.evaluate_pair}).
    """
    args, cfg = split_cfg(args)
    if not callable(a) or not callable(b):
        raise ExecutionError("runtime", "compare expects two compiled module handles")
    config = parse_compare_cfg(cfg)
    backend = gpu_backend()
    try:
        loop = _TimedLoop(backend, config, _Inputs(args, config))
        raw = loop.measure_pair(a, b, current_measurer())
    except ExecutionError:
        raise
    except (RuntimeError, *cuda_errors()) as e:  # type: ignore[misc]
        raise ExecutionError("runtime", f"{type(e).__name__}: {e}") from e
    return loop.submit(raw)


def _clone(value: Any) -> Any:
    """A copy of a device tensor at its own addresses; anything else as is."""
    if is_torch_tensor(value) and getattr(value, "is_cuda", False):
        return value.clone()
    if is_gpuarray(value) or is_cupy_array(value):
        return value.copy()
    return value


def _region(value: Any) -> tuple[int, int] | None:
    """C{(pointer, bytes)} of a contiguous device tensor, else C{None}."""
    if is_torch_tensor(value):
        if getattr(value, "is_cuda", False) and value.is_contiguous() and value.numel():
            return int(value.data_ptr()), int(value.numel() * value.element_size())
        return None
    if is_gpuarray(value):
        if value.flags.c_contiguous and value.size:
            return int(value.gpudata), int(value.nbytes)
        return None
    cai = getattr(value, "__cuda_array_interface__", None)
    if isinstance(cai, dict) and cai.get("strides") is None:
        size = math.prod(int(d) for d in cai["shape"]) * np.dtype(cai["typestr"]).itemsize
        if size:
            return int(cai["data"][0]), int(size)
    return None


def _fingerprint(value: Any) -> str | None:
    """A digest of a device tensor's bytes (copied to the host), else C{None}."""
    region = _region(value)
    if region is None:
        return None
    import pycuda.driver as drv

    pointer, size = region
    host = np.empty((size + 7) // 8 * 8, dtype=np.uint8)
    host[size:] = 0
    drv.memcpy_dtoh(host[:size], pointer)
    words = host.view(np.uint64)
    total = int(np.sum(words, dtype=np.uint64))
    mixed = int(np.bitwise_xor.reduce(words * np.uint64(0x9E3779B97F4A7C15)))
    return f"{size}:{total:016x}:{mixed:016x}"


class _Inputs:
    """Each iteration's arguments: the same, rotated copies, or a factory's."""

    def __init__(self, args: tuple[Any, ...], config: BenchmarkConfig) -> None:
        self._factory = config.inputs
        self._sets = [args] + [tuple(_clone(a) for a in args) for _ in range(config.rotate - 1)]
        self._outputs = config.outputs
        for index in self._outputs:
            if not -len(args) <= index < len(args) or _region(args[index]) is None:
                raise ExecutionError(
                    "parse", f"benchmark: outputs names argument {index}, not a device tensor"
                )
        self._fingerprint = config.fingerprint
        self._reference: tuple[str | None, ...] | None = None

    def get(self, i: int) -> tuple[Any, ...]:
        if self._factory is None:
            return self._sets[i % len(self._sets)]
        made = self._factory(i)
        if not isinstance(made, (tuple, list)):
            raise ExecutionError("runtime", "benchmark: inputs(i) must return a tuple of arguments")
        return tuple(made)

    def prepare(self, args: tuple[Any, ...]) -> None:
        """Fill the outputs with a sentinel (all bits set) before a call."""
        if not self._fingerprint:
            return
        import pycuda.driver as drv

        for index in self._outputs:
            region = _region(args[index])
            if region is not None:
                drv.memset_d8(region[0], 0xFF, region[1])

    def check(self, args: tuple[Any, ...], reference: bool = False) -> str | None:
        """
        Fingerprint the tensor arguments once the call returned and its
        work finished; what differs from the discovery run's, or C{None}.
        """
        if not self._fingerprint:
            return None
        watched = [args[i] for i in self._outputs] if self._outputs else list(args)
        prints = tuple(_fingerprint(a) for a in watched)
        if reference or self._reference is None:
            self._reference = prints
            return None
        changed = [
            i for i, (a, b) in enumerate(zip(prints, self._reference, strict=True)) if a != b
        ]
        if not changed:
            return None
        names = [self._outputs[i] for i in changed] if self._outputs else changed
        return f"arguments {names}"


@attrs.define(eq=False)
class _TimedLoop:
    """One benchmark's iterations, with the hygiene and checks around each."""

    backend: Any
    config: BenchmarkConfig
    inputs: _Inputs
    driver: Driver = attrs.field(factory=Driver)
    flags: list[tuple[int, str, str]] = attrs.field(factory=list)
    excluded_ms: float = 0.0
    _flush: Any = None
    #: Wall time (ms) spent on the evaluator's options (input factory,
    #: sentinel, fingerprint) since it was last taken.
    _option_ms: float = 0.0
    _event: Any = None
    _memset: Any = None
    _stream: int = 0
    #: Wall time (ms) of each phase of the last measurement (bench/).
    phases: dict[str, float] = attrs.field(factory=dict)
    _measurer: Any = None

    def __attrs_post_init__(self) -> None:
        import pycuda.driver as drv

        self._memset = drv.memset_d32_async
        if self.config.flush_l2:
            self._flush = self.backend.l2_flush_buffer()
            # Hygiene (the context's default limit is not 0 on an H200):
            # from here on, a limit found set was set by the program.
            self.driver.clear_persisting()
        self._stream = calling_stream()

    def _before(self, i: int, flagged: int) -> tuple[Any, ...]:
        """Outside the span: the iteration's arguments, sentinel, L2 hygiene."""
        started = time.perf_counter()
        args = self.inputs.get(i)
        self.inputs.prepare(args)
        self._option_ms += (time.perf_counter() - started) * 1000.0
        if self._flush is not None:
            limit = self.driver.persisting_limit()
            if limit:
                # Set by the program since the last check: back to 0, and
                # the lines it made persist back to normal.
                self.flags.append((flagged, "persisting_l2", f"{limit} bytes"))
                self.driver.clear_persisting()
            buffer, size = self._flush
            self._memset(buffer, 0, size // 4)
        return args

    def estimate(self, fn: Callable[..., Any]) -> float:
        """A quick per-call estimate (ms) for the counts: CUDA events."""
        timer = EventTimer(self.backend, self.config.flush_l2)
        spans = timer.run(fn, self.inputs.get(0), ESTIMATE_CALLS)
        return math.fsum(spans) / len(spans)

    def warm(self, fn: Callable[..., Any], count: int) -> None:
        for i in range(count):
            fn(*self._before(i, -1))
        self.driver.synchronize()

    def _iteration(self, fn: Callable[..., Any], args: tuple[Any, ...], trace: Any) -> Window:
        self.driver.synchronize()
        start = trace.now()
        fn(*args)
        self.driver.mark(self._event, self._stream)
        stream_done = trace.now()
        self.driver.synchronize()
        return Window(start, stream_done, trace.now())

    def measure(self, fn: Callable[..., Any], measurer: Any) -> RawMeasurement:
        """
        The discovery run (the benchmark's first call), the count estimate,
        the warm-up, the calibration and the timed loop, all traced.
        """
        self._measurer = measurer
        trace = activity_trace()
        options = self._options()
        if trace is None:
            warmup, repeat = self._warm(fn)
            return self._measure_events(fn, warmup, repeat, options)
        self._event = self.driver.event()
        windows = []
        mark = _PhaseClock(self.phases)
        try:
            with trace.session(self.driver):
                mark("session_open")
                # The first call this benchmark makes: its main work must
                # be in every later call (a replay that serves later calls
                # from a cache does other work).
                first = self._iteration(fn, self._before(0, -1), trace)
                mark("first_call")
                warmup, repeat = self._warm(fn)
                mark("estimate_and_warmup")
                # The discovery run, warmed up: what every timed call must
                # repeat exactly.
                args = self._before(0, -1)
                discovery = self._iteration(fn, args, trace)
                self.inputs.check(args, reference=True)
                audit_at = secrets.randbelow(repeat) if self.config.audit is not None else -1
                overheads = []
                empty = self._empty_call()
                for _ in range(CALIBRATION_CALLS):
                    started = time.perf_counter()
                    self._option_ms = 0.0
                    self._iteration(empty, self._before(0, -1), trace)
                    elapsed = (time.perf_counter() - started) * 1000.0
                    overheads.append(elapsed - self._option_ms)
                self._option_ms = 0.0
                mark("discovery_and_calibration")
                measurer.start()
                try:
                    for i in range(repeat):
                        args = self._before(i, i - 1)
                        windows.append(self._iteration(fn, args, trace))
                        changed = self._check(args)
                        if changed is not None:
                            self.flags.append((i, "fingerprint", changed))
                        if i == audit_at:
                            self._audit(i, args)
                finally:
                    measurer.stop()
                mark("timed_loop")
                self.excluded_ms += self._option_ms
                if self._flush is not None and self.driver.persisting_limit():
                    self.flags.append((repeat - 1, "persisting_l2", "after the last call"))
                    self.driver.clear_persisting()
        finally:
            self.driver.destroy(self._event)
        mark("session_close")
        found = attribute(trace.gpu, [first, discovery, *windows])
        between = after_windows(trace.gpu, windows)
        trace.gpu = []
        late = self._started_late(between, audit_at)
        raw = self._raw(found[1], found[2:], windows, late, warmup, repeat, overheads, options)
        mark("attribution")
        return attrs.evolve(raw, first_call_main=found[0].heaviest())

    def _started_late(self, between: list[IterationActivity], audit_at: int) -> dict[int, str]:
        """
        The iterations after whose synchronize, and before the next
        iteration, activity started: launched late (a thread, another
        context).  Between two iterations the loop itself only flushes the
        L2 (one memset); the evaluator's options that use the GPU there
        (C{inputs}, C{fingerprint}, the audited iteration) switch the check
        off where they run.
        """
        if self.config.inputs is not None or self.config.fingerprint:
            return {}
        expected: Counter[str] = Counter()
        if self._flush is not None:
            expected[f"memset:{self._flush[1] // 4 * 4}"] = 1
        return started_late(between, expected, frozenset({audit_at}))

    def _check(self, args: tuple[Any, ...]) -> str | None:
        started = time.perf_counter()
        try:
            return self.inputs.check(args)
        finally:
            self._option_ms += (time.perf_counter() - started) * 1000.0

    def _empty_call(self) -> Callable[..., Any]:
        """
        The calibration's call: one empty kernel (the host's launch and the
        GPU's round trip, no work), or nothing where it cannot load.
        """
        spin = self.backend.spin_function()
        if spin is None:
            return _nothing
        arguments = struct.pack("@Q", 0)

        def empty(*args: Any) -> None:
            spin._launch_kernel((1, 1, 1), (1, 1, 1), arguments, 0, None)

        return empty

    def _warm(self, fn: Callable[..., Any]) -> tuple[int, int]:
        """The counts (from the estimate where the cfg gives budgets), then the warm-up."""
        estimate = self.estimate(fn) if self.config.needs_estimate else None
        warmup, repeat = plan_counts(self.config, estimate)
        self.warm(fn, warmup)
        return warmup, repeat

    def _raw(
        self,
        discovery: IterationActivity,
        activity: list[IterationActivity],
        windows: list[Window],
        started_late: dict[int, str],
        warmup: int,
        repeat: int,
        overheads: list[float],
        options: dict[str, Any],
        discovery_b: IterationActivity | None = None,
        sides: tuple[int, ...] = (),
    ) -> RawMeasurement:
        table: dict[tuple[tuple[str, int], ...], int] = {}

        def index(found: IterationActivity) -> int:
            if not found.records:
                return -1
            return table.setdefault(summarize(found), len(table))

        first = index(discovery)
        second = -1 if discovery_b is None else index(discovery_b)
        signature_of = []
        for i, (found, window) in enumerate(zip(activity, windows, strict=True)):
            signature_of.append(index(found))
            if found.late(window.end):
                self.flags.append((i, "outlived_iteration", ""))
            elif i in started_late:
                self.flags.append((i, "outlived_iteration", started_late[i]))
            elif found.late(window.stream_done):
                self.flags.append((i, "unjoined_stream", ""))
        return RawMeasurement(
            timer=TIMER_CUPTI,
            warmup=warmup,
            repeat=repeat,
            flush_l2=self.config.flush_l2,
            spans_ms=tuple(found.span_ms for found in activity),
            signatures=tuple(table),
            signature_of=tuple(signature_of),
            discovery=first,
            flags=tuple(self.flags),
            overhead_ms=sorted(overheads)[len(overheads) // 2],
            excluded_ms=self.excluded_ms,
            options=options,
            sides=sides,
            discovery_b=second,
        )

    def measure_pair(
        self, a: Callable[..., Any], b: Callable[..., Any], measurer: Any
    ) -> RawMeasurement:
        """
        C{compare}'s measurement: both functions' first calls, warm-ups and
        discovery runs, the calibration, then C{repeat} timed iterations of
        each in one loop, in an order shuffled with C{secrets}, all under
        one lease and one CUPTI session.
        """
        self._measurer = measurer
        trace = activity_trace()
        if trace is None:
            raise ExecutionError(
                "unavailable", "compare: needs CUPTI activity records (cupti-python), not found"
            )
        self._event = self.driver.event()
        windows = []
        try:
            with trace.session(self.driver):
                first = self._iteration(a, self._before(0, -1), trace)
                first_b = self._iteration(b, self._before(0, -1), trace)
                warmup, repeat = self._warm(a)
                self.warm(b, warmup)
                discovery_a = self._iteration(a, self._before(0, -1), trace)
                discovery_b = self._iteration(b, self._before(0, -1), trace)
                overheads = []
                empty = self._empty_call()
                for _ in range(CALIBRATION_CALLS):
                    started = time.perf_counter()
                    self._option_ms = 0.0
                    self._iteration(empty, self._before(0, -1), trace)
                    elapsed = (time.perf_counter() - started) * 1000.0
                    overheads.append(elapsed - self._option_ms)
                self._option_ms = 0.0
                order = [0] * repeat + [1] * repeat
                secrets.SystemRandom().shuffle(order)
                functions = (a, b)
                measurer.start()
                try:
                    for i, side in enumerate(order):
                        windows.append(
                            self._iteration(functions[side], self._before(i, i - 1), trace)
                        )
                finally:
                    measurer.stop()
                self.excluded_ms += self._option_ms
                if self._flush is not None and self.driver.persisting_limit():
                    self.flags.append((len(order) - 1, "persisting_l2", "after the last call"))
                    self.driver.clear_persisting()
        finally:
            self.driver.destroy(self._event)
        found = attribute(trace.gpu, [first, first_b, discovery_a, discovery_b, *windows])
        between = after_windows(trace.gpu, windows)
        trace.gpu = []
        late = self._started_late(between, -1)
        raw = self._raw(
            found[2],
            found[4:],
            windows,
            late,
            warmup,
            2 * repeat,
            overheads,
            {},
            discovery_b=found[3],
            sides=tuple(order),
        )
        return attrs.evolve(raw, first_call_main=found[0].heaviest())

    def _measure_events(
        self, fn: Callable[..., Any], warmup: int, repeat: int, options: dict[str, Any]
    ) -> RawMeasurement:
        """Without CUPTI: CUDA events on the legacy default stream."""
        timer = EventTimer(self.backend, self.config.flush_l2)
        self._measurer.start()
        spans = timer.run(fn, self.inputs.get(0), repeat)
        self._measurer.stop()
        return RawMeasurement(
            timer=TIMER_EVENTS,
            warmup=warmup,
            repeat=repeat,
            flush_l2=self.config.flush_l2,
            spans_ms=tuple(float(s) if math.isfinite(s) and s >= 0 else None for s in spans),
            flags=tuple(self.flags),
            options=options,
        )

    def _audit(self, i: int, args: tuple[Any, ...]) -> None:
        """Check iteration C{i}'s output against the reference (outside its span)."""
        audit = self.config.audit
        assert audit is not None
        started = time.perf_counter()
        try:
            expected = audit(*args)
            actual = args[self.config.audit_output]
            rtol, atol = self.config.audit_tolerances
            result = check_close(actual, expected, {"rtol": rtol, "atol": atol})
            if not result["passed"]:
                self.flags.append((i, "audit", mismatch_message(result)))
        except ExecutionError as e:
            self.flags.append((i, "audit", f"the check failed: {e.message}"))
        finally:
            self.driver.synchronize()
            self.excluded_ms += (time.perf_counter() - started) * 1000.0

    def _options(self) -> dict[str, Any]:
        options: dict[str, Any] = {}
        if self.config.rotate > 1:
            options["rotate"] = self.config.rotate
        if self.config.inputs is not None:
            options["fresh_inputs"] = True
        if self.config.audit is not None:
            options["audit"] = True
        if self.config.fingerprint:
            options["fingerprint"] = True
        if self.config.work_bytes is not None:
            options["bytes"] = self.config.work_bytes
        if self.config.work_flops is not None:
            options["flops"] = self.config.work_flops
        return options

    def submit(self, raw: RawMeasurement) -> dict[str, Any]:
        return dict(self._measurer.submit(raw))


class _PhaseClock:
    """Records the wall time (ms) since the last mark under each name."""

    def __init__(self, phases: dict[str, float]) -> None:
        phases.clear()
        self._phases = phases
        self._last = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self._phases[name] = (now - self._last) * 1000.0
        self._last = now


def _nothing(*args: Any) -> None:
    """The calibration's call: no work at all."""
