# -*- test-case-name: tests.unit.test_workerproc -*-
"""
One worker process, seen from the reactor.

L{WorkerProcess} spawns C{python -m kcoral.worker} (inside the sandbox's
command line) or forks it from a template, waits for its L{Ready} message,
runs jobs over the control channel (L{kcoral.wire.channel}), creates and
tears down its GPU contexts on the maintenance lease, and kills the whole
process tree when asked: SIGTERM, then SIGKILL after the grace period.  How
the pool wants it run is a L{WorkerSettings}, given when it is made.

Its parts: L{kcoral.server.workers.workerprotocol} (the descriptors and the
distrusted channel), L{kcoral.server.workers.runningjob} (one program: its
messages, lease and execution budget) and L{kcoral.server.workers.processes}
(spawning with wide pipe reads, the process tree and its signals).
"""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import psutil
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.interfaces import (
    IDelayedCall,
    IProcessTransport,
    IReactorProcess,
    IReactorTime,
)
from twisted.internet.posixbase import PosixReactorBase
from twisted.logger import Logger
from twisted.python.failure import Failure

from kcoral.ipc import board
from kcoral.ipc.shared import available as shared_memory_available
from kcoral.ipc.shared import send_descriptors, socket_pair
from kcoral.server.leases.lease import MAINTENANCE, Leases
from kcoral.server.workers.channelbudget import ChannelBudget
from kcoral.server.workers.job import Job, JobResult
from kcoral.server.workers.processes import (
    WideReader,
    exit_code_of,
    flush_pipe,
    process_tree,
    signal_all,
    spawn_process,
    worker_child_fds,
)
from kcoral.server.workers.runningjob import RunningJob
from kcoral.server.workers.workerprotocol import WorkerProtocol
from kcoral.wire.channel import (
    CONTROL_LIMITS,
    TO_WORKER_FD,
    ChannelMessage,
    Exit,
    Failed,
    LeaseAcquire,
    LeaseGranted,
    LeaseRelease,
    Ready,
    Teardown,
    TornDown,
    encode,
    job_limits,
)

if TYPE_CHECKING:
    from kcoral.server.workers.compiles import IsolatedCompiles
    from kcoral.server.workers.template import WorkerTemplate

#: How long a worker may take to report ready.
SPAWN_TIMEOUT_SECONDS = 60.0

#: How often a kill is tried again while a forked worker's pid is unknown.
KILL_RETRY_SECONDS = 0.05

#: How long a worker may take to exit once it answered L{TornDown} (it
#: leaves with C{os._exit}; its maintenance lease is held meanwhile).
EXIT_AFTER_TEARDOWN_SECONDS = 1.0


class WorkerStartError(Exception):
    """The worker failed or timed out before reporting ready."""


