# -*- test-case-name: tests.unit.test_workerproc -*-
"""
L{WorkerProtocol}: a worker process's descriptors seen from the reactor.

It routes the worker's control channel (decoded under limits, every frame
distrusted, large frames admitted against the server's channel budget), its
descriptor socket and progress board, and the tails of its own stdout and
stderr kept for diagnostics; it fires C{ended} when the process is gone.
L{kcoral.server.workers.workerproc.WorkerProcess} owns one per worker.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure

from kcoral.ipc.channel_io import take_shared
from kcoral.ipc.shared import SharedBuffer, drain_descriptors
from kcoral.server.workers.channelbudget import ChannelBudget, ignore_cancel
from kcoral.wire.channel import (
    CONTROL_FRAME_BYTES,
    CONTROL_LIMITS,
    FROM_WORKER_FD,
    HEADER_DECODE_FACTOR,
    ChannelError,
    ChannelMessage,
    FrameDecoder,
    FrameLimits,
    decode,
    frame_cost,
    header_cost,
)

#: Bytes of each of the worker's own stdout/stderr kept for diagnostics.
TAIL_BYTES = 8192


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
        self.call_later: Callable[..., object] | None = None
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

    def _take(self, sizes: list[int]) -> list[SharedBuffer]:
        """The shared buffers of the frame being decoded (their descriptors sent before it)."""
        return take_shared(self.descriptors, sizes)

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
