# -*- test-case-name: tests.unit.test_worker_engine -*-
"""
The worker's side of the parent's GPU lease (spec/server.md §4.3).

L{LeaseClient} speaks L{LeaseAcquire} / L{LeaseGranted} / L{LeaseRelease}
over the control channel; L{NullLease} is the no-op lease of CPU workers.
"""

from __future__ import annotations

import os
import sys
import time
from typing import IO

import attrs
from zope.interface import implementer

from kcoral.ipc.channel_io import read_message, write_message
from kcoral.wire.channel import (
    LeaseAcquire,
    LeaseGranted,
    LeaseNext,
    LeaseRelease,
)
from kcoral.worker.interfaces import ILeaseClient

#: How long a worker told it is next polls for its grant before it sleeps.
GRANT_WATCH_SECONDS = 0.02


@implementer(ILeaseClient)
@attrs.define
class NullLease:
    """A lease that is always available: acquiring and releasing do no I/O."""

    held: bool = False

    def acquire(self) -> None:
        self.held = True

    def release(self) -> None:
        self.held = False


@implementer(ILeaseClient)
@attrs.define
class LeaseClient:
    """
    The lease over the control channel.

    @ivar _inbox: the parent-to-worker stream (fd 3).
    @ivar _outbox: the worker-to-parent stream (fd 4).
    """

    _inbox: IO[bytes]
    _outbox: IO[bytes]
    held: bool = False

    def acquire(self) -> None:
        """
        Ask for the lease and block until L{LeaseGranted} arrives.

        If the parent goes away while we wait there is nobody to answer, so
        the process exits at once.
        """
        if self.held:
            return
        write_message(self._outbox, LeaseAcquire())
        while True:
            message = read_message(self._inbox)
            if message is None:
                sys.stderr.write("kcoral worker: parent closed the channel during a lease wait\n")
                sys.stderr.flush()
                os._exit(1)
            if isinstance(message, LeaseGranted):
                self.held = True
                return
            if isinstance(message, LeaseNext):
                self._watch_for_grant()

    def _watch_for_grant(self) -> None:
        """
        Watch for the grant awake for up to L{GRANT_WATCH_SECONDS}: it is
        next, and a process asleep in C{read} wakes tens of microseconds
        after it arrives (bench/probes/wake_probe.py), all of it GPU time lost.
        The parent sends L{LeaseNext} only where a core is spare for it.
        """
        watch_inbox(self._inbox, GRANT_WATCH_SECONDS)

    def release(self) -> None:
        """Give the lease back (no answer is expected)."""
        if not self.held:
            return
        write_message(self._outbox, LeaseRelease())
        self.held = False


def watch_inbox(inbox: IO[bytes], seconds: float) -> bool:
    """
    Poll C{inbox} (a buffered stream), yielding the CPU between polls, until
    a byte is there or C{seconds} pass; whether one is.  The stream is left
    blocking, and what was read into its buffer stays there for the next read.
    """
    fd = inbox.fileno()
    os.set_blocking(fd, False)
    try:
        deadline = time.monotonic() + seconds
        # peek on a non-blocking stream: what is buffered, else one read.
        while not inbox.peek(1):  # type: ignore[attr-defined]
            if time.monotonic() > deadline:
                return False
            os.sched_yield()
        return True
    finally:
        os.set_blocking(fd, True)
