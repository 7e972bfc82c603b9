"""
Tests for L{kcoral.server.workers.workerproc.WorkerProcess} over a fake
L{IReactorProcess}: no processes, no sleeps.
"""

from __future__ import annotations

import signal
import struct
from typing import Any

import attrs
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.interfaces import IReactorProcess
from twisted.logger import capturedLogs
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from kcoral.ipc import board
from kcoral.ipc.shared import available as shared_memory_available
from kcoral.server.leases.lease import LeaseArbiter
from kcoral.server.workers import workerproc
from kcoral.server.workers.channelbudget import ChannelBudget
from kcoral.server.workers.job import Job, JobResult
from kcoral.server.workers.processes import flush_pipe
from kcoral.server.workers.runningjob import IDLE_WATCH_SECONDS
from kcoral.server.workers.workerproc import WorkerProcess, WorkerSettings, WorkerStartError
from kcoral.testing.fakes import FakeTransport, ProcessReactor
from kcoral.wire.channel import (
    FROM_WORKER_FD,
    PROGRESS_FD,
    TO_WORKER_FD,
    ChannelMessage,
    CompileDone,
    CompileRequest,
    Failed,
    Instruction,
    LeaseAcquire,
    LeaseGranted,
    LeaseNext,
    LeaseRelease,
    Outcome,
    Ready,
    Returned,
    Teardown,
    TornDown,
    encode,
    encode_frame,
)


@attrs.frozen
class _Program:
    instructions: tuple[Any, ...] = ()


class WorkerTestCase(SynchronousTestCase):
    gpus: tuple[int, ...] = ()

    def setUp(self) -> None:
        self.reactor = ProcessReactor()
        self.leases = LeaseArbiter((0,), self.reactor)
        self.tree_killed: list[Any] = []
        # Never touch real processes: the fake pids must not be signalled.
        self.patch(WorkerProcess, "_tree", lambda worker: [])

    def spawn(self, gpus: tuple[int, ...] | None = None) -> WorkerProcess:
        worker = WorkerProcess.spawn(
            self.reactor,
            seat="cpu/w0",
            generation=1,
            gpus=self.gpus if gpus is None else gpus,
            leases=self.leases,
            executable="/usr/bin/python3",
            args=["python3", "-m", "kcoral.worker"],
            env={},
            settings=WorkerSettings(grace_seconds=5.0),
        )
        self.transport: FakeTransport = self.reactor.spawned[-1]["transport"]
        return worker

    def deliver(self, worker: WorkerProcess, message: ChannelMessage) -> None:
        worker.protocol.childDataReceived(FROM_WORKER_FD, encode(message))

    def deliver_frame(self, worker: WorkerProcess, header: dict[str, Any]) -> None:
        """A well-framed header that need not be a valid message."""
        worker.protocol.childDataReceived(FROM_WORKER_FD, encode_frame(header))

    def end(self, worker: WorkerProcess, code: int | None = 0) -> None:
        reason = ProcessDone(0) if code == 0 else ProcessTerminated(exitCode=code)
        worker.protocol.processEnded(Failure(reason))

    def ready_worker(self, gpus: tuple[int, ...] | None = None) -> WorkerProcess:
        worker = self.spawn(gpus)
        self.deliver(worker, Ready(pid=77, target={}, versions={}, device="cpu"))
        self.successResultOf(worker.ready)
        return worker

    def job(self, timeout: float = 10.0, **kw: Any) -> Job:
        return Job(
            request_id="rid",
            program_text='{"instructions":[]}',
            program=kw.pop("program", None),
            blobs=kw.pop("blobs", {}),
            timeout_seconds=timeout,
            output_limit=1024,
            max_response_bytes=1 << 20,
            workspace="/w",
            **kw,
        )


class SpawnTests(WorkerTestCase):
    def test_fake_reactor_provides_process(self) -> None:
        self.assertTrue(verifyObject(IReactorProcess, self.reactor))

    def test_spawn_arguments(self) -> None:
        worker = self.spawn()
        spawned = self.reactor.spawned[0]
        self.assertEqual(spawned["executable"], "/usr/bin/python3")
        self.assertEqual(spawned["args"], ["python3", "-m", "kcoral.worker"])
        self.assertEqual(spawned["childFDs"][TO_WORKER_FD], "w")
        self.assertEqual(spawned["childFDs"][FROM_WORKER_FD], "r")
        self.assertEqual(worker.pid, self.transport.pid)
        self.assertTrue(self.transport.stdin_closed)

    def test_ready_handshake(self) -> None:
        worker = self.spawn()
        self.assertNoResult(worker.ready)
        self.deliver(
            worker,
            Ready(pid=77, target={"arch": "x"}, versions={"v": "1"}, device="gpu"),
        )
        info = self.successResultOf(worker.ready)
        self.assertEqual(info["target"], {"arch": "x"})
        self.assertEqual(worker.info, info)
        # The start timer is gone.
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_settings_at_construction(self) -> None:
        """
        The L{WorkerSettings} given to C{spawn} are the worker's from its
        start: its channel reads against the budget, its start may take the
        spawn timeout, and its kill waits the grace.
        """
        budget = ChannelBudget(1 << 20)
        worker = WorkerProcess.spawn(
            self.reactor,
            seat="cpu/w0",
            generation=1,
            gpus=(),
            leases=self.leases,
            executable="/usr/bin/python3",
            args=["python3", "-m", "kcoral.worker"],
            env={},
            settings=WorkerSettings(grace_seconds=2.0, spawn_timeout=7.0, channel_budget=budget),
        )
        self.assertIs(worker.protocol.budget, budget)
        self.reactor.advance(6.9)
        self.assertNoResult(worker.ready)
        self.reactor.advance(0.2)
        self.failureResultOf(worker.ready, WorkerStartError)
        # The timeout started the kill: SIGKILL follows after the grace.
        [kill] = self.reactor.getDelayedCalls()
        self.assertAlmostEqual(kill.getTime() - self.reactor.seconds(), 2.0)
        self.end(worker, -9)

    def test_spawn_timeout(self) -> None:
        worker = self.spawn()
        self.reactor.advance(59.9)
        self.assertNoResult(worker.ready)
        self.reactor.advance(0.2)
        failure = self.failureResultOf(worker.ready, WorkerStartError)
        self.assertIn("timed out during start", str(failure.value))
        # The worker is being killed: SIGKILL follows after the grace period.
        self.assertTrue(any(c.active() for c in self.reactor.getDelayedCalls()))
        self.end(worker, -9)
        self.assertEqual(self.successResultOf(worker.ended), -9)

    def test_failed_message(self) -> None:
        worker = self.spawn()
        self.deliver(worker, Failed("no device"))
        failure = self.failureResultOf(worker.ready, WorkerStartError)
        self.assertEqual(str(failure.value), "no device")

    def test_exit_during_start(self) -> None:
        worker = self.spawn()
        worker.protocol.childDataReceived(2, b"Traceback: boom\n")
        self.end(worker, 1)
        failure = self.failureResultOf(worker.ready, WorkerStartError)
        self.assertIn("exited with code 1 during start", str(failure.value))
        self.assertIn("boom", str(failure.value))
        self.assertFalse(worker.alive)
        self.assertEqual(self.successResultOf(worker.ended), 1)

    def test_stop_sends_exit_then_kills(self) -> None:
        worker = self.ready_worker()
        ended = worker.stop()
        self.assertEqual([m.TYPE for m in self.transport.messages()], ["exit"])
        self.assertNoResult(ended)
        self.end(worker, 0)
        self.assertEqual(self.successResultOf(ended), 0)
        self.assertEqual(self.reactor.getDelayedCalls(), [])


