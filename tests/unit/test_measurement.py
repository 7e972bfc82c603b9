"""
Tests for L{kcoral.measurement} (the statistics, validity and wall-clock
envelope the parent computes from a worker's raw measurement), the worker's
L{kcoral.worker.measure} side, the parent's handling of the measurement
messages (L{kcoral.server.workers.runningjob}) and the record in the response
(L{kcoral.wire.render}).  No GPU: the raw measurements are written here.
"""

from __future__ import annotations

import enum
import io
import json
from collections import Counter
from types import SimpleNamespace
from typing import Any

import attrs
from twisted.internet.defer import Deferred
from twisted.trial.unittest import SynchronousTestCase

from kcoral.errors import ExecutionError
from kcoral.ipc.channel_io import read_message
from kcoral.measurement import (
    TIMER_CUPTI,
    TIMER_EVENTS,
    DevicePeak,
    MeasurementFailed,
    RawMeasurement,
    check_plausibility,
    evaluate,
    parse_raw,
    peak_for,
    ratio_interval,
    verdict_of,
)
from kcoral.server.workers.job import JobResult
from kcoral.wire.channel import (
    Instruction,
    LeaseAcquire,
    LeaseRelease,
    Measurement,
    MeasurementResult,
    MeasureStart,
    MeasureStop,
    Outcome,
    encode,
)
from kcoral.wire.render import Placement, render_result
from kcoral.worker.gpu_builtins.activity import (
    LATE_TOLERANCE_NS,
    WINDOW_SLACK_NS,
    ActivityTrace,
    IterationActivity,
    Window,
    after_windows,
    attribute,
    started_late,
    summarize,
)
from kcoral.worker.measure import ChannelMeasurer, LocalMeasurer
from tests.unit.test_workerproc import WorkerTestCase

GEMM = (("kernel:gemm", 1),)
DECOY = (("kernel:hash", 1),)


def raw(**kw: Any) -> RawMeasurement:
    """An honest measurement of ten 2 ms iterations, changed by C{kw}."""
    repeat = kw.pop("repeat", 10)
    fields: dict[str, Any] = {
        "timer": TIMER_CUPTI,
        "warmup": 3,
        "repeat": repeat,
        "flush_l2": True,
        "spans_ms": (2.0,) * repeat,
        "signatures": (GEMM,),
        "signature_of": (0,) * repeat,
        "discovery": 0,
        "overhead_ms": 0.05,
    }
    fields.update(kw)
    return RawMeasurement(**fields)


