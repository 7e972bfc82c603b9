# -*- test-case-name: tests.unit.test_measurement -*-
"""
What a C{benchmark} measured, judged where the program cannot reach it.

A GPU worker runs uploaded modules in its own process, so nothing it
computes can be trusted: a module can patch C{statistics}, the timing code
or C{kcoral.builtins.benchmark} itself.  The worker therefore sends the
I{raw} measurement (per-iteration spans from CUPTI activity records, a
summary of the activity each iteration caused, what it saw go wrong) over
the control channel (L{kcoral.wire.channel.Measurement}); the parent parses
it here (L{parse_raw}), computes the statistics and the C{validity}
(L{evaluate}) against the wall time it measured itself, keeps the result
as its own record of the measurement and sends it back as the program's
value.  Nothing here imports Twisted or touches a GPU; a worker with no
parent (kcoral used as a library) evaluates in its own process
(L{kcoral.worker.measure.LocalMeasurer}).

C{validity} is C{{"ok": bool, "reasons": [str, ...]}}; each reason starts
with a code and a colon (C{"no_activity: ..."}).  Other checks (the
parent's GPU monitor) add reasons with their own codes through
L{Validity.add}.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

__all__ = [
    "STABLE_CV",
    "TIMER_CUPTI",
    "TIMER_EVENTS",
    "RawMeasurement",
    "Validity",
    "add_monitor_reasons",
    "evaluate",
    "latency_stats",
    "parse_raw",
]

#: The timer of a measurement from CUPTI activity records (every stream and
#: context of the worker).
TIMER_CUPTI = "cupti_activity"
#: The fallback where CUPTI is not usable: CUDA events on one stream, which
#: an uploaded module can fool (work on another stream is not timed).
TIMER_EVENTS = "cuda_events"
TIMERS = frozenset({TIMER_CUPTI, TIMER_EVENTS})

#: A coefficient of variation below this marks a measurement C{stable}.
STABLE_CV = 0.05

#: The wall-clock envelope: GPU time adding up to more than the wall time
#: the parent measured, beyond this fraction and these milliseconds of
#: slack (the channel's latency), cannot be.
WALL_SLACK_FRACTION = 0.05
WALL_SLACK_MS = 2.0

#: ... and wall time per iteration that neither the GPU spans nor the
#: calibrated per-iteration overhead explain is flagged when it is over
#: both this many milliseconds and this multiple of the median span.
UNEXPLAINED_FLOOR_MS = 0.2
UNEXPLAINED_FACTOR = 0.5
#: ... plus this fraction of the time per iteration spent on the
#: evaluator's options (a fingerprint's copy, an audit), which varies.
EXCLUDED_SLACK_FRACTION = 0.05

#: Most iterations, distinct activity summaries, labels per summary and
#: worker flags one measurement may carry (a hostile worker sends it).
MAX_ITERATIONS = 1_000_000
MAX_SIGNATURES = 256
MAX_LABELS = 256
MAX_FLAGS = 4096
MAX_TEXT = 512

#: Worker flags: the codes the worker may report per iteration.
FLAG_CODES = frozenset(
    {
        "unjoined_stream",
        "outlived_iteration",
        "persisting_l2",
        "fingerprint",
        "audit",
        "dropped_records",
    }
)

#: How a worker flag reads in the result's reasons.
_FLAG_TEXT = {
    "unjoined_stream": "GPU work was still running after the calling stream finished "
    "(work on a stream the call did not join)",
    "outlived_iteration": "GPU work outlived its iteration's device-wide synchronize "
    "(another context, or work launched late)",
    "persisting_l2": "the persisting L2 cache limit was set (reset to 0 before the next flush)",
    "fingerprint": "an output's fingerprint after the call returned differs from the "
    "discovery run's (deferred or missing writes)",
    "audit": "the audited iteration's output does not match the reference",
    "dropped_records": "CUPTI dropped activity records",
}


@attrs.define
class Validity:
    """Whether a measurement can be trusted, and every reason it cannot."""

    reasons: list[str] = attrs.field(factory=list)

    @property
    def ok(self) -> bool:
        return not self.reasons

    def add(self, code: str, text: str) -> None:
        """Flag the measurement: C{code} names the check, C{text} says what it saw."""
        self.reasons.append(f"{code}: {text}"[: MAX_TEXT * 2])

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "reasons": list(self.reasons)}


@attrs.frozen
class RawMeasurement:
    """
    One measurement as the worker sends it: nothing computed, only observed.

    @ivar spans_ms: each timed iteration's span (first GPU activity it caused
        to the last), C{None} where it caused none.
    @ivar signatures: the distinct activity summaries seen, each a tuple of
        C{(label, count)} (a kernel's name, a copy's kind and size).
    @ivar signature_of: per timed iteration, its summary's index in
        C{signatures}, -1 where it caused no activity.
    @ivar discovery: the summary of the discovery run (one call after the
        warm-up, before the timed ones), -1 if it caused none.
    @ivar flags: C{(iteration, code, detail)} the worker saw (L{FLAG_CODES}).
    @ivar overhead_ms: the calibrated wall time of one iteration around a
        call that does nothing (flush, synchronizes, timestamps).
    @ivar excluded_ms: wall time spent inside the timed loop on the
        evaluator's options that the calibration does not cover (an audit).
    """

    timer: str
    warmup: int
    repeat: int
    flush_l2: bool
    spans_ms: tuple[float | None, ...]
    signatures: tuple[tuple[tuple[str, int], ...], ...] = ()
    signature_of: tuple[int, ...] = ()
    discovery: int = -1
    flags: tuple[tuple[int, str, str], ...] = ()
    overhead_ms: float = 0.0
    excluded_ms: float = 0.0
    options: Mapping[str, Any] = attrs.field(factory=dict)
    notes: tuple[str, ...] = ()
    #: The label of the activity with the most GPU time in the benchmark's
    #: first call (before the warm-up), C{""} if it caused none.
    first_call_main: str = ""
    #: A paired comparison (C{compare}): which function each timed
    #: iteration called (0: A, 1: B), in the randomized order they ran;
    #: empty for a C{benchmark}.  C{discovery} is then A's discovery run's
    #: summary and C{discovery_b} B's.
    sides: tuple[int, ...] = ()
    discovery_b: int = -1

    def to_json(self) -> dict[str, Any]:
        """The JSON form L{parse_raw} reads back."""
        return {
            "timer": self.timer,
            "warmup": self.warmup,
            "repeat": self.repeat,
            "flush_l2": self.flush_l2,
            "spans_ms": list(self.spans_ms),
            "signatures": [[[label, count] for label, count in s] for s in self.signatures],
            "signature_of": list(self.signature_of),
            "discovery": self.discovery,
            "flags": [list(flag) for flag in self.flags],
            "overhead_ms": self.overhead_ms,
            "excluded_ms": self.excluded_ms,
            "options": dict(self.options),
            "notes": list(self.notes),
            "first_call_main": self.first_call_main,
            "sides": list(self.sides),
            "discovery_b": self.discovery_b,
        }


def _int(value: Any, name: str, low: int = 0, high: int = MAX_ITERATIONS) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name!r} must be an integer from {low} to {high}")
    return value


def _ms(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name!r} must be a number")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name!r} must be a finite, non-negative number")
    return value


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name!r} must be a string")
    return value[:MAX_TEXT]


def _list(value: Any, name: str, limit: int) -> list[Any]:
    if not isinstance(value, list) or len(value) > limit:
        raise ValueError(f"{name!r} must be a list of at most {limit} items")
    return value


#: Fields a measurement may leave out (a benchmark's has no sides).
_OPTIONAL_FIELDS = frozenset({"sides", "discovery_b"})

_OPTION_KEYS = frozenset(
    {"rotate", "fresh_inputs", "audit", "fingerprint", "cold_l2", "bytes", "flops"}
)
#: Options that are amounts of work (plausibility): positive, finite numbers.
_WORK_KEYS = frozenset({"bytes", "flops"})


def parse_raw(data: Any) -> RawMeasurement:
    """
    The L{RawMeasurement} a worker sent as JSON, checked strictly.

    @raise ValueError: a missing, extra or malformed field.
    """
    if not isinstance(data, dict):
        raise ValueError("a measurement must be an object")
    expected = set(attrs.fields_dict(RawMeasurement))
    missing, extra = expected - data.keys() - _OPTIONAL_FIELDS, data.keys() - expected
    if missing or extra:
        raise ValueError(f"measurement fields: missing {sorted(missing)}, unknown {sorted(extra)}")
    timer = data["timer"]
    if timer not in TIMERS:
        raise ValueError(f"'timer' must be one of {sorted(TIMERS)}")
    repeat = _int(data["repeat"], "repeat", 1)
    spans_raw = _list(data["spans_ms"], "spans_ms", MAX_ITERATIONS)
    if len(spans_raw) != repeat:
        raise ValueError("'spans_ms' must hold one span per timed iteration")
    spans = tuple(None if s is None else _ms(s, "spans_ms") for s in spans_raw)
    signatures = []
    for summary in _list(data["signatures"], "signatures", MAX_SIGNATURES):
        labels = []
        for pair in _list(summary, "signatures", MAX_LABELS):
            if not isinstance(pair, list) or len(pair) != 2:
                raise ValueError("a signature entry must be [label, count]")
            labels.append((_text(pair[0], "label"), _int(pair[1], "count", 1)))
        signatures.append(tuple(labels))
    count = len(signatures)
    signature_of = tuple(
        _int(i, "signature_of", -1, count - 1)
        for i in _list(data["signature_of"], "signature_of", MAX_ITERATIONS)
    )
    if signature_of and len(signature_of) != repeat:
        raise ValueError("'signature_of' must name one summary per timed iteration")
    flags = []
    for flag in _list(data["flags"], "flags", MAX_FLAGS):
        if not isinstance(flag, list) or len(flag) != 3:
            raise ValueError("a flag must be [iteration, code, detail]")
        code = flag[1]
        if code not in FLAG_CODES:
            raise ValueError(f"unknown flag code {code!r}")
        flags.append((_int(flag[0], "iteration", -1, repeat - 1), code, _text(flag[2], "detail")))
    options = data["options"]
    if not isinstance(options, dict) or not set(options) <= _OPTION_KEYS:
        raise ValueError(f"'options' must be an object with keys among {sorted(_OPTION_KEYS)}")
    for key, value in options.items():
        if key in _WORK_KEYS:
            if _ms(value, key) > 0:
                continue
        elif isinstance(value, bool) or (key == "rotate" and isinstance(value, int) and value > 0):
            continue
        raise ValueError(f"option {key!r} has a bad value")
    flush_l2 = data["flush_l2"]
    if not isinstance(flush_l2, bool):
        raise ValueError("'flush_l2' must be a boolean")
    return RawMeasurement(
        timer=timer,
        warmup=_int(data["warmup"], "warmup"),
        repeat=repeat,
        flush_l2=flush_l2,
        spans_ms=spans,
        signatures=tuple(signatures),
        signature_of=signature_of,
        discovery=_int(data["discovery"], "discovery", -1, count - 1),
        flags=tuple(flags),
        overhead_ms=_ms(data["overhead_ms"], "overhead_ms"),
        excluded_ms=_ms(data["excluded_ms"], "excluded_ms"),
        options=dict(options),
        notes=tuple(_text(n, "notes") for n in _list(data["notes"], "notes", 16)),
        first_call_main=_text(data["first_call_main"], "first_call_main"),
        sides=_sides(data.get("sides", []), repeat),
        discovery_b=_int(data.get("discovery_b", -1), "discovery_b", -1, count - 1),
    )


def _sides(value: Any, repeat: int) -> tuple[int, ...]:
    sides = tuple(_int(s, "sides", 0, 1) for s in _list(value, "sides", MAX_ITERATIONS))
    if sides and (len(sides) != repeat or 0 not in sides or 1 not in sides):
        raise ValueError("'sides' must name A (0) or B (1) for every timed iteration, both used")
    return sides


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


def describe(summary: Iterable[tuple[str, int]]) -> str:
    """A summary as text: C{"2 x kernel:gemm, 1 x memset:1024"}, shortened."""
    text = ", ".join(f"{count} x {label}" for label, count in summary) or "no activity"
    return text if len(text) <= 200 else text[:197] + "..."


def _iterations(indices: Sequence[int]) -> str:
    shown = ", ".join(str(i) for i in indices[:5])
    return shown + (f" and {len(indices) - 5} more" if len(indices) > 5 else "")


class MeasurementFailed(Exception):
    """No iteration of the measurement can be timed; the record says why."""

    def __init__(self, message: str, record: dict[str, Any]) -> None:
        super().__init__(message)
        self.message = message
        self.record = record


def evaluate(raw: RawMeasurement, wall_ms: float | None) -> dict[str, Any]:
    """
    The C{benchmark} result of C{raw}: statistics over the iterations that
    caused GPU activity, and C{validity}.

    @param wall_ms: the wall time of the timed loop as the parent measured
        it (C{None}: not known, the envelope is not checked).
    @raise MeasurementFailed: no timed iteration caused any GPU activity.
    """
    if raw.sides:
        return evaluate_pair(raw, wall_ms)
    validity = Validity()
    timed = [s for s in raw.spans_ms if s is not None]
    base: dict[str, Any] = {
        "activities_stable": False,
        "flush_l2": raw.flush_l2,
        "warmup": raw.warmup,
        "repeat": raw.repeat,
        "timing": raw.timer,
        "iterations_with_activity": len(timed) if raw.timer == TIMER_CUPTI else None,
    }
    for note in raw.notes:
        validity.add("timer", note)
    if raw.timer == TIMER_EVENTS:
        validity.add(
            "timer",
            "timed with CUDA events on one stream (CUPTI activity records are not "
            "available here): work on other streams and faked timers go unseen",
        )
    else:
        _check_activity(raw, validity)
    _check_flags(raw, validity)
    if not timed:
        validity.add("no_activity", "no timed iteration caused any GPU activity")
        record = {**base, "validity": validity.as_dict()}
        raise MeasurementFailed(
            "benchmark: no timed iteration caused any GPU activity "
            "(replayed, skipped or deferred work?)",
            record,
        )
    result = latency_stats(timed)
    if wall_ms is not None:
        _check_envelope(raw, timed, result["latency_ms_median"], wall_ms, validity)
    result.update(base)
    result["activities_stable"] = raw.timer == TIMER_CUPTI and not any(
        r.startswith(("no_activity", "activity_mismatch")) for r in validity.reasons
    )
    if raw.options:
        result["options"] = dict(raw.options)
    result["validity"] = validity.as_dict()
    return result


def _check_activity(raw: RawMeasurement, validity: Validity) -> None:
    """Every iteration caused GPU activity, and the same activity as the discovery run."""
    silent = [i for i, s in enumerate(raw.spans_ms) if s is None]
    if silent and len(silent) < raw.repeat:
        validity.add(
            "no_activity",
            f"{len(silent)} of {raw.repeat} timed iterations caused no GPU activity "
            f"(iterations {_iterations(silent)}): replayed, skipped or batched work",
        )
    if raw.discovery < 0:
        validity.add("no_activity", "the discovery run caused no GPU activity")
        return
    expected = raw.signatures[raw.discovery]
    if raw.first_call_main and raw.first_call_main not in {label for label, _ in expected}:
        validity.add(
            "activity_mismatch",
            f"the benchmark's first call spent most of its GPU time in "
            f"{raw.first_call_main}, which the warmed-up calls no longer run "
            f"(they ran [{describe(expected)}]): work served from a cache?",
        )
    differing = [i for i, sig in enumerate(raw.signature_of) if sig >= 0 and sig != raw.discovery]
    if differing:
        first = raw.signatures[raw.signature_of[differing[0]]]
        validity.add(
            "activity_mismatch",
            f"{len(differing)} timed iterations caused other GPU activity than the "
            f"discovery run (iterations {_iterations(differing)}): expected "
            f"[{describe(expected)}], iteration {differing[0]} caused [{describe(first)}]",
        )


def _check_flags(raw: RawMeasurement, validity: Validity) -> None:
    by_code: dict[str, list[tuple[int, str]]] = {}
    for iteration, code, detail in raw.flags:
        by_code.setdefault(code, []).append((iteration, detail))
    for code in sorted(by_code):
        seen = by_code[code]
        iterations = sorted({i for i, _ in seen if i >= 0})
        where = (
            f" in {len(iterations)} iterations ({_iterations(iterations)})" if iterations else ""
        )
        detail = next((d for _, d in seen if d), "")
        validity.add(code, _FLAG_TEXT[code] + where + (f": {detail}" if detail else ""))


def _check_envelope(
    raw: RawMeasurement,
    timed: list[float],
    median_ms: float,
    wall_ms: float,
    validity: Validity,
) -> None:
    """
    The parent's wall clock against the reported GPU time: it must contain
    it, and what it does not explain per iteration (the calibrated overhead
    taken off) must be small.
    """
    total = math.fsum(timed)
    if total > wall_ms * (1 + WALL_SLACK_FRACTION) + WALL_SLACK_MS:
        validity.add(
            "envelope",
            f"the reported GPU time ({total:.3f} ms in all) cannot fit in the "
            f"{wall_ms:.3f} ms the timed loop took by the server's clock",
        )
        return
    unexplained = (wall_ms - total - raw.excluded_ms) / raw.repeat - raw.overhead_ms
    allowed = max(UNEXPLAINED_FLOOR_MS, UNEXPLAINED_FACTOR * median_ms)
    allowed += EXCLUDED_SLACK_FRACTION * raw.excluded_ms / raw.repeat
    if unexplained > allowed:
        validity.add(
            "envelope",
            f"the reported GPU time explains too little of the wall time: "
            f"{unexplained:.3f} ms per iteration unaccounted for beyond the "
            f"calibrated {raw.overhead_ms:.3f} ms overhead, over the "
            f"{allowed:.3f} ms allowed (timer patched, or most of each call's "
            "time spent off the GPU)",
        )


#: Bootstrap resamples behind C{compare}'s confidence interval.
BOOTSTRAP_RESAMPLES = 4000
#: The interval's confidence.
CONFIDENCE = 0.95


def _side(raw: RawMeasurement, side: int) -> RawMeasurement:
    """One function's iterations of a paired measurement, as a benchmark's."""
    chosen = [i for i, s in enumerate(raw.sides) if s == side]
    renumber = {i: k for k, i in enumerate(chosen)}
    flags = tuple(
        (renumber[i], code, detail) if i >= 0 else (i, code, detail)
        for i, code, detail in raw.flags
        if i in renumber or (i < 0 and side == 0)
    )
    return attrs.evolve(
        raw,
        repeat=len(chosen),
        spans_ms=tuple(raw.spans_ms[i] for i in chosen),
        signature_of=tuple(raw.signature_of[i] for i in chosen) if raw.signature_of else (),
        discovery=raw.discovery if side == 0 else raw.discovery_b,
        flags=flags,
        # The first call's check is A's (the one whose first call was traced).
        first_call_main=raw.first_call_main if side == 0 else "",
        sides=(),
        discovery_b=-1,
    )


def ratio_interval(
    a_ms: Sequence[float],
    b_ms: Sequence[float],
    resamples: int = BOOTSTRAP_RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = 34,
) -> tuple[float, float]:
    """
    The percentile bootstrap interval of C{median(b) / median(a)}: both
    samples resampled with replacement, independently, C{resamples} times
    (a fixed seed: the same spans give the same interval).
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    a = np.asarray(a_ms, dtype=float)
    b = np.asarray(b_ms, dtype=float)
    a_medians = np.median(rng.choice(a, size=(resamples, a.size)), axis=1)
    b_medians = np.median(rng.choice(b, size=(resamples, b.size)), axis=1)
    ratios = b_medians / np.maximum(a_medians, 1e-12)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return float(low), float(high)


