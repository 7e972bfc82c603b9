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
growing, so that nothing can make the parent's read of it fail) and
passes it as fd L{kcoral.wire.channel.PROGRESS_FD}.  The worker maps it,
closes the fd, and writes into the mapping; the parent never maps it, it
reads and clears it with C{pread}/C{pwrite}.  What it reads is the claim of code
that may be hostile, so the parent checks it against the program before
it uses it (L{kcoral.server.workers.runningjob}).
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import struct
from typing import Any

__all__ = ["SIZE", "BoardPoster", "attach", "clear", "create", "read"]

#: Native byte order: the worker stores a C{int64} into the mapping.
_INDEX = struct.Struct("=q")
SIZE = _INDEX.size
#: What the board says between programs, and before the first instruction.
_NOTHING = -1
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def create() -> int:
    """A new board (a sealed memfd saying nothing yet); the caller owns the fd."""
    fd = os.memfd_create("kcoral-progress", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        clear(fd)
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
    """
    The worker's side: a shared mapping of the board, written by a store.

    Mapped with C{mmap(2)} itself rather than Python's C{mmap} module,
    which keeps a duplicate of the descriptor: the worker closes the
    board's fd once it is mapped, so a program finds no extra descriptor.
    """

    def __init__(self, fd: int) -> None:
        address = _libc_mmap()(None, SIZE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "cannot map the progress board")
        self._slot = ctypes.c_int64.from_address(address)

    def post(self, index: int) -> None:
        """Say that instruction C{index} is about to run."""
        self._slot.value = index


def _libc_mmap() -> Any:
    function = ctypes.CDLL(None, use_errno=True).mmap
    function.restype = ctypes.c_void_p
    function.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    return function


def attach(fd: int, *, close: bool = False) -> BoardPoster | None:
    """
    The board on C{fd}, or C{None} when there is none (not given, not a
    board).  With C{close}, C{fd} is closed once the board is mapped.
    """
    try:
        # A board is a memfd of SIZE bytes with exactly our seals: an fd 6
        # inherited from elsewhere is never written to.
        if os.fstat(fd).st_size != SIZE or fcntl.fcntl(fd, fcntl.F_GET_SEALS) != _SEALS:
            return None
        poster = BoardPoster(fd)
    except (OSError, ValueError):
        return None
    if close:
        os.close(fd)
    return poster