@attrs.frozen(kw_only=True)
class WorkerSettings:
    """
    How the pool wants a worker run, given when it is made
    (L{WorkerProcess.spawn}, L{WorkerProcess.fork}) and fixed for its life.
    """

    #: Seconds between SIGTERM (or an asked-for exit) and SIGKILL.
    grace_seconds: float
    #: How long the worker may take to report ready.
    spawn_timeout: float = SPAWN_TIMEOUT_SECONDS
    #: Runs this worker's L{CompileRequest}s (an
    #: L{kcoral.server.workers.compiles.IsolatedCompiles}), or C{None}:
    #: they are answered C{unavailable}.
    compiler: IsolatedCompiles | None = None
    #: The server's budget for large channel frames
    #: (L{WorkerProtocol.budget}), or C{None}: no budget.
    channel_budget: ChannelBudget | None = None
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
    may_watch_next: Callable[[], bool] = lambda: True


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
    _reactor: IReactorTime
    _leases: Leases
    settings: WorkerSettings
    protocol: WorkerProtocol = attrs.field(init=False)
    pid: int | None = None
    ready: Deferred[dict[str, Any]] = attrs.field(factory=Deferred)
    ended: Deferred[int | None] = attrs.field(factory=Deferred)
    info: dict[str, Any] = attrs.field(factory=dict)
    exit_code: int | None = None
    alive: bool = True
    started_at: float = 0.0
    _job: RunningJob | None = None
    _ready_timer: IDelayedCall | None = None
    _kill_timer: IDelayedCall | None = None
    _killing: bool = False
    #: How the process was made: C{"spawn"} or C{"fork"} (by a template).
    made: str = "spawn"
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
        reactor: IReactorProcess,
        *,
        seat: str,
        generation: int,
        gpus: tuple[int, ...],
        leases: Leases,
        executable: str,
        args: list[str],
        env: dict[str, str],
        settings: WorkerSettings,
    ) -> WorkerProcess:
        """Start the process; see C{ready} for when it can take a job."""
        worker = cls(seat, generation, gpus, IReactorTime(reactor), leases, settings)
        theirs = worker._begin()
        try:
            transport = spawn_process(
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
        worker._started(transport)
        return worker

    @classmethod
    def fork(
        cls,
        reactor: IReactorTime,
        *,
        seat: str,
        generation: int,
        gpus: tuple[int, ...],
        leases: Leases,
        template: WorkerTemplate,
        args: list[str],
        env: dict[str, str],
        cwd: str,
        workspace: str | None,
        capture_bytes: int | None,
        settings: WorkerSettings,
        workspace_bytes: int | None = None,
    ) -> WorkerProcess:
        """
        Fork the worker from C{template} (a L{kcoral.server.workers.template.WorkerTemplate});
        otherwise as L{spawn}.  C{pid} is set once the template reports the fork.

        @raise kcoral.server.workers.template.TemplateError: the template cannot fork now.
        """
        worker = cls(seat, generation, gpus, reactor, leases, settings, made="fork")
        theirs = worker._begin()
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
                reader_factory=WideReader if isinstance(reactor, PosixReactorBase) else None,
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
        worker._started(transport)
        return worker

    def _close_descriptors(self) -> None:
        self.protocol.close_descriptors()
        self.protocol.close_board()

    def _begin(self) -> socket.socket:
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
        self.protocol.budget = self.settings.channel_budget
        self.protocol.call_later = self._reactor.callLater
        self.protocol.ended.addCallback(self._process_ended)
        self.started_at = self._reactor.seconds()
        return theirs

    def _started(self, transport: IProcessTransport) -> None:
        try:
            transport.closeStdin()
        except Exception:  # a fake transport may not support it
            pass
        timeout = self.settings.spawn_timeout
        self._ready_timer = self._reactor.callLater(timeout, self._ready_timed_out, timeout)

    # -- context creation and teardown on the lease -----------------------

    def _event(self, event: str, pid: int | None, **fields: object) -> None:
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
                self._kill_timer = self._reactor.callLater(
                    self.settings.grace_seconds, self.kill_now
                )
            return self._ended_copy()
        if self._teardown_state is not None or self._killing:
            return self._ended_copy()
        self._teardown_state = "waiting"
        signal_all(self._tree(), signal.SIGSTOP)
        self._leases.release(self)
        d = self._leases.acquire(
            self, self.gpus, label=f"context_teardown:{self.seat}", mode=MAINTENANCE
        )

        def granted(_: object) -> None:
            if not self.alive or self._teardown_state != "waiting":
                return
            self._teardown_state = "sent"
            self._context_begin("teardown")
            signal_all(self._tree(), signal.SIGCONT)
            self.send(Teardown())
            self._kill_timer = self._reactor.callLater(self.settings.grace_seconds, self.kill_now)

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
        signal_all(self._tree(), signal.SIGSTOP)
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
        self.exit_code = exit_code_of(reason)
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

        def failed(f: Failure) -> None:
            if not f.check(CancelledError):
                self.kill()

        d.addCallbacks(granted, failed)

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
            flush_pipe(transport, TO_WORKER_FD)

    def run(
        self, job: Job, on_instruction: Callable[[int], None] | None = None
    ) -> Deferred[JobResult]:
        """Run C{job}; the Deferred fires with a L{JobResult}, never fails."""
        if self._job is not None:
            raise RuntimeError(f"worker {self.seat} is already running a job")
        running = RunningJob(self, job, on_instruction, self._reactor, self._leases)
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
        if self._job is not None:
            # However it ended (a cancelled wait included): no compile
            # goes on for it.
            self._job.stop_compile()
        self._job = None
        if self.protocol.held:
            # What the job's messages keep is released once the answer is
            # made from them (the callbacks after this one, at once).
            self._reactor.callLater(0, self.protocol.release_held)
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
            self._kill_timer = self._reactor.callLater(self.settings.grace_seconds, self.kill_now)
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
                signal_all(victims, signal.SIGTERM)
                if self._kill_timer is not None and self._kill_timer.active():
                    self._kill_timer.cancel()
                self._kill_timer = self._reactor.callLater(
                    self.settings.grace_seconds, self._kill_hard, victims
                )

            self._under_lease(terminate)
            self._killing = True
        return self._ended_copy()

    def _kill_hard(self, victims: list[psutil.Process]) -> None:
        self._kill_timer = None
        signal_all(victims + self._tree(), signal.SIGKILL)
        if self.alive and self.pid is None:
            # Forked by a template that has not told us the pid yet: there
            # was nothing to signal, so try again until there is (a kill
            # asked for must happen; nothing else would retry it).
            self._kill_timer = self._reactor.callLater(KILL_RETRY_SECONDS, self._kill_hard, [])

    def _tree(self) -> list[psutil.Process]:
        """The worker and its descendants, parents first (L{process_tree})."""
        return process_tree(self.pid)

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