class EvaluateTests(SynchronousTestCase):
    """The parent's statistics and validity."""

    def test_honest(self) -> None:
        """Iterations like the discovery run, a wall time that fits: valid."""
        result = evaluate(raw(spans_ms=(2.0, 2.2, 1.8, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0)), 21.0)
        self.assertEqual(result["validity"], {"ok": True, "reasons": []})
        self.assertAlmostEqual(result["latency_ms_median"], 2.0)
        self.assertAlmostEqual(result["latency_ms_mean"], 2.0)
        self.assertEqual(result["latency_ms_min"], 1.8)
        self.assertEqual(result["latency_ms_max"], 2.2)
        self.assertEqual(result["timing"], "cupti_activity")
        self.assertEqual(result["iterations_with_activity"], 10)
        self.assertTrue(result["activities_stable"])
        self.assertEqual((result["warmup"], result["repeat"], result["flush_l2"]), (3, 10, True))
        self.assertAlmostEqual(result["cv"], 0.0447213595)
        self.assertTrue(result["stable"])

    def test_skipped_iterations(self) -> None:
        """Work done on one call in ten (batch-and-skip, replay): flagged."""
        spans = tuple(2.0 if i % 10 == 0 else None for i in range(20))
        signature_of = tuple(0 if i % 10 == 0 else -1 for i in range(20))
        result = evaluate(raw(repeat=20, spans_ms=spans, signature_of=signature_of), None)
        self.assertFalse(result["validity"]["ok"])
        self.assertEqual(result["iterations_with_activity"], 2)
        self.assertFalse(result["activities_stable"])
        reason = result["validity"]["reasons"][0]
        self.assertTrue(reason.startswith("no_activity: 18 of 20"), reason)
        self.assertIn("iterations 1, 2, 3, 4, 5 and 13 more", reason)

    def test_decoy_activity(self) -> None:
        """A hash kernel instead of the discovery run's GEMM: flagged."""
        signature_of = (0,) + (1,) * 9
        result = evaluate(raw(signatures=(GEMM, DECOY), signature_of=signature_of), None)
        (reason,) = result["validity"]["reasons"]
        self.assertTrue(reason.startswith("activity_mismatch: 9 timed iterations"), reason)
        self.assertIn("expected [1 x kernel:gemm], iteration 1 caused [1 x kernel:hash]", reason)

    def test_first_call_main_work_missing(self) -> None:
        """The first call's GEMM is gone once warmed up (a cache replay): flagged."""
        result = evaluate(raw(signatures=(DECOY,), first_call_main="kernel:gemm"), None)
        (reason,) = result["validity"]["reasons"]
        self.assertTrue(reason.startswith("activity_mismatch: the benchmark's first call"), reason)
        self.assertIn("kernel:gemm", reason)
        # Lazy initialisation that only the first call does is not flagged.
        self.assertTrue(evaluate(raw(first_call_main="kernel:gemm"), None)["validity"]["ok"])

    def test_no_activity_at_all_fails(self) -> None:
        """Nothing to time: the measurement fails, with a record saying why."""
        with self.assertRaises(MeasurementFailed) as caught:
            evaluate(raw(spans_ms=(None,) * 10, signature_of=(-1,) * 10), 5.0)
        self.assertIn("no timed iteration caused any GPU activity", caught.exception.message)
        record = caught.exception.record
        self.assertFalse(record["validity"]["ok"])
        self.assertEqual(record["iterations_with_activity"], 0)

    def test_worker_flags(self) -> None:
        """What the worker saw (unjoined streams, persisting L2) becomes reasons."""
        flags = ((1, "unjoined_stream", ""), (2, "unjoined_stream", ""), (-1, "persisting_l2", "x"))
        result = evaluate(raw(flags=flags), None)
        reasons = result["validity"]["reasons"]
        self.assertEqual(len(reasons), 2)
        self.assertTrue(reasons[0].startswith("persisting_l2: "), reasons)
        self.assertTrue(reasons[1].startswith("unjoined_stream: "), reasons)
        self.assertIn("in 2 iterations (1, 2)", reasons[1])

    def test_envelope_cannot_contain(self) -> None:
        """More GPU time than the parent's wall clock saw: flagged."""
        result = evaluate(raw(), 10.0)
        (reason,) = result["validity"]["reasons"]
        self.assertTrue(reason.startswith("envelope: the reported GPU time (20.000 ms"), reason)

    def test_envelope_explains_too_little(self) -> None:
        """A forged 0.001 ms for 2.67 ms of wall time per iteration: flagged."""
        result = evaluate(raw(spans_ms=(0.001,) * 10), 27.0)
        (reason,) = result["validity"]["reasons"]
        self.assertIn("explains too little of the wall time", reason)

    def test_envelope_allows_launch_overhead(self) -> None:
        """A short kernel with host launch overhead is not flagged."""
        result = evaluate(raw(spans_ms=(0.005,) * 10, overhead_ms=0.05), 10 * (0.005 + 0.05 + 0.15))
        self.assertTrue(result["validity"]["ok"], result["validity"])

    def test_excluded_time(self) -> None:
        """An audit's time inside the loop is not counted against the envelope."""
        self.assertFalse(evaluate(raw(), 100.0)["validity"]["ok"])
        self.assertTrue(evaluate(raw(excluded_ms=75.0), 100.0)["validity"]["ok"])

    def test_event_timer_flagged(self) -> None:
        """The CUDA-event fallback is marked as such, and not trusted."""
        result = evaluate(raw(timer=TIMER_EVENTS, signatures=(), signature_of=()), None)
        self.assertEqual(result["timing"], "cuda_events")
        self.assertIsNone(result["iterations_with_activity"])
        self.assertFalse(result["validity"]["ok"])
        self.assertTrue(result["validity"]["reasons"][0].startswith("timer: "))