class JobTests(WorkerTestCase):
    def test_execute_message_and_outcome(self) -> None:
        worker = self.ready_worker()
        d = worker.run(self.job(blobs={"ab" * 32: b"data"}))
        sent = self.transport.messages()
        self.assertEqual([m.TYPE for m in sent], ["blob", "execute"])
        self.assertEqual(sent[0].payload(), b"data")
        self.assertEqual(sent[1].header()["request_id"], "rid")
        self.assertEqual(sent[1].header()["workspace"], "/w")
        self.assertNoResult(d)
        self.deliver(worker, Instruction(0))
        self.deliver(worker, Outcome(status="COMPLETED", parts=(b"abc",)))
        result = self.successResultOf(d)
        self.assertEqual(result.ending, "outcome")
        assert result.outcome is not None
        self.assertEqual(result.outcome.status, "COMPLETED")
        self.assertEqual(result.outcome.payload(), b"abc")
        self.assertEqual(result.lease_wait_seconds, 0.0)
        self.assertEqual(result.lease_held_seconds, 0.0)
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_instruction_events_only_when_traced(self) -> None:
        """
        C{instruction_started}/C{instruction_finished} are made (at DEBUG)
        only for a worker that traces instructions (the server logs DEBUG).
        """
        for trace in (False, True):
            worker = self.ready_worker()
            worker.settings = attrs.evolve(worker.settings, trace_instructions=trace)
            with capturedLogs() as events:
                d = worker.run(self.job())
                self.deliver(worker, Instruction(0))
                self.deliver(worker, Instruction(1))
                self.deliver(worker, Outcome(status="COMPLETED"))
                self.successResultOf(d)
            traced = [
                (e["kcoral_event"], e["index"], e["log_level"].name)
                for e in events
                if str(e.get("kcoral_event", "")).startswith("instruction_")
            ]
            expected = [
                ("instruction_started", 0, "debug"),
                ("instruction_finished", 0, "debug"),
                ("instruction_started", 1, "debug"),
                ("instruction_finished", 1, "debug"),
            ]
            self.assertEqual(traced, expected if trace else [])

    def test_one_job_at_a_time(self) -> None:
        worker = self.ready_worker()
        worker.run(self.job())
        self.assertRaises(RuntimeError, worker.run, self.job())

    def test_timeout(self) -> None:
        worker = self.ready_worker()
        d = worker.run(self.job(timeout=2.0))
        self.deliver(worker, Instruction(1))
        self.reactor.advance(1.9)
        self.assertNoResult(d)
        self.reactor.advance(0.2)
        result = self.successResultOf(d)
        self.assertIsInstance(result, JobResult)
        self.assertEqual(result.ending, "timeout")
        self.assertEqual(result.instruction_index, 1)
        # The worker is being killed; the end of the process finishes it.
        self.assertTrue(worker.alive)
        self.end(worker, -15)
        self.assertFalse(worker.alive)

    def test_crash_attributed_to_last_instruction(self) -> None:
        worker = self.ready_worker()
        indexes: list[int] = []
        d = worker.run(self.job(), on_instruction=indexes.append)
        self.deliver(worker, Instruction(0))
        self.deliver(worker, Instruction(2))
        worker.protocol.childDataReceived(2, b"dying\n")
        self.end(worker, 3)
        result = self.successResultOf(d)
        self.assertEqual(result.ending, "crashed")
        self.assertEqual(result.instruction_index, 2)
        self.assertEqual(result.exit_code, 3)
        self.assertIn("[err] dying", result.output_tail)
        self.assertEqual(indexes, [0, 2])

    def test_returns_before_crash_kept(self) -> None:
        """
        C{returned} messages that arrived before a crash are in the result
        (issue 17, item 4).
        """
        worker = self.ready_worker()
        d = worker.run(self.job())
        self.deliver(worker, Instruction(0))
        self.deliver(worker, Returned("a", {"type": "int", "value": 1}))
        self.deliver(worker, Instruction(1))
        self.deliver(worker, Returned("b", {"type": "bytes", "part": "return:0"}, (b"xy",)))
        self.deliver(worker, Instruction(2))
        self.end(worker, -11)
        result = self.successResultOf(d)
        self.assertEqual(result.ending, "crashed")
        self.assertEqual(list(result.results), ["a", "b"])
        self.assertEqual(result.parts, (b"xy",))

    def test_streamed_parts_joined_to_outcome(self) -> None:
        """The outcome's parts follow the parts its returns already sent."""
        worker = self.ready_worker()
        d = worker.run(self.job())
        self.deliver(worker, Returned("a", {"type": "bytes", "part": "return:0"}, (b"ab",)))
        self.deliver(worker, Outcome(status="COMPLETED", parts=(b"cd",), streamed_parts=1))
        result = self.successResultOf(d)
        assert result.outcome is not None
        self.assertEqual(result.outcome.parts, (b"ab", b"cd"))
        self.assertEqual(result.outcome.streamed_parts, 0)

    def test_streamed_parts_mismatch_invalid(self) -> None:
        """An outcome that counts parts never sent is invalid."""
        worker = self.ready_worker()
        d = worker.run(self.job())
        self.deliver(worker, Outcome(status="COMPLETED", streamed_parts=2))
        self.assertEqual(self.successResultOf(d).ending, "invalid")

    def test_crash_before_any_instruction(self) -> None:
        worker = self.ready_worker()
        d = worker.run(self.job())
        self.end(worker, 3)
        result = self.successResultOf(d)
        self.assertEqual(result.ending, "crashed")
        self.assertIsNone(result.instruction_index)

    def test_invalid_message(self) -> None:
        worker = self.ready_worker()
        d = worker.run(self.job())
        self.deliver(worker, Instruction(1))
        self.deliver_frame(worker, {"type": "nonsense"})
        result = self.successResultOf(d)
        self.assertEqual(result.ending, "invalid")
        self.assertEqual(result.instruction_index, 1)

    def test_malformed_outcome_is_invalid(self) -> None:
        """An outcome whose part sizes do not describe its payload is not accepted."""
        worker = self.ready_worker()
        d = worker.run(self.job())
        header = Outcome(status="COMPLETED").header()
        header["part_sizes"] = [5]
        worker.protocol.childDataReceived(FROM_WORKER_FD, encode_frame(header, b"abc"))
        result = self.successResultOf(d)
        self.assertEqual(result.ending, "invalid")
        self.assertIsNone(result.outcome)
        self.assertIn("part_sizes", result.detail)
        # The worker is killed at once: it is not trusted with a grace period.
        self.assertEqual(self.transport.signals, ["KILL"])

    def test_invalid_message_between_jobs_poisons(self) -> None:
        """Outside a job any message poisons the worker: it is killed and logged."""
        worker = self.ready_worker()
        with capturedLogs() as events:
            self.deliver_frame(worker, {"type": "instruction", "index": "one"})
        self.assertEqual(self.transport.signals, ["KILL"])
        poisoned = [e for e in events if e.get("kcoral_event") == "worker_poisoned"]
        self.assertEqual(len(poisoned), 1)
        self.assertIn("'instruction'", poisoned[0]["reason"])

    def test_garbage_on_channel_kills(self) -> None:
        worker = self.ready_worker()
        worker.run(self.job())
        worker.protocol.childDataReceived(FROM_WORKER_FD, b"\xff" * 64)
        self.assertEqual(self.transport.signals, ["KILL"])
        self.assertIsNotNone(worker.protocol.channel_error)

    def test_cpu_lease_granted_at_once(self) -> None:
        worker = self.ready_worker()
        worker.run(self.job())
        self.deliver(worker, LeaseAcquire())
        self.assertEqual(self.transport.messages()[-1].TYPE, "lease_granted")