def verdict_of(low: float, high: float) -> str:
    """B against A from the ratio's interval: C{faster}, C{slower} or C{indistinguishable}."""
    if high < 1.0:
        return "faster"
    if low > 1.0:
        return "slower"
    return "indistinguishable"


def evaluate_pair(raw: RawMeasurement, wall_ms: float | None) -> dict[str, Any]:
    """
    The C{compare} result of a paired measurement: each function's
    statistics and checks (as a benchmark's), the ratio of B's median to
    A's, its 95 % bootstrap interval and the verdict; the wall-clock
    envelope over the whole interleaved loop.

    @raise MeasurementFailed: a function's timed iterations caused no GPU activity.
    """
    validity = Validity()
    sides: dict[str, dict[str, Any]] = {}
    spans: dict[str, list[float]] = {}
    for name, side in (("a", 0), ("b", 1)):
        part = _side(raw, side)
        try:
            result = evaluate(part, None)
        except MeasurementFailed as e:
            record = {"timing": raw.timer, name: e.record, "validity": e.record["validity"]}
            raise MeasurementFailed(
                f"compare: function {name.upper()}: {e.message}", record
            ) from None
        for reason in result.pop("validity")["reasons"]:
            code, _, text = reason.partition(": ")
            validity.add(code, f"function {name.upper()}: {text}")
        for key in ("flush_l2", "timing", "warmup"):
            result.pop(key, None)
        sides[name] = result
        spans[name] = [s for s in part.spans_ms if s is not None]
    if wall_ms is not None:
        timed = spans["a"] + spans["b"]
        _check_envelope(raw, timed, statistics.median(timed), wall_ms, validity)
    low, high = ratio_interval(spans["a"], spans["b"])
    ratio = sides["b"]["latency_ms_median"] / max(sides["a"]["latency_ms_median"], 1e-12)
    return {
        "a": sides["a"],
        "b": sides["b"],
        "ratio": ratio,
        "ratio_ci95": [low, high],
        "verdict": verdict_of(low, high),
        "order": "randomized",
        "warmup": raw.warmup,
        "repeat": raw.repeat // 2,
        "flush_l2": raw.flush_l2,
        "timing": raw.timer,
        "validity": validity.as_dict(),
    }