class ParseRawTests(SynchronousTestCase):
    """A hostile worker's raw measurement is checked strictly."""

    def test_round_trip(self) -> None:
        original = raw(flags=((0, "audit", "bad"),), options={"rotate": 4})
        text = json.dumps(original.to_json())
        self.assertEqual(parse_raw(json.loads(text)), original)

    def test_refusals(self) -> None:
        good = raw().to_json()
        bad = [
            {**good, "extra": 1},
            {k: v for k, v in good.items() if k != "timer"},
            {**good, "timer": "wall_clock"},
            {**good, "spans_ms": [1.0]},
            {**good, "spans_ms": [-1.0] * 10},
            {**good, "spans_ms": [float("nan")] * 10},
            {**good, "spans_ms": ["1"] * 10},
            {**good, "signature_of": [3] * 10},
            {**good, "discovery": 5},
            {**good, "flags": [[0, "made_up", ""]]},
            {**good, "flags": [[99, "audit", ""]]},
            {**good, "repeat": True},
            {**good, "options": {"rotate": 0}},
            {**good, "signatures": [[["kernel:a", 0]]]},
            [],
        ]
        for data in bad:
            with self.assertRaises(ValueError, msg=repr(data)[:200]):
                parse_raw(data)


class AttributionTests(SynchronousTestCase):
    """
    GPU records go to the iteration whose window they started in; what
    started between windows is what an iteration launched late.
    """

    def test_attribute(self) -> None:
        windows = [Window(100_000, 200_000, 300_000), Window(400_000, 500_000, 600_000)]
        gpu = [
            (60_000, 90_000, "memset:8"),  # the flush, before the first window
            (170_000, 190_000, "kernel:gemm"),
            (180_000, 260_000, "kernel:side"),  # in window 0, any stream
            (340_000, 380_000, "memset:8"),  # the flush before window 1
            (470_000, 520_000, "kernel:gemm"),
            (710_000, 720_000, "kernel:late"),  # after every window
        ]
        first, second = attribute(gpu, windows)
        self.assertEqual(summarize(first), (("kernel:gemm", 1), ("kernel:side", 1)))
        self.assertEqual(first.span_ms, (260_000 - 170_000) / 1e6)
        self.assertEqual(summarize(second), (("kernel:gemm", 1),))
        self.assertEqual(first.heaviest(), "kernel:side")
        self.assertEqual(IterationActivity(()).span_ms, None)
        self.assertEqual(IterationActivity(()).heaviest(), "")

    def test_window_edges(self) -> None:
        """
        A record that starts within the slack before a window's first
        timestamp, or at its last, is the window's; earlier or later, not.
        """
        window = Window(100_000, 150_000, 200_000)
        cases = [
            (100_000 - WINDOW_SLACK_NS, True),
            (100_000 - WINDOW_SLACK_NS - 1, False),
            (200_000, True),
            (200_001, False),
        ]
        for start, inside in cases:
            (found,) = attribute([(start, start + 10, "kernel:k")], [window])
            self.assertEqual(bool(found.records), inside, start)

    def test_after_windows(self) -> None:
        """Between a window's end and the next window's start; after the last, all."""
        windows = [Window(100_000, 200_000, 300_000), Window(400_000, 500_000, 600_000)]
        gpu = [
            (250_000, 320_000, "kernel:gemm"),  # in window 0
            (301_000, 302_000, "kernel:thread"),  # after window 0's synchronize
            (340_000, 380_000, "memset:8"),  # the flush
            (450_000, 460_000, "kernel:gemm"),
            (900_000, 910_000, "kernel:thread"),
        ]
        gap0, gap1 = after_windows(gpu, windows)
        self.assertEqual(summarize(gap0), (("kernel:thread", 1), ("memset:8", 1)))
        self.assertEqual(summarize(gap1), (("kernel:thread", 1),))
        self.assertEqual(after_windows(gpu[:1], windows)[0].records, ())

    def test_started_late(self) -> None:
        """Only what the loop does not put between iterations is flagged."""
        flush: Counter[str] = Counter({"memset:8": 1})
        between = [
            IterationActivity(((1, 2, "memset:8"),)),
            IterationActivity(()),
            IterationActivity(((1, 2, "memset:8"), (3, 4, "kernel:gemm"))),
            IterationActivity(((1, 2, "memset:8"), (3, 4, "memset:8"))),
            IterationActivity(((3, 4, "kernel:gemm"),)),
        ]
        self.assertEqual(
            started_late(between, flush),
            {
                2: "kernel:gemm started after it",
                3: "memset:8 started after it",
                4: "kernel:gemm started after it",
            },
        )
        self.assertEqual(sorted(started_late(between, flush, frozenset({2, 4}))), [3])
        self.assertEqual(sorted(started_late(between, Counter())), [0, 2, 3, 4])

    def test_late(self) -> None:
        """Activity ending past the tolerance after a mark is late."""
        activity = IterationActivity(((0, 1000, "kernel:k"),))
        self.assertFalse(activity.late(1000 - LATE_TOLERANCE_NS))
        self.assertTrue(activity.late(999 - LATE_TOLERANCE_NS))