class ProgressBoardTests(WorkerTestCase):
    """
    Where a program was when it ended without an outcome comes from the
    worker's progress board (kcoral.ipc.board), checked, when the worker
    posts instead of announcing.
    """

    def setUp(self) -> None:
        super().setUp()
        if not shared_memory_available():
            self.skipTest("no sealed memfds here")

    def _job(self, count: int = 3, **kw: Any) -> Job:
        return self.job(program=_Program(tuple(range(count))), **kw)

    def test_execute_asks_for_announcements_only_when_tracing(self) -> None:
        worker = self.ready_worker()
        self.assertIsNotNone(worker.protocol.board)
        worker.run(self._job())
        self.assertIs(self.transport.messages()[-1].header()["announce"], False)
        self.deliver(worker, Outcome(status="COMPLETED"))
        worker.settings = attrs.evolve(worker.settings, trace_instructions=True)
        worker.run(self._job())
        self.assertIs(self.transport.messages()[-1].header()["announce"], True)

    def test_crash_attributed_from_the_board(self) -> None:
        worker = self.ready_worker()
        d = worker.run(self._job())
        board.BoardPoster(worker.protocol.board).post(2)
        self.end(worker, -11)
        result = self.successResultOf(d)
        self.assertEqual((result.ending, result.instruction_index), ("crashed", 2))
        # Read before it was closed, and closed with the process.
        self.assertIsNone(worker.protocol.board)

    def test_timeout_attributed_from_the_board(self) -> None:
        worker = self.ready_worker()
        d = worker.run(self._job(timeout=1.0))
        board.BoardPoster(worker.protocol.board).post(1)
        self.reactor.advance(1.5)
        self.assertEqual(self.successResultOf(d).instruction_index, 1)

    def test_claims_outside_the_program_are_ignored(self) -> None:
        """A hostile program may post anything: an index it does not have counts for nothing."""
        worker = self.ready_worker()
        d = worker.run(self._job())
        board.BoardPoster(worker.protocol.board).post(99)
        self.end(worker, -9)
        self.assertIsNone(self.successResultOf(d).instruction_index)

    def test_board_never_goes_back_before_an_announcement(self) -> None:
        worker = self.ready_worker()
        d = worker.run(self._job())
        self.deliver(worker, Instruction(2))  # a cpu_only run is announced
        board.BoardPoster(worker.protocol.board).post(0)
        self.end(worker, -9)
        self.assertEqual(self.successResultOf(d).instruction_index, 2)

    def test_board_cleared_for_each_program(self) -> None:
        worker = self.ready_worker()
        board.BoardPoster(worker.protocol.board).post(2)  # the last program's
        d = worker.run(self._job())
        self.assertIsNone(board.read(worker.protocol.board))
        self.end(worker, -9)
        self.assertIsNone(self.successResultOf(d).instruction_index)

    def test_worker_gets_the_board_as_fd_6(self) -> None:
        worker = self.spawn()
        fds = self.reactor.spawned[-1]["childFDs"]
        self.assertEqual(fds[PROGRESS_FD], worker.protocol.board)


