# -*- test-case-name: tests.unit.test_board -*-
"""
The progress board: eight bytes of shared memory where a worker posts the
index of the instruction it is about to run.

The parent needs that index only when a program ends without an outcome
(the process died, or its budget ran out), to say which instruction did
it.  Announcing every instruction on the control channel cost the
reactor a message per instruction (four for a null program, about a tenth
of its time per request at saturation); a store into a shared page costs
the worker nothing and the parent nothing until it reads the board.

The parent makes the board (a memfd, sealed against shrinking and
growing, so a program that truncates it cannot make the parent's read
fail or fault) and passes it as fd L{kcoral.wire.channel.PROGRESS_FD}.
The worker maps it and writes; the parent never maps it, it reads and
clears it with C{pread}/C{pwrite}.  What it reads is the claim of code
that may be hostile, so the parent checks it against the program before
it uses it (L{kcoral.server.workerproc}).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct

__all__ = ["SIZE", "BoardPoster", "attach", "clear", "create", "read"]

_INDEX = struct.Struct("<q")
SIZE = _INDEX.size
#: What the board says between programs, and before the first instruction.
_NOTHING = -1
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def create() -> int:
    """A new board (a sealed memfd saying nothing yet); the caller owns the fd."""
    fd = os.memfd_create("kcoral-progress", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.pwrite(fd, _INDEX.pack(_NOTHING), 0)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def clear(fd: int) -> None:
    """Wipe what the last program posted (before the next one starts)."""
    os.pwrite(fd, _INDEX.pack(_NOTHING), 0)


def read(fd: int) -> int | None:
    """The index posted last, or C{None} when nothing (readable) was posted."""
    try:
        data = os.pread(fd, SIZE, 0)
    except OSError:
        return None
    if len(data) != SIZE:
        return None
    (index,) = _INDEX.unpack(data)
    return None if index < 0 else int(index)


class BoardPoster:
    """The worker's side: a shared mapping of the board, written by store."""

    def __init__(self, fd: int) -> None:
        self._map = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def post(self, index: int) -> None:
        """Say that instruction C{index} is about to run."""
        _INDEX.pack_into(self._map, 0, index)


def attach(fd: int) -> BoardPoster | None:
    """The board on C{fd}, or C{None} when there is none (not given, not a board)."""
    try:
        # A board is a memfd of SIZE bytes with exactly our seals: an fd 6
        # inherited from elsewhere is never written to.
        if os.fstat(fd).st_size != SIZE or fcntl.fcntl(fd, fcntl.F_GET_SEALS) != _SEALS:
            return None
        return BoardPoster(fd)
    except (OSError, ValueError):
        return None
