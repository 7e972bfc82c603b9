# -*- test-case-name: tests.unit.test_workerproc -*-
"""
One worker process, seen from the reactor.

L{WorkerProcess} spawns C{python -m kcoral.worker} (inside the sandbox's
command line), waits for its L{Ready} message, runs jobs over the control
channel (L{kcoral.wire.channel}), answers its lease requests through the
L{LeaseArbiter}, enforces the execution budget (paused while the worker waits
for its lease), and kills the whole process tree when asked: SIGTERM, then
SIGKILL after the grace period.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
from collections.abc import Callable
from typing import Any

import attrs
import psutil
from twisted.internet import main, process
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.interfaces import IDelayedCall, IReactorProcess, IReactorTime
from twisted.internet.posixbase import PosixReactorBase
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.python.runtime import platform

from kcoral.ipc import board
from kcoral.ipc.shared import (
    SharedBuffer,
    SharedMemoryError,
    drain_descriptors,
    receive_descriptors,
    send_descriptors,
    socket_pair,
)
from kcoral.ipc.shared import available as shared_memory_available
from kcoral.measurement import (
    MeasurementFailed,
    add_monitor_reasons,
    check_plausibility,
    evaluate,
    failed_record,
    parse_raw,
)
from kcoral.proctree import descendants_of
from kcoral.server.leases.lease import MAINTENANCE
from kcoral.server.workers.channelbudget import ChannelBudget, ignore_cancel
from kcoral.server.workers.job import Job, JobResult
from kcoral.wire.channel import (
    CONTROL_FRAME_BYTES,
    CONTROL_LIMITS,
    FROM_WORKER_FD,
    HEADER_DECODE_FACTOR,
    OUTCOME_SLACK_BYTES,
    TO_WORKER_FD,
    WORKER_CHANNEL_FDS,
    ChannelError,
    ChannelMessage,
    CompileDone,
    CompileRequest,
    Execute,
    Exit,
    Failed,
    FrameDecoder,
    FrameLimits,
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
    Ready,
    Returned,
    Teardown,
    TornDown,
    decode,
    encode,
    frame_cost,
    header_cost,
    job_limits,
)
from kcoral.wire.errors import instruction_error

#: Measurements (benchmark calls) one program may have the parent compute.
MAX_MEASUREMENTS = 1000

#: Bytes of each of the worker's own stdout/stderr kept for diagnostics.
TAIL_BYTES = 8192

#: How long a worker may take to report ready.
SPAWN_TIMEOUT_SECONDS = 60.0

#: How often a kill is tried again while a forked worker's pid is unknown.
KILL_RETRY_SECONDS = 0.05

#: How long a worker may take to exit once it answered L{TornDown} (it
#: leaves with C{os._exit}; its maintenance lease is held meanwhile).
EXIT_AFTER_TEARDOWN_SECONDS = 1.0


class WorkerStartError(Exception):
    """The worker failed or timed out before reporting ready."""


class _Tail:
    """The last few KiB of a byte stream."""

    def __init__(self, size: int = TAIL_BYTES) -> None:
        self._size = size
        self._data = bytearray()

    def add(self, data: bytes) -> None:
        self._data += data
        if len(self._data) > self._size:
            del self._data[: len(self._data) - self._size]

    def text(self) -> str:
        return self._data.decode("utf-8", "replace")


class WorkerProtocol(ProcessProtocol):
    """
    Routes a worker's fds: channel messages, output tails, the end.

    The channel is never trusted.  Frames are decoded under C{limits}
    (narrowed by L{WorkerProcess} to what its state allows), and the first
    frame that is over them, malformed or not a valid message goes to
    C{on_violation}; from then on nothing more is read from the channel, so
    the parent keeps at most one frame within the limits whatever the
    worker writes.

    With a C{budget} (L{kcoral.server.workers.channelbudget.ChannelBudget}, one for
    all workers), a frame over L{CONTROL_FRAME_BYTES} is read only once
    what it may cost (L{frame_cost}) is reserved there: until then the
    channel is not read.  Once its header is in, the reservation shrinks to
    its estimate (L{header_cost}; a header whose estimate is over the
    budget's decode share is refused); once the message is decoded it is
    given back, and what the message keeps (its parts and header objects)
    is counted as kept (L{ChannelBudget.keep}) until L{release_held} (its
    job's end).
    """

    def __init__(
        self,
        on_message: Callable[[ChannelMessage], None],
        on_violation: Callable[[str], None],
        descriptors: socket.socket | None = None,
        board: int | None = None,
    ) -> None:
        self._on_message = on_message
        self._on_violation = on_violation
        self._decoder = FrameDecoder(CONTROL_LIMITS, admit=self._admit, inspect=self._inspect)
        #: The server's budget for frames (C{None}: no budget).
        self.budget: ChannelBudget | None = None
        #: Reserved for the frame being read, and what its header keeps.
        self._frame_reserved = 0
        self._frame_keeps = 0
        #: Reserved for messages already handled, until L{release_held}.
        self.held = 0
        #: The reservation the channel waits for, while it is not read.
        self._waiting: Deferred[None] | None = None
        #: How a granted reservation resumes reading: C{call_later(0, f)}
        #: (the reactor's, set by L{WorkerProcess}), so the grant, made in
        #: another worker's release, does not run this worker's messages
        #: inside that one's; C{None}: at once.
        self.call_later: Callable[..., Any] | None = None
        #: The parent's end of the descriptor socket (non-blocking), or
        #: C{None}: a frame naming descriptors is then a violation.
        self.descriptors = descriptors
        #: The worker's progress board (L{kcoral.ipc.board}), or C{None}:
        #: the worker then announces instructions on the channel.
        self.board = board
        self.stdout_tail = _Tail()
        self.stderr_tail = _Tail()
        self.ended: Deferred[BaseException] = Deferred()
        self.channel_error: str | None = None
        #: The wire size of the frame whose message is being handled.
        self.frame_bytes = 0

    def set_limits(self, limits: FrameLimits) -> None:
        """What the next frames may be (see L{kcoral.wire.channel.job_limits})."""
        self._decoder.limits = limits

    @property
    def pending(self) -> int:
        """Channel bytes buffered for an incomplete frame."""
        return self._decoder.pending

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        if childFD == FROM_WORKER_FD:
            self._channel_data(data)
        elif childFD == 1:
            self.stdout_tail.add(data)
        elif childFD == 2:
            self.stderr_tail.add(data)

    def _channel_data(self, data: bytes) -> None:
        if self.channel_error is not None:
            return
        try:
            frames = self._decoder.feed(data)
        except ChannelError as e:
            self.violation(str(e))
            return
        for frame in frames:
            reserved, keeps = self._frame_reserved, self._frame_keeps
            self._frame_reserved = self._frame_keeps = 0
            try:
                message = decode(frame, self._take, self._decoder.limits.max_payload_bytes)
            except ChannelError as e:
                self._release(reserved)
                self.violation(str(e))
                return
            if reserved:
                # The frame is read; what the message keeps (its parts and
                # header objects) is counted until its job ends.
                self._release(reserved)
                kept = min(reserved, keeps + len(frame.payload))
                budget = self.budget
                if budget is not None and not budget.keep(kept):
                    self.violation(
                        f"a {frame.type!r} message keeps {kept} bytes of server memory, and the "
                        f"messages running programs keep are at the channel budget of "
                        f"{budget.limit} (--max-channel-bytes)"
                    )
                    return
                self.held += kept
            self.frame_bytes = frame.size
            self._on_message(message)
            if self.channel_error is not None:
                return

    # -- the server's channel budget -----------------------------------------

    def _admit(self, header_length: int, payload_length: int) -> bool:
        """
        Whether the frame announced may be read now (L{FrameDecoder.admit}):
        small ones always; others once their cost is reserved.
        """
        budget = self.budget
        size = header_length + payload_length
        if budget is None or size <= CONTROL_FRAME_BYTES or self._frame_reserved:
            return True
        if self._waiting is not None:
            return False
        cost = frame_cost(header_length, payload_length, budget.decode_share)
        if cost > budget.limit:
            raise ChannelError(
                f"a message of {size} bytes may take {cost} bytes of server memory to read, "
                f"over the channel budget of {budget.limit} (--max-channel-bytes)"
            )
        if budget.try_reserve(cost):
            self._frame_reserved = cost
            return True
        self._pause_channel()
        waiting = self._waiting = budget.reserve(cost)
        waiting.addCallbacks(lambda _: self._granted(cost), ignore_cancel)
        return False

    def _granted(self, cost: int) -> None:
        self._waiting = None
        self._frame_reserved = cost
        if self.channel_error is not None:
            self._release_frame()
            return
        self._resume_channel()
        if self.call_later is not None:
            self.call_later(0, self._channel_data, b"")
        else:
            self._channel_data(b"")

    def _inspect(self, buffer: bytearray, start: int, end: int) -> None:
        """
        A frame's header is in (L{FrameDecoder.inspect}): shrink its
        reservation from the worst case to the header's estimate, or refuse
        a header that may take more than the budget's decode share.
        """
        budget = self.budget
        if budget is None or not self._frame_reserved:
            return
        share = budget.decode_share
        length = end - start
        worst = HEADER_DECODE_FACTOR * length
        # (Counting stops once over the share: a dense header is refused
        # after one pass over it.)
        estimate = header_cost(buffer, start, end, limit=share if worst > share else None)
        if worst > share and estimate > share:
            raise ChannelError(
                f"a message header of {length} bytes may take over {share} bytes of server "
                "memory to decode, half the channel budget (--max-channel-bytes)"
            )
        keeps = min(estimate, worst)
        spare = min(worst, share) - keeps
        self._frame_keeps = keeps
        if spare > 0:
            self._frame_reserved -= spare
            self._release(spare)

    def _release(self, amount: int) -> None:
        if amount > 0 and self.budget is not None:
            self.budget.release(amount)

    def _release_frame(self) -> None:
        reserved, self._frame_reserved, self._frame_keeps = self._frame_reserved, 0, 0
        self._release(reserved)

    def release_held(self) -> None:
        """The job is over: what its messages kept is no longer counted."""
        held, self.held = self.held, 0
        if held and self.budget is not None:
            self.budget.release_kept(held)

    def _release_all(self) -> None:
        """The channel is done with: cancel a wait, release every reservation."""
        waiting, self._waiting = self._waiting, None
        if waiting is not None:
            waiting.cancel()
        self._release_frame()
        self.release_held()

    def _channel_pipe(self) -> Any:
        pipes = getattr(self.transport, "pipes", None)
        return None if pipes is None else pipes.get(FROM_WORKER_FD)

    def _pause_channel(self) -> None:
        pipe = self._channel_pipe()
        if pipe is not None:
            pipe.stopReading()

    def _resume_channel(self) -> None:
        pipe = self._channel_pipe()
        if pipe is not None and not pipe.disconnected:
            pipe.startReading()

    def processExited(self, reason: Failure) -> None:
        if self._waiting is not None:
            # The worker is gone while its frame waited for the budget: what
            # it wrote cannot be afforded and nobody will answer it.  Close
            # the pipe, so that the process's end is not held up by it.
            self._release_all()
            close = getattr(self.transport, "closeChildFD", None)
            if close is not None:
                try:
                    close(FROM_WORKER_FD)
                except Exception:
                    pass

    def _take(self, count: int) -> list[int]:
        """The descriptors of the frame being decoded (sent before it)."""
        if self.descriptors is None:
            raise SharedMemoryError("this worker has no descriptor socket")
        return receive_descriptors(self.descriptors, count)

    def drain(self) -> int:
        """Close whatever descriptors wait unclaimed; how many messages held them."""
        return 0 if self.descriptors is None else drain_descriptors(self.descriptors)

    def close_descriptors(self) -> None:
        """Close the descriptor socket (the worker is gone)."""
        sock, self.descriptors = self.descriptors, None
        if sock is not None:
            sock.close()

    def close_board(self) -> None:
        """Close the progress board (the worker is gone and its job told)."""
        progress, self.board = self.board, None
        if progress is not None:
            os.close(progress)

    def violation(self, reason: str) -> None:
        """
        The worker broke the channel: stop reading it, kill the process,
        and report C{reason} once.
        """
        if self.channel_error is not None:
            return
        self.channel_error = reason
        # Nothing more is read: the frame's reservation (or its wait) goes;
        # what earlier messages keep goes with their job.
        waiting, self._waiting = self._waiting, None
        if waiting is not None:
            waiting.cancel()
        self._release_frame()
        close = getattr(self.transport, "closeChildFD", None)
        if close is not None:
            try:
                close(FROM_WORKER_FD)
            except Exception:  # already closed
                pass
        self._kill_now()
        self._on_violation(reason)

    def _kill_now(self) -> None:
        try:
            if self.transport is not None:
                self.transport.signalProcess("KILL")
        except ProcessExitedAlready:
            pass

    def processEnded(self, reason: Failure) -> None:
        self._release_all()
        # Fire with the exception, not the Failure: a Failure passed to
        # callback() would run the errback chain instead.
        self.ended.callback(reason.value or Exception("process ended"))

    def output_tail(self) -> str:
        """The C{[out] …} / C{[err] …} tail for logs."""
        parts = []
        out, err = self.stdout_tail.text(), self.stderr_tail.text()
        if out:
            parts.append("[out] " + out[-4096:])
        if err:
            parts.append("[err] " + err[-4096:])
        return "\n".join(parts)


def _exit_code(value: BaseException) -> int | None:
    code = getattr(value, "exitCode", None)
    sig = getattr(value, "signal", None)
    if sig is not None:
        return -int(sig)
    return code if code is None else int(code)


#: How long a worker that may watch awake (L{WorkerProcess.grant_watch})
#: polls for its next program after it answered and settled: a sequential
#: client's next request reaches the same worker 1.5-3 ms later on an H200.
IDLE_WATCH_SECONDS = 0.01


@attrs.define(eq=False)
class WorkerProcess:
    """
    A worker process occupying a seat.

    Create with L{WorkerProcess.spawn}; C{ready} fires once it reported
    ready (or fails), C{ended} fires with the exit code when it is gone.
    """

    seat: str
    generation: int
    gpus: tuple[int, ...]
    _reactor: Any
    _leases: Any
    _grace_seconds: float
    protocol: WorkerProtocol = attrs.field(init=False)
    pid: int | None = None
    ready: Deferred[dict[str, Any]] = attrs.field(factory=Deferred)
    ended: Deferred[int | None] = attrs.field(factory=Deferred)
    info: dict[str, Any] = attrs.field(factory=dict)
    exit_code: int | None = None
    alive: bool = True
    started_at: float = 0.0
    _job: _RunningJob | None = None
    _ready_timer: IDelayedCall | None = None
    _kill_timer: IDelayedCall | None = None
    _killing: bool = False
    #: Runs this worker's L{CompileRequest}s (L{kcoral.server.workers.compiles}), or
    #: C{None}: they are answered C{unavailable}.
    compiler: Any = None
    #: How the process was made: C{"spawn"} or C{"fork"} (by a template).
    made: str = "spawn"
    #: Log C{instruction_started} and C{instruction_finished} (at DEBUG)
    #: for this worker's jobs: set when the server logs DEBUG.  Eight
    #: events for a four-instruction program cost the reactor about a fifth
    #: of its time per null request, so they are not made otherwise.
    trace_instructions: bool = False
    #: Tell this worker when its lease request is next in line
    #: (L{kcoral.wire.channel.LeaseNext}), so it watches for the grant
    #: awake, and let it watch for its next program awake for a moment
    #: (C{Execute.watch_next_seconds}): set where the machine has a core
    #: to spare for it.
    grant_watch: bool = False
    #: Asked as each program starts, where the worker may watch
    #: (C{grant_watch}): whether it watches for its next program after this
    #: one.  The pool says yes only while this is the one program it runs
    #: (L{WorkerPool.serving_one}): a sequential client waits for every
    #: wake-up, while under concurrency each answered worker would spin
    #: until the busy reactor feeds it, taking cores and clock from it.
    may_watch_next: Callable[[], bool] = attrs.field(default=lambda: True)
    #: The lease a GPU worker takes to warm up: C{None} (not asked),
    #: C{"pending"}, C{"held"} or C{"released"}.
    _startup_lease_state: str | None = None
    #: A context creation or teardown in progress: its kind (C{"create"} or
    #: C{"teardown"}), when it started (reactor time) and the pid it was
    #: logged with (its end is logged with the same one).
    _context_op: tuple[str, float, int | None] | None = None
    #: The orderly teardown: C{None}, C{"waiting"} (for the maintenance
    #: lease), C{"sent"} (L{Teardown} sent) or C{"done"} (L{TornDown} came).
    _teardown_state: str | None = None

    log = Logger()

    @classmethod
    def spawn(
        cls,
        reactor: Any,
        *,
        seat: str,
        generation: int,
        gpus: tuple[int, ...],
        leases: Any,
        executable: str,
        args: list[str],
        env: dict[str, str],
        grace_seconds: float,
        spawn_timeout: float = SPAWN_TIMEOUT_SECONDS,
    ) -> WorkerProcess:
        """Start the process; see C{ready} for when it can take a job."""
        worker = cls(seat, generation, gpus, reactor, leases, grace_seconds)
        theirs = worker._begin(reactor)
        try:
            transport = _spawn(
                reactor,
                worker.protocol,
                executable,
                args,
                env,
                worker_child_fds(theirs, worker.protocol.board),
            )
        except BaseException:
            worker._close_descriptors()
            raise
        finally:
            theirs.close()
        worker.pid = transport.pid
        worker._started(transport, spawn_timeout)
        return worker

    @classmethod
    def fork(
        cls,
        reactor: Any,
        *,
        seat: str,
        generation: int,
        gpus: tuple[int, ...],
        leases: Any,
        template: Any,
        args: list[str],
        env: dict[str, str],
        cwd: str,
        workspace: str | None,
        capture_bytes: int | None,
        grace_seconds: float,
        spawn_timeout: float = SPAWN_TIMEOUT_SECONDS,
        workspace_bytes: int | None = None,
    ) -> WorkerProcess:
        """
        Fork the worker from C{template} (a L{kcoral.server.workers.template.WorkerTemplate});
        otherwise as L{spawn}.  C{pid} is set once the template reports the fork.

        @raise kcoral.server.workers.template.TemplateError: the template cannot fork now.
        """
        worker = cls(seat, generation, gpus, reactor, leases, grace_seconds)
        worker.made = "fork"
        theirs = worker._begin(reactor)
        try:
            transport = template.fork_transport(
                worker.protocol,
                worker_child_fds(theirs, worker.protocol.board),
                argv=args,
                env=env,
                cwd=cwd,
                workspace=workspace,
                capture_bytes=capture_bytes,
                workspace_bytes=workspace_bytes,
                reader_factory=_WideReader if isinstance(reactor, PosixReactorBase) else None,
            )
        except BaseException:
            worker._close_descriptors()
            raise
        finally:
            theirs.close()

        def forked(pid: int | None) -> None:
            if pid is not None and worker.alive:
                worker.pid = pid

        transport.started.addCallback(forked)
        worker._started(transport, spawn_timeout)
        return worker

    def _close_descriptors(self) -> None:
        self.protocol.close_descriptors()
        self.protocol.close_board()

    def _begin(self, reactor: Any) -> socket.socket:
        """
        The protocol, with our end of the descriptor socket and the progress
        board (none where memfds cannot be sealed); returns the worker's end
        of the socket.
        """
        ours, theirs = socket_pair()
        ours.setblocking(False)
        try:
            progress: int | None = board.create() if shared_memory_available() else None
        except OSError:
            progress = None  # the worker announces instructions instead
        self.protocol = WorkerProtocol(self._message_received, self._poisoned, ours, progress)
        self.protocol.call_later = getattr(reactor, "callLater", None)
        self.protocol.ended.addCallback(self._process_ended)
        self.started_at = reactor.seconds()
        return theirs

    def _started(self, transport: Any, spawn_timeout: float) -> None:
        worker = self
        reactor = self._reactor
        try:
            transport.closeStdin()
        except Exception:  # a fake transport may not support it
            pass
        worker._ready_timer = IReactorTime(reactor).callLater(
            spawn_timeout, worker._ready_timed_out, spawn_timeout
        )

    # -- context creation and teardown on the lease -----------------------

    def _event(self, event: str, pid: int | None, **fields: Any) -> None:
        """Log context event C{event} of this worker."""
        self.log.info(
            "{kcoral_event} on GPU(s) {gpu_ids} for {worker_id}",
            kcoral_event=event,
            worker_id=self.seat,
            generation=self.generation,
            pid=pid,
            gpu_ids=list(self.gpus),
            **fields,
        )

    def _context_begin(self, kind: str) -> None:
        """A context creation or teardown starts (under the lease)."""
        if not self.gpus or self._context_op is not None:
            return
        grant = self._leases.grant_of(self)
        pid = grant.pid if grant is not None else self.pid
        self._context_op = (kind, float(self._reactor.seconds()), pid)
        if kind == "create":
            self._event("context_create_started", pid)
        else:
            self._event("context_teardown_started", pid)

    def _context_end(self, how: str) -> None:
        """The context creation or teardown in progress ended, C{how}."""
        op, self._context_op = self._context_op, None
        if op is None:
            return
        kind, started, pid = op
        ms = (float(self._reactor.seconds()) - started) * 1000.0
        if kind == "create":
            self._event("context_create_finished", pid, duration_ms=ms, how=how)
        else:
            self._event("context_teardown_finished", pid, duration_ms=ms, how=how)

    def retire(self) -> Deferred[int | None]:
        """
        Let a worker go that answered a retiring outcome (it waits for this).

        A CPU worker exits by itself.  A GPU worker's contexts are destroyed
        while the parent holds its GPUs' maintenance lease (shared with other
        creations and teardowns, never with a measurement): it is frozen
        (SIGSTOP: a thread its program left behind runs nothing while others
        hold the GPU), whatever it kept through its outcome is given back,
        the maintenance lease is taken, the worker thawed and sent
        L{Teardown}.  It answers L{TornDown} and exits.  The process ran a
        program, so its word is not trusted: the lease is held until the
        process is gone (L{EXIT_AFTER_TEARDOWN_SECONDS} after the answer,
        the grace without one, then SIGKILL under the lease); the parent's
        cleanup runs after, off the lease.  Fires when it has ended.
        """
        if not self.alive:
            return succeed(self.exit_code)
        if not self.gpus:
            if self._kill_timer is None and not self._killing:
                self._kill_timer = self._reactor.callLater(self._grace_seconds, self.kill_now)
            return self._ended_copy()
        if self._teardown_state is not None or self._killing:
            return self._ended_copy()
        self._teardown_state = "waiting"
        _signal_all(self._tree(), signal.SIGSTOP)
        self._leases.release(self)
        d = self._leases.acquire(
            self, self.gpus, label=f"context_teardown:{self.seat}", mode=MAINTENANCE
        )

        def granted(_: object) -> None:
            if not self.alive or self._teardown_state != "waiting":
                return
            self._teardown_state = "sent"
            self._context_begin("teardown")
            _signal_all(self._tree(), signal.SIGCONT)
            self.send(Teardown())
            self._kill_timer = self._reactor.callLater(self._grace_seconds, self.kill_now)

        def failed(f: Failure) -> None:
            if not f.check(CancelledError):
                # The GPU is quarantined or the server is stopping: no lease
                # will come, so the worker goes at once.
                self.kill_now()

        d.addCallbacks(granted, failed)
        return self._ended_copy()

    def _torn_down(self, message: TornDown) -> None:
        """
        The worker says its contexts are gone (C{destroyed}) or go with the
        process; either way the lease stays held until the process is gone,
        which may take only a moment now.
        """
        self._teardown_state = "done"
        if message.destroyed:
            self._context_end("destroyed")
        if self._kill_timer is not None and self._kill_timer.active():
            self._kill_timer.cancel()
        self._kill_timer = self._reactor.callLater(EXIT_AFTER_TEARDOWN_SECONDS, self.kill_now)

    def _under_lease(self, kill: Callable[[], None]) -> None:
        """
        Run C{kill} so the context teardown it causes overlaps no
        measurement: at once when this worker holds its GPUs (any mode) or
        has none; otherwise freeze its tree (SIGSTOP: it does nothing more),
        give up whatever it waits for, and kill once the maintenance lease
        is granted (at once if none can be).
        """
        if not self.gpus or self._leases.holds(self):
            self._context_begin("teardown")
            kill()
            return
        self._killing = True
        _signal_all(self._tree(), signal.SIGSTOP)
        self._leases.abandon(self)
        d = self._leases.acquire(
            self, self.gpus, label=f"context_teardown:{self.seat}", mode=MAINTENANCE
        )

        def granted(_: object) -> None:
            if self.alive:
                self._context_begin("teardown")
                self._kill_hard(self._tree())

        def failed(f: Failure) -> None:
            if self.alive:
                self._kill_hard(self._tree())

        d.addCallbacks(granted, failed)

    # -- lifecycle ---------------------------------------------------------

    def _ready_timed_out(self, timeout: float) -> None:
        self._ready_timer = None
        if not self.ready.called:
            self.ready.errback(
                WorkerStartError(f"worker {self.seat} timed out during start ({timeout:.0f}s)")
            )
            self.kill()

    def _process_ended(self, reason: BaseException) -> None:
        self.alive = False
        if self.pid is not None:
            # The worker led its own process group; whatever the program left
            # in it (a double-forked helper, say) goes with the worker.
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except OSError:
                pass
        self.exit_code = _exit_code(reason)
        if self._ready_timer is not None and self._ready_timer.active():
            self._ready_timer.cancel()
        if self._kill_timer is not None and self._kill_timer.active():
            self._kill_timer.cancel()
        if not self.ready.called:
            tail = self.protocol.output_tail()
            self.ready.errback(
                WorkerStartError(
                    f"worker {self.seat} exited with code {self.exit_code} during start"
                    + (f": {tail}" if tail else "")
                )
            )
        self.protocol.close_descriptors()
        job = self._job
        if job is not None:
            job.process_ended(self.exit_code, self.protocol.output_tail())
        self.protocol.close_board()  # after the job read where it ended
        self._context_end("exited")
        self._leases.abandon(self)
        self.ended.callback(self.exit_code)

    def _message_received(self, message: ChannelMessage) -> None:
        """
        Route one message; anything the current state does not expect
        poisons the worker (L{_poisoned}).
        """
        if not self.ready.called:
            if isinstance(message, Ready):
                if self._ready_timer is not None and self._ready_timer.active():
                    self._ready_timer.cancel()
                self.info = message.header()
                self.ready.callback(self.info)
                return
            if isinstance(message, Failed):
                self.ready.errback(WorkerStartError(message.error[:4096]))
                return
            if isinstance(message, LeaseAcquire) and self._startup_lease_state is None:
                # The worker warms up (creates its CUDA context) under the lease.
                self._startup_lease_state = "pending"
                self._startup_lease()
                return
        if isinstance(message, LeaseRelease) and self._startup_lease_state == "held":
            # Sent right after Ready: it may arrive once a job has started.
            self._startup_lease_state = "released"
            self._context_end("ready")
            self._leases.release(self)
            return
        if isinstance(message, TornDown) and self._teardown_state == "sent":
            self._torn_down(message)
            return
        if self._job is not None:
            self._job.message_received(message)
            return
        where = "between programs" if self.ready.called else "during start"
        self.protocol.violation(f"unexpected {message.TYPE!r} message {where}")

    def _poisoned(self, reason: str) -> None:
        """
        The worker broke the control channel (its protocol already stopped
        reading and killed it): fail its job or its start, never trust it again.
        """
        self.log.warn(
            "worker {worker_id} broke the control channel: {reason}",
            kcoral_event="worker_poisoned",
            worker_id=self.seat,
            generation=self.generation,
            pid=self.pid,
            request_id=None if self._job is None else self._job.job.request_id,
            reason=reason,
        )
        if self._job is not None:
            self._job.invalid_received(reason)
        if not self.ready.called:
            self.ready.errback(
                WorkerStartError(f"worker {self.seat} broke the control channel: {reason}")
            )
        self.kill_now()

    def _startup_lease(self) -> None:
        def granted(_: object) -> None:
            if self._startup_lease_state == "pending":
                self._startup_lease_state = "held"
                self._context_begin("create")
            self.send(LeaseGranted())

        if not self.gpus:
            granted(None)
            return
        # Context creations share the GPU with each other (batched), never
        # with a measurement (kcoral.server.leases.lease, maintenance mode).
        d = self._leases.acquire(
            self, self.gpus, label=f"context_create:{self.seat}", mode=MAINTENANCE
        )
        d.addCallbacks(
            granted,
            lambda f: None if f.check(CancelledError) else self.kill(),
        )

    def send(self, message: ChannelMessage, *, now: bool = False) -> None:
        """
        Write one message to the worker (buffered by the transport); the
        descriptors of its shared buffers go first, on the descriptor socket.

        @param now: write it in this reactor turn rather than the next one
            (a lease grant or a program start: the worker, and with a grant
            the GPU, waits for it, and the next turn may first serve other
            connections for a millisecond or more).
        """
        transport = self.protocol.transport
        if not self.alive or transport is None:
            return
        if TO_WORKER_FD not in getattr(transport, "pipes", {TO_WORKER_FD: None}):
            # The worker closed its end (it is exiting; the end is not
            # reaped yet): nothing can reach it any more.
            return
        shared = message.descriptors()
        if shared:
            sock = self.protocol.descriptors
            try:
                if sock is None:
                    raise OSError("the worker has no descriptor socket")
                send_descriptors(sock, [buffer.fileno() for buffer in shared])
            except OSError as e:
                # Full (a worker that does not read it) or closed.
                self.protocol.violation(f"cannot pass descriptors to the worker: {e}")
                return
        transport.writeToChild(TO_WORKER_FD, encode(message))
        if now:
            _flush(transport, TO_WORKER_FD)

    def run(
        self, job: Job, on_instruction: Callable[[int], None] | None = None
    ) -> Deferred[JobResult]:
        """Run C{job}; the Deferred fires with a L{JobResult}, never fails."""
        if self._job is not None:
            raise RuntimeError(f"worker {self.seat} is already running a job")
        running = _RunningJob(self, job, on_instruction)
        self._job = running
        self.protocol.set_limits(job_limits(job.max_response_bytes, job.output_limit))
        running.done.addBoth(self._job_done)
        running.start()
        return running.done

    @property
    def busy(self) -> bool:
        """Whether a job is running on this worker."""
        return self._job is not None

    def _job_done(self, result: JobResult) -> JobResult:
        self._job = None
        if self.protocol.held:
            # What the job's messages keep is released once the answer is
            # made from them (the callbacks after this one, at once).
            IReactorTime(self._reactor).callLater(0, self.protocol.release_held)
        # After its outcome a worker has nothing to say until the next job.
        self.protocol.set_limits(CONTROL_LIMITS)
        if self.alive and self.protocol.drain():
            # Descriptors sent after the outcome (a thread the program left
            # running), to be taken for the next request's parts.
            self.protocol.violation("sent descriptors that no message named")
        return result

    def stop(self) -> Deferred[int | None]:
        """
        Ask for an orderly exit; SIGKILL whatever is left after the grace
        period.  One grace in all: the worker had it to exit by itself.
        """
        if not self.alive:
            return succeed(self.exit_code)
        if not self._killing:
            self.send(Exit())
            self._kill_timer = self._reactor.callLater(self._grace_seconds, self.kill_now)
        return self._ended_copy()

    @property
    def request_id(self) -> str | None:
        """The request whose program runs now, if any (the GPU monitor's reports name it)."""
        return None if self._job is None else self._job.job.request_id

    def gpu_violation(self, reason: str, location: str = "") -> None:
        """
        The GPU monitor saw this worker's program break the lease (a process
        it started used a GPU: L{kcoral.server.leases.monitor}): its program
        fails with C{gpu_access} (C{reason}; C{location} names the process),
        and the worker is killed.
        """
        if not self.alive:
            return
        if self._job is not None and self._job.gpu_violation(reason, location):
            return
        self.protocol.violation(reason)

    def kill_now(self) -> None:
        """
        SIGKILL the worker's whole tree at once (its grace is spent); a GPU
        worker not holding its GPUs is frozen at once and killed under the
        maintenance lease (L{_under_lease}).
        """
        if not self.alive:
            return
        if self._kill_timer is not None and self._kill_timer.active():
            self._kill_timer.cancel()
        if self._killing and self._context_op is None and self.gpus:
            # Frozen, waiting for the maintenance lease: that kill stands.
            if not self._leases.holds(self):
                return
        self._killing = True
        self._under_lease(lambda: self._kill_hard(self._tree()))

    def kill_at_once(self) -> None:
        """SIGKILL the whole tree without waiting for any lease (a forced shutdown)."""
        if not self.alive:
            return
        if self._kill_timer is not None and self._kill_timer.active():
            self._kill_timer.cancel()
        self._killing = True
        self._kill_hard(self._tree())

    def kill(self) -> Deferred[int | None]:
        """
        SIGTERM the worker's whole tree, SIGKILL whatever is left after the
        grace; a GPU worker not holding its GPUs is killed under the
        maintenance lease instead (L{_under_lease}).
        """
        if not self.alive:
            return succeed(self.exit_code)
        if not self._killing:

            def terminate() -> None:
                victims = self._tree()
                _signal_all(victims, signal.SIGTERM)
                if self._kill_timer is not None and self._kill_timer.active():
                    self._kill_timer.cancel()
                self._kill_timer = self._reactor.callLater(
                    self._grace_seconds, self._kill_hard, victims
                )

            self._under_lease(terminate)
            self._killing = True
        return self._ended_copy()

    def _kill_hard(self, victims: list[psutil.Process]) -> None:
        self._kill_timer = None
        _signal_all(victims + self._tree(), signal.SIGKILL)
        if self.alive and self.pid is None:
            # Forked by a template that has not told us the pid yet: there
            # was nothing to signal, so try again until there is (a kill
            # asked for must happen; nothing else would retry it).
            self._kill_timer = self._reactor.callLater(KILL_RETRY_SECONDS, self._kill_hard, [])

    def _tree(self) -> list[psutil.Process]:
        """
        The worker and its descendants, parents first.  Read from procfs
        (L{kcoral.proctree}): this runs on the reactor as a worker retires,
        and psutil's full scan took milliseconds of every answer.
        """
        if self.pid is None:
            return []
        try:
            root = psutil.Process(self.pid)
        except psutil.Error:
            return []
        pids = descendants_of(self.pid)
        if pids is None:
            try:
                return [root, *root.children(recursive=True)]
            except psutil.Error:
                return [root]
        tree = [root]
        for pid in pids:
            try:
                tree.append(psutil.Process(pid))
            except psutil.Error:
                pass  # gone since it was listed
        return tree

    def _ended_copy(self) -> Deferred[int | None]:
        d: Deferred[int | None] = Deferred()

        def fire(code: int | None) -> int | None:
            d.callback(code)
            return code

        self.ended.addCallback(fire)
        return d

    def descendants_alive(self) -> list[int]:
        """Pids of processes still descending from this worker (orphan check)."""
        return [p.pid for p in self._tree()[1:]]


#: Bytes read from a worker pipe per reactor wakeup.  Twisted's process
#: reader reads 8 KiB at a time, which makes a 64 MiB tensor cost thousands
#: of reactor iterations; the channel pipes are 1 MiB (the worker widens them).
READ_SIZE = 1 << 20


class _WideReader(process.ProcessReader):
    """A process pipe reader that takes up to L{READ_SIZE} bytes per read."""

    def doRead(self) -> Any:
        try:
            data = os.read(self.fd, READ_SIZE)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EINTR):
                return None
            return main.CONNECTION_LOST
        if not data:
            return main.CONNECTION_DONE
        self.dataReceived(data)
        return None


def _flush(transport: Any, fd: int) -> None:
    """
    Write what the transport holds for pipe C{fd} now, as the reactor
    would once the pipe is writable (L{IWriteDescriptor.doWrite}); what
    does not fit stays buffered for the reactor, and an error is left for
    the reactor to find on its own next write.
    """
    writer = getattr(transport, "pipes", {}).get(fd)
    if writer is not None:
        writer.doWrite()


class _WorkerTransport(process.Process):
    """Twisted's POSIX process transport with L{_WideReader} pipes."""

    processReaderFactory = _WideReader


def _spawn(
    reactor: Any,
    protocol: ProcessProtocol,
    executable: str,
    args: list[str],
    env: dict[str, str],
    child_fds: dict[int, Any],
) -> Any:
    """
    C{spawnProcess} with wide pipe reads on a real POSIX reactor; any other
    reactor (a test's fake included) gets a plain C{spawnProcess}.
    """
    if isinstance(reactor, PosixReactorBase) and platform.isLinux():
        return _WorkerTransport(
            reactor, executable, args, env, None, protocol, None, None, child_fds
        )
    return IReactorProcess(reactor).spawnProcess(
        protocol, executable, args, env=env, childFDs=child_fds
    )


def _signal_all(processes: list[psutil.Process], signum: int) -> None:
    for victim in processes:
        try:
            victim.send_signal(signum)
        except psutil.Error:
            pass
    # Workers run in their own session; signal the group too, in case a
    # child escaped the tree walk between listing and signalling.
    if processes:
        try:
            os.killpg(processes[0].pid, signum)
        except (OSError, ProcessLookupError):
            pass


@attrs.define(eq=False)
class _RunningJob:
    """The parent's side of one job: messages, lease, budget."""

    worker: WorkerProcess
    job: Job
    on_instruction: Callable[[int], None] | None
    done: Deferred[JobResult] = attrs.field(factory=Deferred)
    instruction_index: int | None = None
    instruction_started: dict[int, float] = attrs.field(factory=dict)
    remaining: float = 0.0
    _budget_started: float | None = None
    _timer: IDelayedCall | None = None
    _lease_request: Deferred[Any] | None = None
    _lease_wait: float = 0.0
    _lease_held: float = 0.0
    _held_since: float | None = None
    #: C{"none"}, C{"pending"} (asked, not granted yet) or C{"held"}.
    _lease_state: str = "none"
    #: A L{CompileRequest} runs in the parent: the worker waits for it.
    _compiling: bool = False
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
        self.remaining = self.job.timeout_seconds
        progress = self._board()
        if progress is not None:
            board.clear(progress)  # what the last program posted
        # Instructions are posted on the board, unless there is none or
        # the operator traces them (their events need the messages).
        messages = self.job.messages(
            announce=progress is None or bool(getattr(self.worker, "trace_instructions", False)),
            watch_next=IDLE_WATCH_SECONDS
            if self.worker.grant_watch and self.worker.may_watch_next()
            else 0.0,
        )
        budget = getattr(getattr(self.worker, "protocol", None), "budget", None)
        if budget is not None and isinstance(messages[-1], Execute):
            # Results too costly for the parent to decode are left out
            # (oversize) by the worker, not refused here.
            messages[-1] = attrs.evolve(messages[-1], max_decode_bytes=budget.decode_share)
        for message in messages[:-1]:
            self.worker.send(message)
        self.worker.send(messages[-1], now=True)
        self._resume_budget()

    def _board(self) -> int | None:
        return getattr(getattr(self.worker, "protocol", None), "board", None)

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
        return float(self.worker._reactor.seconds())

    def _resume_budget(self) -> None:
        self._budget_started = self._clock()
        self._timer = self.worker._reactor.callLater(max(self.remaining, 0.0), self._timed_out)

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
        compiler = self.worker.compiler
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

        def answer(done: CompileDone) -> None:
            self._compiling = False
            if not self.done.called:
                self.worker.send(done)

        d.addCallbacks(
            answer, lambda f: answer(CompileDone(kind="engine", error=f.getErrorMessage()))
        )

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
        monitor = getattr(self.worker._leases, "monitor", None)
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

        d.addCallback(judged)
        d.addErrback(lambda f: self.worker.log.failure("the GPU monitor failed", f))
        d.addCallback(send)

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
        if not self.worker.trace_instructions:
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

        def wake(grant: Any) -> None:
            # The worker and the GPU wait: the grant goes out before the
            # arbiter logs the hand-over.
            if not self.done.called:
                self.worker.send(LeaseGranted(), now=True)

        def next_in_line() -> None:
            if not self.done.called:
                self.worker.send(LeaseNext())

        d = self.worker._leases.acquire(
            self.worker,
            self.worker.gpus,
            label=self.job.request_id,
            wake=wake,
            next_in_line=next_in_line if self.worker.grant_watch else None,
        )
        self._lease_request = d

        def granted(grant: Any) -> None:
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
        self.worker._leases.release(self.worker)

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


def worker_child_fds(descriptors: socket.socket, progress: int | None = None) -> dict[int, Any]:
    """
    What a worker's fds are, for C{spawnProcess}'s C{childFDs}: stdin (closed
    at once), stdout and stderr (read for diagnostics), and the control
    channel's fds (L{kcoral.wire.channel.WORKER_CHANNEL_FDS}), the descriptor
    socket being the worker's end C{descriptors} and the progress board
    C{progress} (left out when there is none).
    """
    fds: dict[int, Any] = {0: "w", 1: "r", 2: "r"}
    for fd, role in WORKER_CHANNEL_FDS.items():
        if role == "socket":
            fds[fd] = descriptors.fileno()
        elif role == "board":
            if progress is not None:
                fds[fd] = progress
        else:
            fds[fd] = role
    return fds


def worker_command_args(device: str, *, tensor_api: str) -> list[str]:
    """
    The worker's own arguments (after C{python -m kcoral.worker}).  How many
    programs it serves is the parent's to decide, job by job (L{Job.last}).
    """
    return [
        "--device",
        device,
        "--tensor-api",
        tensor_api,
    ]