class LeaseBudgetTests(WorkerTestCase):
    gpus = (0,)

    def test_budget_paused_during_lease_wait(self) -> None:
        other = object()
        self.successResultOf(self.leases.acquire(other, (0,)))
        worker = self.ready_worker()
        d = worker.run(self.job(timeout=2.0))
        self.reactor.advance(0.5)
        self.deliver(worker, LeaseAcquire())
        # Waiting far longer than the whole budget does not time out.
        self.reactor.advance(10.0)
        self.assertNoResult(d)
        self.assertNotIn("lease_granted", [m.TYPE for m in self.transport.messages()])
        self.leases.release(other)
        self.assertEqual(self.transport.messages()[-1].TYPE, "lease_granted")
        self.assertIs(self.leases.holder_of(0), worker)
        # 1.5 s of budget is left.
        self.reactor.advance(1.0)
        self.deliver(worker, LeaseRelease())
        self.assertIsNone(self.leases.holder_of(0))
        self.reactor.advance(0.4)
        self.assertNoResult(d)
        self.deliver(worker, Outcome(status="COMPLETED"))
        result = self.successResultOf(d)
        self.assertEqual(result.ending, "outcome")
        self.assertAlmostEqual(result.lease_wait_seconds, 10.0)
        self.assertAlmostEqual(result.lease_held_seconds, 1.0)

    def test_next_in_line_told_where_it_may_watch(self) -> None:
        """
        A worker allowed to watch for its grant (a core to spare) is told
        when it is first in line; the grant follows; one that may not is
        never told.
        """
        other = object()
        self.successResultOf(self.leases.acquire(other, (0,)))
        worker = self.ready_worker()
        worker.settings = attrs.evolve(worker.settings, grant_watch=True)
        worker.run(self.job())
        self.deliver(worker, LeaseAcquire())
        self.assertEqual(self.transport.messages()[-1].TYPE, "lease_next")
        self.leases.release(other)
        self.assertEqual(
            [m.TYPE for m in self.transport.messages()[-2:]], ["lease_next", "lease_granted"]
        )
        self.deliver(worker, LeaseRelease())
        self.deliver(worker, Outcome(status="COMPLETED"))

        self.successResultOf(self.leases.acquire(other, (0,)))
        worker.settings = attrs.evolve(worker.settings, grant_watch=False)
        worker.run(self.job())
        self.deliver(worker, LeaseAcquire())
        self.assertEqual(self.transport.messages()[-1].TYPE, "execute")

    def test_a_watching_worker_may_watch_for_its_next_program(self) -> None:
        worker = self.ready_worker()
        worker.run(self.job())
        self.assertEqual(self.transport.messages()[-1].watch_next_seconds, 0.0)
        self.deliver(worker, Outcome(status="COMPLETED"))
        worker.settings = attrs.evolve(worker.settings, grant_watch=True)
        worker.run(self.job())
        self.assertEqual(self.transport.messages()[-1].watch_next_seconds, IDLE_WATCH_SECONDS)

    def test_no_watch_for_the_next_program_while_others_run(self) -> None:
        """
        The pool's answer is asked as each program starts: a worker that
        may watch does not while other programs run beside its own.
        """
        others_running = [True]
        worker = self.ready_worker()
        worker.settings = attrs.evolve(worker.settings, grant_watch=True)
        worker.settings = attrs.evolve(
            worker.settings, may_watch_next=lambda: not others_running[0]
        )
        worker.run(self.job())
        self.assertEqual(self.transport.messages()[-1].watch_next_seconds, 0.0)
        self.deliver(worker, Outcome(status="COMPLETED"))
        others_running[0] = False
        worker.run(self.job())
        self.assertEqual(self.transport.messages()[-1].watch_next_seconds, IDLE_WATCH_SECONDS)

    def test_grant_written_before_the_hand_over_is_logged(self) -> None:
        """The waiting worker's grant is on its pipe before the release and grant are logged."""
        from twisted.logger import globalLogPublisher

        other = object()
        self.successResultOf(self.leases.acquire(other, (0,)))
        worker = self.ready_worker()
        worker.run(self.job())
        self.deliver(worker, LeaseAcquire())
        written: dict[str, list[str]] = {}

        def observe(event: dict[str, Any]) -> None:
            name = event.get("kcoral_event")
            if name in ("lease_released", "lease_granted"):
                written[name] = [m.TYPE for m in self.transport.messages()]

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)
        self.leases.release(other)
        self.assertEqual(written["lease_released"][-1], "lease_granted")
        self.assertEqual(written["lease_granted"][-1], "lease_granted")

    def test_budget_expires_after_grant(self) -> None:
        other = object()
        self.successResultOf(self.leases.acquire(other, (0,)))
        worker = self.ready_worker()
        d = worker.run(self.job(timeout=2.0))
        self.reactor.advance(1.5)
        self.deliver(worker, LeaseAcquire())
        self.reactor.advance(30.0)
        self.leases.release(other)
        self.reactor.advance(0.4)
        self.assertNoResult(d)
        self.reactor.advance(0.2)
        result = self.successResultOf(d)
        self.assertEqual(result.ending, "timeout")
        self.assertAlmostEqual(result.lease_wait_seconds, 30.0)
        self.assertAlmostEqual(result.lease_held_seconds, 0.6)

    def test_crash_abandons_lease(self) -> None:
        worker = self.ready_worker()
        d = worker.run(self.job())
        self.deliver(worker, LeaseAcquire())
        self.assertIs(self.leases.holder_of(0), worker)
        self.reactor.advance(0.25)
        self.end(worker, -11)
        result = self.successResultOf(d)
        self.assertEqual(result.ending, "crashed")
        self.assertAlmostEqual(result.lease_held_seconds, 0.25)
        self.assertIsNone(self.leases.holder_of(0))