class _Kind(enum.IntEnum):
    """The activity kinds cupti-python names (their values do not matter here)."""

    DRIVER = 1
    RUNTIME = 2
    MEMCPY = 3
    MEMSET = 4
    CONCURRENT_KERNEL = 5
    MEMCPY2 = 6


class _Cupti:
    """What L{ActivityTrace} calls of cupti-python, recording the calls."""

    ActivityKind = _Kind

    def __init__(self, records: list[Any]) -> None:
        self.records = records
        self.enabled: list[_Kind] = []
        self.calls: list[str] = []
        self._completed: Any = None

    def activity_register_callbacks(self, requested: Any, completed: Any) -> None:
        self.calls.append("register")
        self._completed = completed

    def activity_enable(self, kind: _Kind) -> None:
        self.enabled.append(kind)

    def activity_disable(self, kind: _Kind) -> None:
        self.enabled.remove(kind)

    def activity_flush_all(self, flag: int) -> None:
        self.calls.append("flush")
        self._completed(self.records)


class _Driver:
    def synchronize(self) -> None:
        pass


class ActivityTraceTests(SynchronousTestCase):
    """A session enables GPU activity kinds only and keeps only what attribution needs."""

    def test_session(self) -> None:
        records = [
            SimpleNamespace(kind=_Kind.DRIVER, start=1, end=2, correlation_id=7),
            SimpleNamespace(kind=_Kind.CONCURRENT_KERNEL, start=10, end=20, name="gemm"),
            SimpleNamespace(kind=_Kind.MEMCPY, start=30, end=40, copy_kind=2, bytes=64),
            SimpleNamespace(kind=_Kind.MEMCPY2, start=50, end=60, bytes=32),
            SimpleNamespace(kind=_Kind.MEMSET, start=70, end=80, bytes=8),
        ]
        cupti = _Cupti(records)
        trace = ActivityTrace(cupti)
        with trace.session(_Driver()):  # type: ignore[arg-type]
            self.assertEqual(
                sorted(cupti.enabled),
                sorted([_Kind.CONCURRENT_KERNEL, _Kind.MEMCPY, _Kind.MEMSET, _Kind.MEMCPY2]),
            )
        self.assertEqual(cupti.enabled, [])
        self.assertEqual(cupti.calls, ["register", "flush"])
        self.assertEqual(
            trace.gpu,
            [
                (10, 20, "kernel:gemm"),
                (30, 40, "memcpy:2:64"),
                (50, 60, "memcpy_p2p:32"),
                (70, 80, "memset:8"),
            ],
        )
        with trace.session(_Driver()):  # type: ignore[arg-type]
            pass
        self.assertEqual(cupti.calls, ["register", "flush", "flush"])
        self.assertEqual(len(trace.gpu), 4)