@attrs.frozen
class DevicePeak:
    """
    A GPU's vendor peaks: memory bandwidth (bytes/s) and dense FLOP/s by
    precision (no sparsity), for the plausibility check.
    """

    name: str
    bandwidth: float
    flops: Mapping[str, float]
    source: str = ""


#: Vendor peaks by device name (NVML's name contains the key).  H200 SXM and
#: H100 SXM, NVIDIA's datasheets: 4.8 and 3.35 TB/s HBM3e/HBM3; FP32
#: 67 TFLOP/s; TF32, BF16 and FP8 Tensor Core 989, 1,979 and 3,958 TFLOP/s
#: *with sparsity*, halved here (dense).
PEAKS: dict[str, DevicePeak] = {
    "H200": DevicePeak(
        "NVIDIA H200",
        4.8e12,
        {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12, "fp8": 1979e12},
        "NVIDIA H200 Tensor Core GPU datasheet (SXM)",
    ),
    "H100": DevicePeak(
        "NVIDIA H100",
        3.35e12,
        {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12, "fp8": 1979e12},
        "NVIDIA H100 Tensor Core GPU datasheet (SXM)",
    ),
}

#: A time this much below the roofline bound is flagged (span rounding).
IMPOSSIBLE_SLACK = 0.02


def peak_for(name: str) -> DevicePeak | None:
    """The peaks of the device NVML calls C{name}, if the table knows it."""
    for key, peak in PEAKS.items():
        if key in name:
            return peak
    return None


