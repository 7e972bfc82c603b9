# -*- test-case-name: tests.unit.test_workerproc,tests.unit.test_measurement -*-
"""
L{RunningJob}: the parent's side of one program on a worker.

It sends the program, checks each message of the worker against the job's
state machine (instructions in order, the lease asked for and given back in
turn, one outcome), answers lease requests through the arbiter, runs the
execution budget (paused while the worker waits for its lease), has the
parent compute each benchmark's measurement, and ends with one
L{kcoral.server.workers.job.JobResult}.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.python.failure import Failure

from kcoral.ipc import board
from kcoral.ipc.shared import SharedBuffer
from kcoral.measurement import (
    MeasurementFailed,
    add_monitor_reasons,
    check_plausibility,
    evaluate,
    failed_record,
    parse_raw,
)
from kcoral.server.leases.lease import Grant, Leases
from kcoral.server.workers.job import Job, JobResult
from kcoral.wire.channel import (
    OUTCOME_SLACK_BYTES,
    ChannelMessage,
    CompileDone,
    CompileRequest,
    Execute,
    Instruction,
    LeaseAcquire,
    LeaseGranted,
    LeaseNext,
    LeaseRelease,
    Measurement,
    MeasurementResult,
    MeasureStart,
    MeasureStop,
    Outcome,
    Returned,
)
from kcoral.wire.errors import instruction_error

if TYPE_CHECKING:
    from kcoral.server.workers.workerproc import WorkerProcess

#: Measurements (benchmark calls) one program may have the parent compute.
MAX_MEASUREMENTS = 1000

#: How long a worker that may watch awake (C{WorkerSettings.grant_watch})
#: polls for its next program after it answered and settled: a sequential
#: client's next request reaches the same worker 1.5-3 ms later on an H200.
IDLE_WATCH_SECONDS = 0.01


@attrs.define(eq=False)
class RunningJob:
    """The parent's side of one job: messages, lease, budget."""

    worker: WorkerProcess
    job: Job
    on_instruction: Callable[[int], None] | None
    reactor: IReactorTime
    #: The worker's lease arbiter.
    leases: Leases
    done: Deferred[JobResult] = attrs.field(factory=Deferred)
    instruction_index: int | None = None
    instruction_started: dict[int, float] = attrs.field(factory=dict)
    remaining: float = 0.0
    _budget_started: float | None = None
    _timer: IDelayedCall | None = None
    _lease_request: Deferred[Grant] | None = None
    _lease_wait: float = 0.0
    _lease_held: float = 0.0
    _held_since: float | None = None
    #: C{"none"}, C{"pending"} (asked, not granted yet) or C{"held"}.
    _lease_state: str = "none"
    #: A L{CompileRequest} runs in the parent: the worker waits for it.
    _compiling: bool = False
    #: That compile, while it runs: a job that ends meanwhile (its budget
    #: spent, its worker dead or killed, its client gone) kills it.
    _compile_run: Deferred[CompileDone] | None = None
    #: What C{returned} messages brought so far.
    returned: dict[str, Any] = attrs.field(factory=dict)
    returned_parts: list[bytes | SharedBuffer] = attrs.field(factory=list)
    returned_bytes: int = 0
    #: A benchmark's timed loop: C{"none"}, C{"running"} (after
    #: L{MeasureStart}) or C{"stopped"} (after L{MeasureStop}), with the
    #: reactor times of both.
    _measure_state: str = "none"
    _measure_started: float = 0.0
    _measure_stopped: float = 0.0
    #: The records of the measurements computed so far.
    measurements: list[dict[str, Any]] = attrs.field(factory=list)

    def start(self) -> None:
        """Send the program (its blobs first) and start the execution budget."""
        settings = self.worker.settings
        self.remaining = self.job.timeout_seconds
        progress = self._board()
        if progress is not None:
            board.clear(progress)  # what the last program posted
        # Instructions are posted on the board, unless there is none or
        # the operator traces them (their events need the messages).
        messages = self.job.messages(
            announce=progress is None or settings.trace_instructions,
            watch_next=IDLE_WATCH_SECONDS
            if settings.grant_watch and settings.may_watch_next()
            else 0.0,
        )
        budget = self.worker.protocol.budget
        if budget is not None and isinstance(messages[-1], Execute):
            # Results too costly for the parent to decode are left out
            # (oversize) by the worker, not refused here.
            messages[-1] = attrs.evolve(messages[-1], max_decode_bytes=budget.decode_share)
        for message in messages[:-1]:
            self.worker.send(message)
        self.worker.send(messages[-1], now=True)
        self._resume_budget()

    def _board(self) -> int | None:
        return self.worker.protocol.board

    def _where(self) -> int | None:
        """
        The instruction running when the program ended without an outcome:
        the last one posted on the board if it is an instruction of this
        program and not before the last one announced (the board is written
        by code that may be hostile), else the last one announced.
        """
        announced = self.instruction_index
        progress = self._board()
        posted = None if progress is None else board.read(progress)
        count = _instruction_count(self.job)
        if posted is None or (count is not None and posted >= count):
            return announced
        if announced is not None and posted < announced:
            return announced
        return posted

    # -- the execution budget, paused during lease waits -------------------

    def _clock(self) -> float:
        return float(self.reactor.seconds())

    def _resume_budget(self) -> None:
        self._budget_started = self._clock()
        self._timer = self.reactor.callLater(max(self.remaining, 0.0), self._timed_out)

    def _pause_budget(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        if self._budget_started is not None:
            self.remaining -= self._clock() - self._budget_started
            self._budget_started = None

    def _timed_out(self) -> None:
        self._timer = None
        self._finish(JobResult("timeout", instruction_index=self._where()))
        self.worker.kill()

    def gpu_violation(self, reason: str, location: str) -> bool:
        """
        Fail the program with C{gpu_access} at the instruction running (the
        GPU monitor killed a process it started) and kill the worker;
        C{False} when no instruction of it is known to be running.
        """
        if self.done.called:
            return True
        index = self._where()
        instructions = getattr(self.job.program, "instructions", ())
        if index is None or not 0 <= index < len(instructions):
            return False
        instruction = instructions[index]
        error = instruction_error(
            "gpu_access",
            reason,
            index,
            instruction.op,
            getattr(instruction, "id", None),
            cuda_call="a CUDA context (seen by NVML)",
            location=location,
        )
        outcome = Outcome(status="FAILED", error=error)
        self._finish(JobResult("outcome", outcome=outcome))
        self.worker.kill()
        return True

    # -- messages -------------------------------------------------------------

    def message_received(self, message: ChannelMessage) -> None:
        """
        One message of this job, checked against the job's state machine:
        instructions in increasing order within the program, the lease
        asked for only when not held and given back only when held,
        nothing while a lease request waits, and one outcome.
        """
        if self.done.called:
            return
        if self._lease_state == "pending":
            self._violation(f"a {message.TYPE!r} message while its lease request waits")
        elif self._compiling:
            self._violation(f"a {message.TYPE!r} message while its compile runs")
        elif isinstance(message, CompileRequest):
            self._compile(message)
        elif isinstance(message, Instruction):
            self._instruction(message.index)
        elif isinstance(message, LeaseAcquire):
            if self._lease_state == "held":
                self._violation("asked for the lease it holds")
            else:
                self._acquire_lease()
        elif isinstance(message, LeaseRelease):
            if self._lease_state != "held":
                self._violation("gave back a lease it does not hold")
            else:
                self._release_lease()
        elif isinstance(message, MeasureStart):
            # A loop that failed half-way never sent its measurement: a
            # new start begins afresh.
            self._measure_state = "running"
            self._measure_started = self._clock()
        elif isinstance(message, MeasureStop):
            if self._measure_state != "running":
                self._violation("stopped a measurement it did not start")
            else:
                self._measure_state = "stopped"
                self._measure_stopped = self._clock()
        elif isinstance(message, Measurement):
            self._measured(message)
        elif isinstance(message, Returned):
            self._returned(message)
        elif isinstance(message, Outcome):
            if self._lease_state == "held" and self.worker.gpus and message.retire is None:
                # A worker that stays gives its GPU back before it answers;
                # only a retiring one may keep it (retire() gives it back).
                self._violation("answered holding its GPU lease without retiring")
                return
            if self.worker.protocol.drain():
                # The outcome is the last message and every descriptor goes
                # before its frame: these were left for the next request.
                self._violation("sent descriptors that no message named")
                return
            if message.streamed_parts != len(self.returned_parts):
                self._violation(
                    f"outcome counts {message.streamed_parts} parts sent ahead, "
                    f"{len(self.returned_parts)} arrived"
                )
                return
            outcome = attrs.evolve(
                message,
                parts=(*self.returned_parts, *message.parts),
                streamed_parts=0,
            )
            self._finish(JobResult("outcome", outcome=outcome))
        else:
            self._violation(f"unexpected {message.TYPE!r} message during a program")

    def _violation(self, reason: str) -> None:
        self.worker.protocol.violation(reason)

    def _compile(self, request: CompileRequest) -> None:
        """Have the parent compile into the shared cache; the budget keeps running."""
        compiler = self.worker.settings.compiler
        if compiler is None:
            self.worker.send(
                CompileDone(kind="unavailable", error="this server compiles for no shared cache")
            )
            return
        self._compiling = True
        left = self.remaining
        if self._budget_started is not None:
            left -= self._clock() - self._budget_started
        timeout = max(1.0, min(float(request.timeout), left))
        d: Deferred[CompileDone] = Deferred.fromCoroutine(compiler.compile(request, timeout))
        self._compile_run = d

        def answer(done: CompileDone) -> None:
            self._compiling = False
            self._compile_run = None
            if not self.done.called:
                self.worker.send(done)

        d.addCallbacks(
            answer, lambda f: answer(CompileDone(kind="engine", error=f.getErrorMessage()))
        )

    def stop_compile(self) -> None:
        """
        The job has ended (answered, timed out, crashed, or abandoned by its
        client): a compile still running for it is killed, and its answer
        goes nowhere.
        """
        if self._compile_run is not None:
            self._compile_run.cancel()

    def _measured(self, message: Measurement) -> None:
        """
        Compute a benchmark's result from its raw measurement, against the
        wall time of its timed loop on the parent's clock; keep it as the
        parent's record and send it back as the program's value.
        """
        if self._measure_state != "stopped":
            self._violation("sent a measurement without a timed loop")
            return
        self._measure_state = "none"
        if len(self.measurements) >= MAX_MEASUREMENTS:
            self._violation(f"sent more than {MAX_MEASUREMENTS} measurements")
            return
        try:
            raw = parse_raw(message.raw)
        except ValueError as e:
            self._violation(f"sent a malformed measurement: {e}")
            return
        wall_ms = (self._measure_stopped - self._measure_started) * 1000.0
        header = {
            "id": len(self.measurements),
            "instruction_index": self._where(),
            "wall_ms": wall_ms,
            "overhead_ms": raw.overhead_ms,
        }
        try:
            result = evaluate(raw, wall_ms)
        except MeasurementFailed as e:
            self.measurements.append({**header, **failed_record(e.message, e.record)})
            self.worker.send(MeasurementResult(error=e.message))
            return
        result["measurement_id"] = header["id"]
        record = {**header, **result}
        self.measurements.append(record)
        monitor = self.leases.monitor
        if monitor is None or not self.worker.gpus:
            self.worker.send(MeasurementResult(result=result))
            return
        # The GPU monitor's verdict on the timed loop (kcoral.server.leases.monitor).
        d = monitor.judge(
            self.worker, self.worker.gpus, self._measure_started, self._measure_stopped
        )

        def judged(verdict: tuple[list[tuple[str, str]], dict[str, Any]]) -> None:
            add_monitor_reasons(result, *verdict)
            peak = monitor.peak_of(self.worker.gpus)
            if peak is not None and "latency_ms_median" in result:
                check_plausibility(result, raw.options, peak)
                if "plausibility" in result:
                    record["plausibility"] = result["plausibility"]
            record.update(validity=result["validity"], gpu=result["gpu"])

        def send(_: None) -> None:
            if not self.done.called:
                self.worker.send(MeasurementResult(result=result))

        d.addCallback(judged).addErrback(
            lambda f: self.worker.log.failure("the GPU monitor failed", f)
        ).addCallback(send)

    def _returned(self, message: Returned) -> None:
        """
        Keep a finished return; all of them together may not outgrow the
        response (L{kcoral.wire.channel.OUTCOME_SLACK_BYTES} of framing aside),
        so a worker cannot grow the parent's memory with many of them.
        """
        if message.key in self.returned:
            self._violation(f"returned {message.key!r} twice")
            return
        self.returned_bytes += self.worker.protocol.frame_bytes
        self.returned_bytes += sum(len(buffer) for buffer in message.descriptors())
        allowed = self.job.max_response_bytes + OUTCOME_SLACK_BYTES
        if self.returned_bytes > allowed:
            self._violation(
                f"returned {self.returned_bytes} bytes ahead of the outcome, over {allowed}"
            )
            return
        self.returned[message.key] = message.value
        self.returned_parts.extend(message.parts)

    def _instruction(self, index: int) -> None:
        count = _instruction_count(self.job)
        last = self.instruction_index
        if index < 0 or (count is not None and index >= count):
            self._violation(f"instruction {index} is not in the program")
            return
        if last is not None and index <= last:
            self._violation(f"instruction {index} announced after instruction {last}")
            return
        self._instruction_finished()
        self.instruction_index = index
        self.instruction_started[index] = self._clock()
        self._event(
            "instruction_started",
            "request {request_id}: instruction {index} started on {worker_id}",
            index,
        )
        if self.on_instruction is not None:
            self.on_instruction(index)

    def invalid_received(self, detail: str = "") -> None:
        """The worker broke the control channel during this job."""
        if self.done.called:
            return
        self._finish(JobResult("invalid", instruction_index=self._where(), detail=detail))
        self.worker.kill_now()

    def _instruction_finished(self) -> None:
        """Log the end of the instruction that ran until now, if any."""
        index = self.instruction_index
        if index is None:
            return
        self._event(
            "instruction_finished",
            "request {request_id}: instruction {index} finished on {worker_id}",
            index,
            elapsed_ms=(self._clock() - self.instruction_started[index]) * 1000.0,
        )

    def _event(self, event: str, text: str, index: int, **fields: Any) -> None:
        """Log instruction event C{event} of this job's instruction C{index} (DEBUG)."""
        if not self.worker.settings.trace_instructions:
            return
        self.worker.log.debug(
            text,
            kcoral_event=event,
            request_id=self.job.request_id,
            worker_id=self.worker.seat,
            index=index,
            op=_op_of(self.job, index),
            **fields,
        )

    def _acquire_lease(self) -> None:
        if not self.worker.gpus:
            self._lease_state = "held"
            self.worker.send(LeaseGranted())
            return
        self._lease_state = "pending"
        self._pause_budget()
        requested = self._clock()

        def wake(grant: Grant) -> None:
            # The worker and the GPU wait: the grant goes out before the
            # arbiter logs the hand-over.
            if not self.done.called:
                self.worker.send(LeaseGranted(), now=True)

        def next_in_line() -> None:
            if not self.done.called:
                self.worker.send(LeaseNext())

        d = self.leases.acquire(
            self.worker,
            self.worker.gpus,
            label=self.job.request_id,
            wake=wake,
            next_in_line=next_in_line if self.worker.settings.grant_watch else None,
        )
        self._lease_request = d

        def granted(grant: Grant) -> None:
            self._lease_request = None
            self._lease_state = "held"
            now = self._clock()
            self._lease_wait += now - requested
            self._held_since = now
            if self.done.called:
                return
            self._resume_budget()

        def failed(failure: Failure) -> None:
            self._lease_request = None
            if not failure.check(CancelledError) and not self.done.called:
                self._finish(JobResult("crashed", instruction_index=self._where()))
                self.worker.kill()

        d.addCallbacks(granted, failed)

    def _release_lease(self) -> None:
        self._lease_state = "none"
        if self._held_since is not None:
            self._lease_held += self._clock() - self._held_since
            self._held_since = None
        self.leases.release(self.worker)

    def process_ended(self, exit_code: int | None, tail: str) -> None:
        if self._held_since is not None:
            self._lease_held += self._clock() - self._held_since
            self._held_since = None
        if not self.done.called:
            self._finish(
                JobResult(
                    "crashed",
                    instruction_index=self._where(),
                    exit_code=exit_code,
                    output_tail=tail,
                )
            )

    def _finish(self, result: JobResult) -> None:
        if self.done.called:
            return
        self._pause_budget()
        self._instruction_finished()
        held = self._lease_held
        if self._held_since is not None:
            held += self._clock() - self._held_since
        result = attrs.evolve(
            result,
            results=dict(self.returned),
            parts=tuple(self.returned_parts),
            measurements=tuple(self.measurements),
            lease_wait_seconds=self._lease_wait,
            lease_held_seconds=held,
            instruction_started=dict(self.instruction_started),
            ended_at=self._clock(),
            exit_code=result.exit_code if result.exit_code is not None else self.worker.exit_code,
            output_tail=result.output_tail or self.worker.protocol.output_tail(),
        )
        self.done.callback(result)


def _instruction_count(job: Job) -> int | None:
    """How many instructions the job's program has (C{None}: not known)."""
    instructions = getattr(job.program, "instructions", None)
    return None if instructions is None else len(instructions)


def _op_of(job: Job, index: int) -> str | None:
    instructions = getattr(job.program, "instructions", ())
    return instructions[index].op if 0 <= index < len(instructions) else None