class WorkerSideTests(SynchronousTestCase):
    """The worker sends raw data and gets the parent's result back."""

    def test_channel_measurer(self) -> None:
        result = {"latency_ms_median": 2.0}
        inbox = io.BytesIO(encode(MeasurementResult(result=result)))
        outbox = io.BytesIO()
        measurer = ChannelMeasurer(inbox, outbox)
        measurer.start()
        measurer.stop()
        self.assertEqual(measurer.submit(raw()), result)
        outbox.seek(0)
        self.assertEqual(read_message(outbox), MeasureStart())
        self.assertEqual(read_message(outbox), MeasureStop())
        self.assertEqual(read_message(outbox), Measurement(raw().to_json()))

    def test_channel_measurer_error(self) -> None:
        inbox = io.BytesIO(encode(MeasurementResult(error="benchmark: nothing")))
        with self.assertRaises(ExecutionError) as caught:
            ChannelMeasurer(inbox, io.BytesIO()).submit(raw())
        self.assertEqual(
            (caught.exception.kind, caught.exception.message), ("runtime", "benchmark: nothing")
        )

    def test_local_measurer(self) -> None:
        measurer = LocalMeasurer()
        measurer.start()
        measurer.stop()
        self.assertTrue(measurer.submit(raw())["validity"]["ok"] is False)  # 20 ms in ~0 ms
        with self.assertRaises(ExecutionError):
            LocalMeasurer().submit(raw(spans_ms=(None,) * 10, signature_of=(-1,) * 10))


class ParentTests(WorkerTestCase):
    """The parent computes the result on its own clock and keeps a record."""

    def measure(self, worker: Any, data: RawMeasurement, wall: float) -> Any:
        self.deliver(worker, MeasureStart())
        self.reactor.advance(wall)
        self.deliver(worker, MeasureStop())
        self.deliver(worker, Measurement(data.to_json()))
        return self.transport.messages()[-1]

    def test_result_and_record(self) -> None:
        worker = self.ready_worker()
        d = worker.run(self.job())
        answer = self.measure(worker, raw(), 0.021)
        assert isinstance(answer, MeasurementResult)
        assert answer.result is not None
        self.assertEqual(answer.result["validity"], {"ok": True, "reasons": []})
        self.assertEqual(answer.result["measurement_id"], 0)
        # A forged, too-fast measurement for the same wall time is flagged.
        forged = self.measure(worker, raw(spans_ms=(0.001,) * 10), 0.027)
        self.assertFalse(forged.result["validity"]["ok"])
        failed = self.measure(worker, raw(spans_ms=(None,) * 10, signature_of=(-1,) * 10), 0.01)
        self.assertIsNone(failed.result)
        self.deliver(worker, Outcome(status="COMPLETED"))
        result: JobResult = self.successResultOf(d)
        records = result.measurements
        self.assertEqual([r["id"] for r in records], [0, 1, 2])
        self.assertAlmostEqual(records[0]["wall_ms"], 21.0)
        self.assertEqual(records[0]["latency_ms_median"], 2.0)
        self.assertIn("error", records[2])
        self.assertFalse(records[2]["validity"]["ok"])

    def test_monitor_judges_gpu_measurements(self) -> None:
        """
        With a GPU monitor on the leases, a GPU worker's result and the
        parent's record carry the monitor's reasons and summary; the
        answer waits for its verdict.
        """
        judged: list[tuple[Any, ...]] = []
        verdict: Deferred[Any] = Deferred()

        class Monitor:
            def judge(self, *args: Any) -> Deferred[Any]:
                judged.append(args)
                return verdict

            def peak_of(self, gpus: tuple[int, ...]) -> DevicePeak | None:
                return peak_for("NVIDIA H200")

        self.leases.monitor = Monitor()
        worker = self.ready_worker(gpus=(0,))
        d = worker.run(self.job())
        self.deliver(worker, LeaseAcquire())
        before = len(self.transport.messages())
        self.deliver(worker, MeasureStart())
        self.reactor.advance(0.021)
        self.deliver(worker, MeasureStop())
        # 2 ms for 4.8 GB: at the H200's 4.8 TB/s it needs 1 ms; fine.
        self.deliver(worker, Measurement(raw(options={"bytes": 4.8e9}).to_json()))
        self.assertEqual(len(self.transport.messages()), before)  # waits for the monitor
        self.assertIs(judged[0][0], worker)
        self.assertEqual(judged[0][1], (0,))
        self.assertAlmostEqual(judged[0][3] - judged[0][2], 0.021)
        verdict.callback(([("interference", "process 9 used GPU 0")], {"samples": 3}))
        answer = self.transport.messages()[-1]
        assert isinstance(answer, MeasurementResult) and answer.result is not None
        self.assertEqual(
            answer.result["validity"],
            {"ok": False, "reasons": ["interference: process 9 used GPU 0"]},
        )
        self.assertEqual(answer.result["gpu"], {"samples": 3})
        self.assertAlmostEqual(answer.result["plausibility"]["fraction_of_peak_bandwidth"], 0.5)
        self.deliver(worker, LeaseRelease())
        self.deliver(worker, Outcome(status="COMPLETED"))
        record = self.successResultOf(d).measurements[0]
        self.assertEqual(record["validity"], answer.result["validity"])
        self.assertEqual(record["gpu"], {"samples": 3})
        self.assertEqual(record["plausibility"], answer.result["plausibility"])

    def test_gpu_violation_fails_the_program(self) -> None:
        """
        The GPU monitor's kill of a process the program started fails the
        program with gpu_access at the running instruction, and kills the worker.
        """
        program = SimpleNamespace(
            instructions=(SimpleNamespace(op="upload", id="m"), SimpleNamespace(op="run", id="r"))
        )
        worker = self.ready_worker()
        d = worker.run(self.job(program=program))
        self.deliver(worker, Instruction(1))
        worker.gpu_violation("process 9 (python3) used GPU 0", "process 9 (python3)")
        result: JobResult = self.successResultOf(d)
        assert result.outcome is not None and result.outcome.error is not None
        self.assertEqual(result.outcome.status, "FAILED")
        error = result.outcome.error
        self.assertEqual(
            (error["kind"], error["message"], error["instruction_index"], error["instruction_id"]),
            ("gpu_access", "process 9 (python3) used GPU 0", 1, "r"),
        )
        self.assertEqual(error["location"], "process 9 (python3)")
        self.assertTrue(worker._killing)
        # Between programs: the worker is poisoned (killed) instead.
        other = self.ready_worker()
        other.gpu_violation("late", "")
        self.assertEqual(other.protocol.channel_error, "late")

    def test_out_of_order_is_a_violation(self) -> None:
        for messages, detail in [
            ([MeasureStop()], "stopped a measurement it did not start"),
            ([MeasureStart(), MeasureStop(), MeasureStop()], "did not start"),
            ([Measurement(raw().to_json())], "without a timed loop"),
            (
                [MeasureStart(), MeasureStop(), Measurement({"timer": "x"})],
                "malformed measurement",
            ),
        ]:
            worker = self.ready_worker()
            d = worker.run(self.job())
            for message in messages:
                self.deliver(worker, message)
            result: JobResult = self.successResultOf(d)
            self.assertEqual(result.ending, "invalid")
            self.assertIn(detail, result.detail)