def check_plausibility(
    result: dict[str, Any], options: Mapping[str, Any], peak: DevicePeak
) -> None:
    """
    With the work the evaluator declared (C{options}' C{bytes}, C{flops}),
    add C{"plausibility"} to a benchmark result: the rates achieved at the
    median, their fractions of C{peak}, and the roofline bound (the least
    time any kernel needs for that much traffic and arithmetic at the
    device's best precision); a median below the bound is flagged
    C{impossible} in C{validity}.
    """
    moved, work = options.get("bytes"), options.get("flops")
    if not moved and not work:
        return
    seconds = result["latency_ms_median"] / 1000.0
    out: dict[str, Any] = {"device": peak.name, "peak_bandwidth_bytes_per_s": peak.bandwidth}
    bound = 0.0
    if moved:
        rate = moved / seconds if seconds > 0 else math.inf
        out["bytes_per_s"] = rate
        out["fraction_of_peak_bandwidth"] = rate / peak.bandwidth
        bound = max(bound, moved / peak.bandwidth)
    if work and peak.flops:
        rate = work / seconds if seconds > 0 else math.inf
        out["flop_per_s"] = rate
        out["fraction_of_peak_flops"] = {p: rate / f for p, f in peak.flops.items()}
        bound = max(bound, work / max(peak.flops.values()))
    out["roofline_bound_ms"] = bound * 1000.0
    result["plausibility"] = out
    if seconds < bound * (1 - IMPOSSIBLE_SLACK):
        validity = Validity(list(result.get("validity", {}).get("reasons", [])))
        validity.add(
            "impossible",
            f"the median {seconds * 1000.0:.4f} ms is below the {bound * 1000.0:.4f} ms "
            f"that {peak.name} needs at its peaks for the declared work "
            f"({moved or 0:.4g} bytes, {work or 0:.4g} FLOP)",
        )
        result["validity"] = validity.as_dict()


def add_monitor_reasons(
    result: dict[str, Any], reasons: Sequence[tuple[str, str]], summary: Mapping[str, Any]
) -> None:
    """
    Add the parent's GPU monitor's reasons (C{(code, text)}: C{interference},
    C{throttled}) to a result's C{validity}, and its summary of the GPU's
    state during the timed loop as C{"gpu"}
    (L{kcoral.server.leases.monitor.judge_samples}).
    """
    validity = Validity(list(result.get("validity", {}).get("reasons", [])))
    for code, text in reasons:
        validity.add(code, text)
    result["validity"] = validity.as_dict()
    result["gpu"] = dict(summary)


def failed_record(message: str, record: dict[str, Any] | None = None) -> dict[str, Any]:
    """A record of a measurement that produced no result."""
    out = dict(record or {})
    out["error"] = message[:MAX_TEXT]
    out.setdefault("validity", {"ok": False, "reasons": [f"failed: {message[:MAX_TEXT]}"]})
    return out
