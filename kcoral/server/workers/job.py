# -*- test-case-name: tests.unit.test_wire_shared,tests.unit.test_workerproc -*-
"""
What the pool hands a worker and what it gets back: L{Job} (one program to
run) and L{JobResult} (how it ended), and L{WorkerHandle}, what the pool
uses of a worker process.  A leaf: it imports nothing of the pool or of the
worker process, so both (and the HTTP application) can name it.
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs
from twisted.internet.defer import Deferred

from kcoral.ipc.shared import SharedBuffer
from kcoral.wire.channel import Blob, ChannelMessage, Execute, Outcome
from kcoral.wire.program import Program

#: Blobs of one job passed to the worker as descriptors, at most.
MAX_SHARED_BLOBS = 64


@attrs.frozen
class Job:
    """
    One program for a worker to run: what L{Execute} and its L{Blob}s carry,
    plus what only the parent needs (the parsed program, the time budget).
    """

    request_id: str
    program_text: str
    program: Program
    blobs: dict[str, bytes | SharedBuffer]
    timeout_seconds: float
    output_limit: int
    max_response_bytes: int
    workspace: str = ""
    reserved: str | None = None
    #: The worker's last program (L{Execute.last}): the pool sets it, from
    #: the requests its worker served and C{--max-requests-per-worker}.
    last: bool = True

    def messages(self, announce: bool = True, watch_next: float = 0.0) -> list[ChannelMessage]:
        """
        The blobs, then the L{Execute} message, in sending order.  At most
        L{MAX_SHARED_BLOBS} blobs go as descriptors (the descriptor socket
        queues a few hundred messages before the worker reads them); any
        more travel inline.
        """
        blobs: list[ChannelMessage] = []
        shared = 0
        for digest, data in self.blobs.items():
            if isinstance(data, SharedBuffer):
                if shared >= MAX_SHARED_BLOBS:
                    data = data.tobytes()
                else:
                    shared += 1
            blobs.append(Blob(digest, data))
        return [
            *blobs,
            Execute(
                program=self.program_text,
                workspace=self.workspace,
                request_id=self.request_id,
                output_limit=self.output_limit,
                max_response_bytes=self.max_response_bytes,
                reserved=self.reserved,
                timeout_seconds=float(self.timeout_seconds),
                announce=announce,
                watch_next_seconds=watch_next,
                last=self.last,
            ),
        ]


@attrs.frozen
class JobResult:
    """
    How a job ended, as seen by the parent.

    C{ending} is C{"outcome"} (the worker answered with C{outcome}),
    C{"crashed"} (the process died; C{instruction_index} says where, if known),
    C{"timeout"} (the budget ran out and the worker is being killed) or
    C{"invalid"} (the worker broke the control channel: a frame over its
    limits, a malformed message, or one out of order; C{detail} says which,
    and the worker is being killed).
    """

    ending: str
    outcome: Outcome | None = None
    instruction_index: int | None = None
    exit_code: int | None = None
    output_tail: str = ""
    lease_wait_seconds: float = 0.0
    lease_held_seconds: float = 0.0
    #: When each announced instruction started, and when the job ended
    #: (reactor time), to tell which request held the GPU meanwhile.
    instruction_started: dict[int, float] = attrs.field(factory=dict)
    ended_at: float = 0.0
    detail: str = ""
    #: Returns the worker finished before it crashed (C{returned} messages):
    #: their results and binary parts, kept for the answer.
    results: dict[str, Any] = attrs.field(factory=dict)
    parts: tuple[bytes | SharedBuffer, ...] = ()
    #: The parent's own record of every measurement it computed for the
    #: program (L{kcoral.measurement}), in order: the response carries them.
    measurements: tuple[dict[str, Any], ...] = ()


class WorkerHandle(Protocol):
    """
    What the pool, and a request holding a seat, use of a worker process:
    L{kcoral.server.workers.workerproc.WorkerProcess}, or a fake in tests.
    """

    #: The name it answers to in logs and leases: its seat's (a spare's
    #: until a seat adopts it), and that seat's generation.
    seat: str
    generation: int

    @property
    def pid(self) -> int | None: ...
    @property
    def alive(self) -> bool: ...
    @property
    def busy(self) -> bool: ...
    @property
    def started_at(self) -> float: ...
    @property
    def info(self) -> dict[str, Any]: ...
    @property
    def ready(self) -> Deferred[dict[str, Any]]: ...
    @property
    def ended(self) -> Deferred[int | None]: ...

    def run(self, job: Job) -> Deferred[JobResult]: ...
    def kill(self) -> Deferred[int | None]: ...
    def kill_now(self) -> None: ...
    def kill_at_once(self) -> None: ...
    def retire(self) -> Deferred[int | None]: ...
    def stop(self) -> Deferred[int | None]: ...