class RecordInResponseTests(SynchronousTestCase):
    """The response carries the records outside the program's results."""

    def render(self, measurements: tuple[dict[str, Any], ...]) -> dict[str, Any]:
        @attrs.frozen
        class Program:
            @attrs.frozen
            class Options:
                gpu_count: None = None

            instructions: tuple[Any, ...] = ()
            options: Options = Options()

        ending = JobResult(
            "outcome",
            outcome=Outcome(status="COMPLETED", results={"r": {"type": "null", "value": None}}),
            measurements=measurements,
        )
        rendered = render_result(
            "rid",
            Program(),  # type: ignore[arg-type]
            ending,
            Placement("gpu0/w0", 0, (0,)),
            timeout_seconds=10.0,
            queue_ms=0.0,
            elapsed_ms=1.0,
            max_response_bytes=1 << 20,
        )
        body = rendered.body
        assert isinstance(body, bytes)
        return json.loads(body)

    def test_measurements_field(self) -> None:
        record = {"id": 0, "instruction_index": 2, "latency_ms_median": 2.0}
        body = self.render((record,))
        self.assertEqual(body["measurements"], [record])
        self.assertEqual(body["results"], {"r": {"type": "null", "value": None}})

    def test_absent_without_measurements(self) -> None:
        self.assertNotIn("measurements", self.render(()))