class StopTests(WorkerTestCase):
    """
    Stopping a worker spends one termination grace in all (issue 17, item
    10), and a worker whose pipe is already closed does not break the stop
    (issue 17, item 12).
    """

    def setUp(self) -> None:
        super().setUp()
        self.hard_kills: list[int] = []
        self.patch(WorkerProcess, "_kill_hard", lambda worker, victims: self.hard_kills.append(1))

    def test_stop_one_grace(self) -> None:
        worker = self.ready_worker()
        d = worker.stop()
        self.assertEqual(self.transport.messages()[-1].TYPE, "exit")
        self.reactor.advance(4.9)
        self.assertEqual(self.hard_kills, [])
        self.reactor.advance(0.2)
        # SIGKILL when the grace is spent; no SIGTERM and second grace.
        self.assertEqual(self.hard_kills, [1])
        self.assertEqual(self.reactor.getDelayedCalls(), [])
        self.end(worker, -9)
        self.assertEqual(self.successResultOf(d), -9)

    def test_stop_exits_in_time(self) -> None:
        worker = self.ready_worker()
        d = worker.stop()
        self.end(worker, 0)
        self.assertEqual(self.successResultOf(d), 0)
        self.assertEqual(self.reactor.getDelayedCalls(), [])
        self.assertEqual(self.hard_kills, [])

    def test_stop_closed_pipe(self) -> None:
        worker = self.ready_worker()
        sent = len(self.transport.messages())
        self.transport.pipes = {}  # type: ignore[attr-defined]
        d = worker.stop()
        self.assertEqual(len(self.transport.messages()), sent)
        self.reactor.advance(5.0)
        self.assertEqual(self.hard_kills, [1])
        self.end(worker, -9)
        self.assertEqual(self.successResultOf(d), -9)


class ChannelDistrustTests(WorkerTestCase):
    """
    The parent never trusts the channel (issue 13, item 1): sizes bounded by
    what the job may send, checked before buffering; a strict per-job state
    machine; nothing read after a violation.
    """

    def assertPoisoned(self, worker: WorkerProcess, d: Any, *words: str) -> JobResult:
        result: JobResult = self.successResultOf(d)
        self.assertEqual(result.ending, "invalid")
        for word in words:
            self.assertIn(word, result.detail)
        self.assertIn("KILL", self.transport.signals)
        self.assertIsNotNone(worker.protocol.channel_error)
        return result

    def test_flood_header_refused_before_buffering(self) -> None:
        worker = self.ready_worker()
        d = worker.run(self.job())
        prefix = struct.pack(">IQ", 20, 1 << 39)
        worker.protocol.childDataReceived(FROM_WORKER_FD, prefix + b"x" * (1 << 20))
        self.assertPoisoned(worker, d, "over the limit")
        self.assertEqual(worker.protocol.pending, 0)
        # Whatever follows is not kept.
        for _ in range(8):
            worker.protocol.childDataReceived(FROM_WORKER_FD, b"y" * (1 << 20))
        self.assertEqual(worker.protocol.pending, 0)

    def test_a_worker_cannot_send_lease_next(self) -> None:
        """C{lease_next} goes from the parent only: a worker that sends it is poisoned."""
        worker = self.ready_worker()
        d = worker.run(self.job())
        self.deliver(worker, LeaseNext())
        self.assertPoisoned(worker, d, "lease_next")

    def test_outcome_over_response_limit(self) -> None:
        worker = self.ready_worker()
        d = worker.run(self.job())
        message = Outcome(status="COMPLETED", parts=(b"z" * ((1 << 20) + 1),))
        frame = encode(message)
        # The prefix and header alone are refused.
        worker.protocol.childDataReceived(FROM_WORKER_FD, frame[:200])
        self.assertPoisoned(worker, d, "payload", "over the limit")

    def test_outcome_at_response_limit_accepted(self) -> None:
        worker = self.ready_worker()
        d = worker.run(self.job())
        self.deliver(worker, Outcome(status="COMPLETED", parts=(b"z" * (1 << 20),)))
        self.assertEqual(self.successResultOf(d).ending, "outcome")

    def test_large_control_message_refused_from_header(self) -> None:
        worker = self.ready_worker()
        d = worker.run(self.job())
        frame = encode_frame({"type": "instruction", "index": 0}, b"p" * 100_000)
        worker.protocol.childDataReceived(FROM_WORKER_FD, frame[:100])
        self.assertPoisoned(worker, d, "'instruction'", "over the limit")

    def test_flood_between_jobs(self) -> None:
        worker = self.ready_worker()
        worker.protocol.childDataReceived(FROM_WORKER_FD, struct.pack(">IQ", 1 << 30, 0))
        self.assertEqual(self.transport.signals, ["KILL"])
        self.assertEqual(worker.protocol.pending, 0)

    def test_second_outcome_poisons(self) -> None:
        """A forged outcome followed by the real one: the worker is retired."""
        worker = self.ready_worker()
        d = worker.run(self.job())
        self.deliver(worker, Outcome(status="COMPLETED"))
        self.assertEqual(self.successResultOf(d).ending, "outcome")
        self.deliver(worker, Outcome(status="COMPLETED"))
        self.assertEqual(self.transport.signals, ["KILL"])
        self.assertIn("between programs", worker.protocol.channel_error or "")

    def test_instruction_out_of_order(self) -> None:
        worker = self.ready_worker()
        d = worker.run(self.job())
        self.deliver(worker, Instruction(2))
        self.deliver(worker, Instruction(1))
        result = self.assertPoisoned(worker, d, "instruction 1", "after instruction 2")
        self.assertEqual(result.instruction_index, 2)

    def test_instruction_outside_program(self) -> None:
        worker = self.ready_worker()
        d = worker.run(self.job(program=_Program(instructions=(1, 2))))
        self.deliver(worker, Instruction(2))
        self.assertPoisoned(worker, d, "instruction 2 is not in the program")

    def test_release_without_lease(self) -> None:
        worker = self.ready_worker()
        d = worker.run(self.job())
        self.deliver(worker, LeaseRelease())
        self.assertPoisoned(worker, d, "does not hold")

    def test_acquire_twice(self) -> None:
        worker = self.ready_worker()
        d = worker.run(self.job())
        self.deliver(worker, LeaseAcquire())
        self.deliver(worker, LeaseAcquire())
        self.assertPoisoned(worker, d, "holds")

    def test_returned_twice(self) -> None:
        worker = self.ready_worker()
        d = worker.run(self.job())
        self.deliver(worker, Returned("k", {"type": "null"}))
        self.deliver(worker, Returned("k", {"type": "null"}))
        self.assertPoisoned(worker, d, "'k' twice")

    def test_returns_together_bounded(self) -> None:
        """Many returns, each within the limits, cannot add up past the response."""
        worker = self.ready_worker()
        d = worker.run(self.job())
        for i in range(3):
            self.deliver(worker, Returned(f"k{i}", {"type": "null"}, (b"r" * 900_000,)))
        self.assertPoisoned(worker, d, "ahead of the outcome")

    def test_ready_during_job(self) -> None:
        worker = self.ready_worker()
        d = worker.run(self.job())
        self.deliver(worker, Ready(pid=1, target={}, versions={}, device="cpu"))
        self.assertPoisoned(worker, d, "'ready'")

    def test_unknown_frame_during_start_fails_start(self) -> None:
        worker = self.spawn()
        self.deliver(worker, Outcome(status="COMPLETED"))
        failure = self.failureResultOf(worker.ready, WorkerStartError)
        self.assertIn("during start", str(failure.value))
        self.assertEqual(self.transport.signals, ["KILL"])

    def test_closes_channel_on_violation(self) -> None:
        closed: list[int] = []
        worker = self.ready_worker()
        self.transport.closeChildFD = closed.append  # type: ignore[attr-defined]
        worker.protocol.childDataReceived(FROM_WORKER_FD, b"\xff" * 64)
        self.assertEqual(closed, [FROM_WORKER_FD])


