# -*- test-case-name: tests.unit.test_worker_engine -*-
"""
The worker's side of the parent's GPU lease (spec/server.md §4.3).

L{LeaseClient} speaks L{LeaseAcquire} / L{LeaseGranted} / L{LeaseRelease}
over the control channel; L{NullLease} is the no-op lease of CPU workers.
"""

from __future__ import annotations

import os
import sys
from typing import IO

import attrs
from zope.interface import implementer

from kcoral.wire.channel import (
    LeaseAcquire,
    LeaseGranted,
    LeaseRelease,
    read_message,
    write_message,
)
from kcoral.worker.interfaces import ILeaseClient


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

    def release(self) -> None:
        """Give the lease back (no answer is expected)."""
        if not self.held:
            return
        write_message(self._outbox, LeaseRelease())
        self.held = False