def pair(a_ms: list[float], b_ms: list[float], **kw: Any) -> RawMeasurement:
    """A compare's measurement: A's and B's spans interleaved A, B, A, B, ..."""
    spans = tuple(s for ab in zip(a_ms, b_ms, strict=True) for s in ab)
    n = len(spans)
    fields: dict[str, Any] = {
        "repeat": n,
        "spans_ms": spans,
        "signatures": (GEMM, DECOY),
        "signature_of": (0, 1) * (n // 2),
        "discovery": 0,
        "discovery_b": 1,
        "sides": (0, 1) * (n // 2),
    }
    fields.update(kw)
    return raw(**fields)


class CompareTests(SynchronousTestCase):
    """C{compare}'s statistics, computed by the parent (kcoral.measurement.evaluate_pair)."""

    def test_b_faster(self) -> None:
        """B at 95 % of A's time, little noise: ratio near 0.95, faster, valid."""
        a = [2.0 + 0.002 * (i % 5) for i in range(30)]
        b = [1.9 + 0.002 * (i % 5) for i in range(30)]
        result = evaluate(pair(a, b), sum(a) + sum(b) + 60 * 0.05)
        self.assertAlmostEqual(result["ratio"], 1.9 / 2.0, places=2)
        low, high = result["ratio_ci95"]
        self.assertLess(low, result["ratio"])
        self.assertLess(high, 1.0)
        self.assertEqual(result["verdict"], "faster")
        self.assertEqual(result["validity"], {"ok": True, "reasons": []})
        self.assertEqual((result["a"]["repeat"], result["b"]["repeat"]), (30, 30))
        self.assertAlmostEqual(result["a"]["latency_ms_median"], 2.004)
        self.assertEqual(result["repeat"], 30)

    def test_slower_and_indistinguishable(self) -> None:
        a = [2.0] * 20
        self.assertEqual(evaluate(pair(a, [2.2] * 20), None)["verdict"], "slower")
        noisy = [1.0 + (i % 7) * 0.3 for i in range(20)]
        same = evaluate(pair(noisy, list(reversed(noisy))), None)
        self.assertEqual(same["verdict"], "indistinguishable")
        low, high = same["ratio_ci95"]
        self.assertTrue(low <= 1.0 <= high)

    def test_interval_is_reproducible(self) -> None:
        a = [2.0 + 0.01 * (i % 3) for i in range(20)]
        b = [2.0 + 0.01 * (i % 4) for i in range(20)]
        self.assertEqual(ratio_interval(a, b), ratio_interval(a, b))
        self.assertEqual(verdict_of(0.9, 0.99), "faster")
        self.assertEqual(verdict_of(1.01, 1.2), "slower")
        self.assertEqual(verdict_of(0.99, 1.01), "indistinguishable")

    def test_each_side_checked_against_its_discovery(self) -> None:
        """B doing A's work in one iteration is B's activity mismatch; A's stays clean."""
        measured = pair([2.0] * 10, [1.0] * 10, signature_of=(0, 1) * 4 + (0, 0) + (0, 1) * 5)
        result = evaluate(measured, None)
        self.assertFalse(result["validity"]["ok"])
        (reason,) = result["validity"]["reasons"]
        self.assertTrue(reason.startswith("activity_mismatch: function B: 1 timed iterations"))

    def test_flags_go_to_their_side(self) -> None:
        measured = pair([2.0] * 5, [1.0] * 5, flags=((3, "unjoined_stream", ""),))
        (reason,) = evaluate(measured, None)["validity"]["reasons"]
        self.assertTrue(reason.startswith("unjoined_stream: function B:"), reason)
        self.assertIn("(1)", reason)  # B's second iteration

    def test_envelope_over_the_whole_loop(self) -> None:
        """Spans adding up to more than the loop's wall time are flagged."""
        result = evaluate(pair([2.0] * 10, [2.0] * 10), 10.0)
        self.assertTrue(result["validity"]["reasons"][0].startswith("envelope:"))

    def test_silent_side_fails(self) -> None:
        measured = pair([2.0] * 5, [1.0] * 5)
        silent = attrs.evolve(
            measured,
            spans_ms=tuple(None if i % 2 else s for i, s in enumerate(measured.spans_ms)),
            signature_of=tuple(-1 if i % 2 else s for i, s in enumerate(measured.signature_of)),
        )
        with self.assertRaises(MeasurementFailed) as caught:
            evaluate(silent, None)
        self.assertIn("compare: function B", caught.exception.message)

    def test_parse_sides(self) -> None:
        """Sides round-trip; a benchmark's JSON without them still parses; bad sides are refused."""
        measured = pair([2.0] * 3, [1.0] * 3)
        self.assertEqual(parse_raw(measured.to_json()), measured)
        data = raw().to_json()
        del data["sides"], data["discovery_b"]
        self.assertEqual(parse_raw(data), raw())
        for sides in ([0] * 6, [0, 1, 2, 0, 1, 0], [0, 1]):
            bad = measured.to_json()
            bad["sides"] = sides
            self.assertRaises(ValueError, parse_raw, bad)


class PlausibilityTests(SynchronousTestCase):
    """The declared work against the device's peaks (kcoral.measurement.check_plausibility)."""

    def result(self, median_ms: float) -> dict[str, Any]:
        return {"latency_ms_median": median_ms, "validity": {"ok": True, "reasons": []}}

    def test_table(self) -> None:
        h200 = peak_for("NVIDIA H200")
        assert h200 is not None
        self.assertEqual(h200.bandwidth, 4.8e12)
        self.assertEqual(h200.flops["bf16"], 989.5e12)
        self.assertIsNone(peak_for("NVIDIA GeForce GT 710"))

    def test_fractions(self) -> None:
        """A 1 GiB copy (read and write: 2 GiB) in 0.5 ms, and FLOPs against each precision."""
        peak = peak_for("NVIDIA H200")
        assert peak is not None
        result = self.result(1.0)
        check_plausibility(result, {"bytes": 2.4e9, "flops": 67e9}, peak)
        out = result["plausibility"]
        self.assertAlmostEqual(out["fraction_of_peak_bandwidth"], 0.5)
        self.assertAlmostEqual(out["fraction_of_peak_flops"]["fp32"], 1.0)
        self.assertAlmostEqual(out["roofline_bound_ms"], 0.5)
        self.assertTrue(result["validity"]["ok"])

    def test_impossible(self) -> None:
        """Faster than the roofline allows: flagged, naming the bound."""
        peak = peak_for("NVIDIA H200")
        assert peak is not None
        result = self.result(0.1)
        check_plausibility(result, {"bytes": 4.8e9}, peak)  # needs 1 ms
        self.assertFalse(result["validity"]["ok"])
        self.assertTrue(result["validity"]["reasons"][0].startswith("impossible: the median"))
        # FLOPs are bounded by the best precision's peak (FP8 here).
        result = self.result(1.0)
        check_plausibility(result, {"flops": 1979e9 * 1.5}, peak)
        self.assertFalse(result["validity"]["ok"])
        result = self.result(1.0)
        check_plausibility(result, {"flops": 1979e9 * 0.99}, peak)
        self.assertTrue(result["validity"]["ok"])

    def test_nothing_declared(self) -> None:
        result = self.result(1.0)
        peak = peak_for("H200")
        assert peak is not None
        check_plausibility(result, {}, peak)
        self.assertNotIn("plausibility", result)

    def test_bandwidth_only_peak(self) -> None:
        """A device the table lacks: NVML's bandwidth, no FLOP bound."""
        peak = DevicePeak("Other", 1e12, {})
        result = self.result(1.0)
        check_plausibility(result, {"bytes": 1e9, "flops": 1e15}, peak)
        self.assertAlmostEqual(result["plausibility"]["fraction_of_peak_bandwidth"], 1.0)
        self.assertNotIn("fraction_of_peak_flops", result["plausibility"])

    def test_parse_work_options(self) -> None:
        data = raw(options={"bytes": 1e9, "flops": 2e9}).to_json()
        self.assertEqual(parse_raw(data).options, {"bytes": 1e9, "flops": 2e9})
        for bad in (-1, 0, "1e9", float("inf"), True):
            data = raw().to_json()
            data["options"] = {"bytes": bad}
            self.assertRaises(ValueError, parse_raw, data)