class _Compiler:
    """A parent-side compiler that answers when told to."""

    def __init__(self) -> None:
        self.requests: list[tuple[Any, float]] = []
        self.pending: Deferred[CompileDone] = Deferred()

    async def compile(self, request: Any, timeout: float) -> CompileDone:
        self.requests.append((request, timeout))
        return await self.pending


class CompileRequestTests(WorkerTestCase):
    """Compiles for the shared cache run in the parent (issue 13, item 6)."""

    def request(self) -> CompileRequest:
        return CompileRequest("__global__ void k() {}", "sm_90a", [], "nvcc", 30.0)

    def test_compile_answered(self) -> None:
        worker = self.ready_worker()
        worker.settings = attrs.evolve(worker.settings, compiler=_Compiler())
        d = worker.run(self.job(timeout=10.0))
        self.reactor.advance(4.0)
        self.deliver(worker, self.request())
        # The compile may use what is left of the request's budget.
        self.assertEqual(worker.settings.compiler.requests[0][1], 6.0)
        worker.settings.compiler.pending.callback(CompileDone(key="ab" * 32, seconds=1.0))
        self.assertEqual(self.transport.messages()[-1], CompileDone(key="ab" * 32, seconds=1.0))
        self.deliver(worker, Outcome(status="COMPLETED"))
        self.assertEqual(self.successResultOf(d).ending, "outcome")

    def test_message_while_compiling_poisons(self) -> None:
        worker = self.ready_worker()
        worker.settings = attrs.evolve(worker.settings, compiler=_Compiler())
        d = worker.run(self.job())
        self.deliver(worker, self.request())
        self.deliver(worker, self.request())
        result: JobResult = self.successResultOf(d)
        self.assertEqual(result.ending, "invalid")
        self.assertIn("while its compile runs", result.detail)

    def test_job_ending_kills_its_compile(self) -> None:
        """A job whose budget runs out during its compile has the compile cancelled (killed)."""
        worker = self.ready_worker()
        compiler = _Compiler()
        cancelled: list[object] = []
        compiler.pending = Deferred(cancelled.append)
        worker.settings = attrs.evolve(worker.settings, compiler=compiler)
        d = worker.run(self.job(timeout=2.0))
        self.deliver(worker, self.request())
        self.reactor.advance(2.1)
        self.assertEqual(self.successResultOf(d).ending, "timeout")
        self.assertEqual(len(cancelled), 1)
        self.assertFalse(any(isinstance(m, CompileDone) for m in self.transport.messages()))

    def test_abandoned_job_kills_its_compile(self) -> None:
        """A job whose wait is cancelled (its client left) has its compile cancelled too."""
        worker = self.ready_worker()
        compiler = _Compiler()
        cancelled: list[object] = []
        compiler.pending = Deferred(cancelled.append)
        worker.settings = attrs.evolve(worker.settings, compiler=compiler)
        d = worker.run(self.job())
        self.deliver(worker, self.request())
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertEqual(len(cancelled), 1)

    def test_without_compiler_unavailable(self) -> None:
        worker = self.ready_worker()
        worker.run(self.job())
        self.deliver(worker, self.request())
        answer = self.transport.messages()[-1]
        assert isinstance(answer, CompileDone)
        self.assertEqual(answer.kind, "unavailable")


class GpuChannelDistrustTests(WorkerTestCase):
    gpus = (0,)

    def test_message_while_lease_pending(self) -> None:
        other = object()
        self.successResultOf(self.leases.acquire(other, (0,)))
        worker = self.ready_worker()
        d = worker.run(self.job())
        self.deliver(worker, LeaseAcquire())
        self.deliver(worker, Outcome(status="COMPLETED"))
        result: JobResult = self.successResultOf(d)
        self.assertEqual(result.ending, "invalid")
        self.assertIn("lease request waits", result.detail)
        self.end(worker, -9)
        # The killed worker is not left waiting in line for the GPU.
        self.leases.release(other)
        self.assertIsNone(self.leases.holder_of(0))

    def test_forged_frames_release_lease(self) -> None:
        worker = self.ready_worker()
        d = worker.run(self.job())
        self.deliver(worker, LeaseAcquire())
        self.assertIs(self.leases.holder_of(0), worker)
        self.deliver(worker, LeaseAcquire())
        self.assertEqual(self.successResultOf(d).ending, "invalid")
        self.end(worker, -9)
        self.assertIsNone(self.leases.holder_of(0))

    def test_outcome_holding_the_lease(self) -> None:
        """
        A forged outcome while the worker holds its GPU: it would keep the
        GPU between requests, so the worker is poisoned and the lease freed.
        """
        worker = self.ready_worker()
        d = worker.run(self.job())
        self.deliver(worker, LeaseAcquire())
        self.deliver(worker, Outcome(status="COMPLETED"))
        result: JobResult = self.successResultOf(d)
        self.assertEqual(result.ending, "invalid")
        self.assertIn("holding its GPU lease", result.detail)
        self.end(worker, -9)
        self.assertIsNone(self.leases.holder_of(0))

    def test_retiring_outcome_may_hold_the_lease(self) -> None:
        """A retiring worker may answer holding its lease (kept until L{WorkerProcess.retire})."""
        worker = self.ready_worker()
        d = worker.run(self.job())
        self.deliver(worker, LeaseAcquire())
        self.deliver(worker, Outcome(status="COMPLETED", retire="request_limit"))
        self.assertEqual(self.successResultOf(d).ending, "outcome")
        self.assertEqual(self.transport.signals, [])

    def test_startup_release_may_arrive_during_first_job(self) -> None:
        worker = self.spawn()
        self.deliver(worker, LeaseAcquire())
        self.assertEqual(self.leases.maintainers_of(0), {worker})
        self.deliver(worker, Ready(pid=77, target={}, versions={}, device="gpu"))
        d = worker.run(self.job())
        self.deliver(worker, LeaseRelease())
        self.assertEqual(self.leases.maintainers_of(0), frozenset())
        self.deliver(worker, Outcome(status="COMPLETED"))
        self.assertEqual(self.successResultOf(d).ending, "outcome")
        self.assertEqual(self.transport.signals, [])


class ContextOnTheLeaseTests(WorkerTestCase):
    """
    A GPU worker's context is created and destroyed under its GPU's
    maintenance lease, never beside an exclusive holder, and logged.
    """

    gpus = (0,)

    def setUp(self) -> None:
        super().setUp()
        self.hard_kills: list[WorkerProcess] = []
        self.patch(
            WorkerProcess, "_kill_hard", lambda worker, victims: self.hard_kills.append(worker)
        )

    def events(self, captured: list[dict[str, Any]]) -> list[tuple[str, str | None]]:
        return [
            (e["kcoral_event"], e.get("how"))
            for e in captured
            if str(e.get("kcoral_event", "")).startswith("context_")
        ]

    def retiring_worker(self) -> WorkerProcess:
        worker = self.spawn()
        self.deliver(worker, LeaseAcquire())
        self.deliver(worker, Ready(pid=77, target={}, versions={}, device="gpu"))
        self.deliver(worker, LeaseRelease())
        d = worker.run(self.job())
        self.deliver(worker, LeaseAcquire())
        self.deliver(worker, Outcome(status="COMPLETED", retire="request_limit"))
        self.successResultOf(d)
        return worker

    def test_creation_waits_for_a_measurement(self) -> None:
        """A new worker's context creation waits for an exclusive holder, then is logged."""
        self.successResultOf(self.leases.acquire("measuring", (0,)))
        with capturedLogs() as captured:
            worker = self.spawn()
            self.deliver(worker, LeaseAcquire())
            self.assertEqual(self.transport.messages(), [])
            self.leases.release("measuring")
            self.assertEqual(self.transport.messages(), [LeaseGranted()])
            self.reactor.advance(0.2)
            self.deliver(worker, Ready(pid=77, target={}, versions={}, device="gpu"))
            self.deliver(worker, LeaseRelease())
        self.assertEqual(
            self.events(captured),
            [("context_create_started", None), ("context_create_finished", "ready")],
        )
        finished = [e for e in captured if e.get("kcoral_event") == "context_create_finished"]
        self.assertAlmostEqual(finished[0]["duration_ms"], 200.0)
        self.assertEqual(self.leases.maintainers_of(0), frozenset())

    def test_program_start_and_grant_leave_at_once(self) -> None:
        """
        A job's L{Execute} and a lease grant are flushed to the worker's
        pipe in the turn that wrote them (L{kcoral.server.workers.processes.flush_pipe}).
        """
        worker = self.spawn()
        self.deliver(worker, LeaseAcquire())
        self.deliver(worker, Ready(pid=77, target={}, versions={}, device="gpu"))
        self.deliver(worker, LeaseRelease())
        flushed: list[int] = []
        writer = attrs.make_class("W", {})()
        writer.doWrite = lambda: flushed.append(len(self.transport.messages()))
        self.transport.pipes = {TO_WORKER_FD: writer}  # type: ignore[attr-defined]
        worker.run(self.job())
        self.assertEqual(len(flushed), 1)
        self.deliver(worker, LeaseAcquire())
        self.assertIsInstance(self.transport.messages()[-1], LeaseGranted)
        self.assertEqual(len(flushed), 2)
        self.assertEqual(flushed[-1], len(self.transport.messages()))

    def test_creations_batch(self) -> None:
        """Two workers create their contexts together."""
        first, second = self.spawn(), self.spawn()
        self.deliver(first, LeaseAcquire())
        self.deliver(second, LeaseAcquire())
        self.assertEqual(self.leases.maintainers_of(0), {first, second})

    def test_orderly_teardown(self) -> None:
        """
        retire(): the exclusive hold kept through the outcome is given back,
        the maintenance lease taken, Teardown sent; after TornDown the lease
        is held until the process is gone (its word is not trusted).
        """
        worker = self.retiring_worker()
        self.assertIs(self.leases.holder_of(0), worker)
        with capturedLogs() as captured:
            ended = worker.retire()
            self.assertIsNone(self.leases.holder_of(0))
            self.assertEqual(self.leases.maintainers_of(0), {worker})
            self.assertEqual(self.transport.messages()[-1], Teardown())
            self.deliver(worker, TornDown(destroyed=True, seconds=0.01))
            self.assertEqual(self.leases.maintainers_of(0), {worker})
            self.end(worker, 0)
            self.assertEqual(self.leases.maintainers_of(0), frozenset())
        self.assertEqual(self.successResultOf(ended), 0)
        self.assertEqual(
            self.events(captured),
            [("context_teardown_started", None), ("context_teardown_finished", "destroyed")],
        )
        self.assertEqual(self.hard_kills, [])

    def test_teardown_waits_for_a_measurement(self) -> None:
        """A teardown never starts while another worker holds the GPU."""
        worker = self.retiring_worker()
        self.leases.release(worker)
        self.successResultOf(self.leases.acquire("measuring", (0,)))
        worker.retire()
        self.assertNotIn(Teardown(), self.transport.messages())
        self.leases.release("measuring")
        self.assertEqual(self.transport.messages()[-1], Teardown())

    def test_not_destroyed_holds_until_gone(self) -> None:
        """TornDown(destroyed=False): the lease is held until the process is gone."""
        worker = self.retiring_worker()
        worker.retire()
        self.deliver(worker, TornDown(destroyed=False, seconds=0.0))
        self.assertEqual(self.leases.maintainers_of(0), {worker})
        self.end(worker, 0)
        self.assertEqual(self.leases.maintainers_of(0), frozenset())

    def test_slow_exit_after_answer_killed(self) -> None:
        """A worker that answers but does not exit is killed soon, under the lease."""
        worker = self.retiring_worker()
        worker.retire()
        self.deliver(worker, TornDown(destroyed=True, seconds=0.01))
        self.reactor.advance(0.9)
        self.assertEqual(self.hard_kills, [])
        self.reactor.advance(0.2)
        self.assertEqual(self.hard_kills, [worker])
        self.assertEqual(self.leases.maintainers_of(0), {worker})

    def test_frozen_while_waiting_for_the_lease(self) -> None:
        """
        A retiring worker is frozen while it waits for the maintenance lease
        (a thread its program left runs nothing beside a measurement), and
        thawed when the lease is granted.
        """
        signals: list[int] = []
        self.patch(workerproc, "signal_all", lambda victims, signum: signals.append(signum))
        worker = self.retiring_worker()
        self.leases.release(worker)
        self.successResultOf(self.leases.acquire("measuring", (0,)))
        worker.retire()
        self.assertEqual(signals, [signal.SIGSTOP])
        self.leases.release("measuring")
        self.assertEqual(signals, [signal.SIGSTOP, signal.SIGCONT])
        self.assertEqual(self.transport.messages()[-1], Teardown())

    def test_silent_worker_killed_under_the_lease(self) -> None:
        """No answer within the grace: killed while the maintenance lease is held."""
        worker = self.retiring_worker()
        worker.retire()
        self.reactor.advance(5.0)
        self.assertEqual(self.hard_kills, [worker])
        self.assertEqual(self.leases.maintainers_of(0), {worker})
        self.end(worker, -9)
        self.assertEqual(self.leases.maintainers_of(0), frozenset())

    def test_kill_waits_for_the_lease(self) -> None:
        """
        A worker killed while another holds the GPU is frozen at once and
        killed only once the maintenance lease is granted; it is held until
        the process is gone.
        """
        worker = self.spawn()
        self.deliver(worker, LeaseAcquire())
        self.deliver(worker, Ready(pid=77, target={}, versions={}, device="gpu"))
        self.deliver(worker, LeaseRelease())
        self.successResultOf(self.leases.acquire("measuring", (0,)))
        with capturedLogs() as captured:
            ended = worker.kill()
            worker.kill_now()
            self.assertEqual(self.hard_kills, [])
            self.leases.release("measuring")
            self.assertEqual(self.hard_kills, [worker])
            self.assertEqual(self.leases.maintainers_of(0), {worker})
            self.end(worker, -9)
        self.assertEqual(self.successResultOf(ended), -9)
        self.assertEqual(self.leases.maintainers_of(0), frozenset())
        self.assertEqual(
            self.events(captured),
            [("context_teardown_started", None), ("context_teardown_finished", "exited")],
        )

    def test_kill_when_no_lease_can_come(self) -> None:
        """A quarantined GPU grants nothing: the worker is killed at once."""
        worker = self.ready_worker()
        self.successResultOf(self.leases.acquire("measuring", (0,)))
        self.leases.quarantine((0,))
        worker.kill_now()
        self.assertEqual(self.hard_kills, [worker])

    def test_holder_killed_at_once(self) -> None:
        """A worker that holds its GPU is killed under its own hold, at once."""
        worker = self.ready_worker()
        worker.run(self.job())
        self.deliver(worker, LeaseAcquire())
        worker.kill_now()
        self.assertEqual(self.hard_kills, [worker])

    def test_cpu_worker_retires_by_itself(self) -> None:
        """A CPU worker exits on its own after retiring; killed after the grace if not."""
        worker = self.ready_worker(gpus=())
        worker.retire()
        self.assertNotIn(Teardown(), self.transport.messages())
        self.reactor.advance(5.0)
        self.assertEqual(self.hard_kills, [worker])


class KillBeforeThePidIsKnownTests(WorkerTestCase):
    """
    A worker forked by a template learns its pid a moment after it starts;
    a kill asked for before that is carried out once the pid is known.
    """

    gpus = (0,)

    def test_kill_retried_until_the_pid_is_known(self) -> None:
        signalled: list[tuple[int | None, int]] = []
        worker = self.spawn()
        worker.pid = None
        self.patch(
            workerproc,
            "signal_all",
            lambda victims, signum: signalled.append((worker.pid, signum)),
        )
        self.patch(WorkerProcess, "_tree", lambda w: [] if w.pid is None else [object()])
        worker.kill_now()
        self.assertEqual([s for s in signalled if s[0] is not None], [])
        self.reactor.advance(0.05)
        self.assertTrue(worker.alive)
        worker.pid = 4321
        self.reactor.advance(0.05)
        self.assertIn((4321, signal.SIGKILL), signalled)
        self.end(worker, -9)
        self.failureResultOf(worker.ready, WorkerStartError)
        self.assertEqual(self.reactor.getDelayedCalls(), [])


class FlushTests(SynchronousTestCase):
    """
    L{kcoral.server.workers.processes.flush_pipe}: a message the worker waits for (a lease grant, a
    program start) leaves in the reactor turn that wrote it.
    """

    def test_written_without_a_reactor_turn(self) -> None:
        """The pipe holds the bytes at once; the reactor never ran."""
        import os

        from twisted.internet import process
        from twisted.internet.testing import MemoryReactor

        read_end, write_end = os.pipe()
        self.addCleanup(os.close, read_end)
        os.set_blocking(write_end, False)
        writer = process.ProcessWriter(MemoryReactor(), None, 0, write_end)
        self.addCleanup(os.close, write_end)
        transport = attrs.make_class("T", {"pipes": attrs.field()})(pipes={0: writer})
        writer.write(b"granted")
        os.set_blocking(read_end, False)
        self.assertRaises(BlockingIOError, os.read, read_end, 100)
        flush_pipe(transport, 0)
        self.assertEqual(os.read(read_end, 100), b"granted")

    def test_without_pipes_nothing_happens(self) -> None:
        """A transport without pipes (a test's) is left alone."""
        flush_pipe(FakeTransport(pid=1), 0)
