"""
The CPU's own counters (cycles, instructions) for chosen processes.

CPU time says how long a process ran, not why it ran that long.  When one
job costs a process more CPU on a busy host than on a quiet one, either
the process did more work (more instructions per job) or the same work ran
slower (more cycles per instruction, or fewer cycles per second: a lower
clock).  Only the hardware counters tell the two apart.  They are read
through Linux's C{perf_event_open(2)}, counting each thread of a process
(user and, where the kernel lets us, kernel mode too).  Many virtual
machines expose no counters: L{open_counters} then says why and the
benchmark goes on without them.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
from collections.abc import Iterable

import psutil

_SYSCALL = {"x86_64": 298, "aarch64": 241}.get(platform.machine())
_HARDWARE = 0
_CYCLES = 0
_INSTRUCTIONS = 1
_ATTR_SIZE = 128
_EXCLUDE_KERNEL = 1 << 5
_EXCLUDE_HV = 1 << 6
_INHERIT = 1 << 1


_LIBC = ctypes.CDLL(None, use_errno=True)


def _open(tid: int, config: int, flags: int) -> int:
    """One counter on one thread; the file descriptor, or minus the errno."""
    if _SYSCALL is None:
        return -38  # ENOSYS
    attr = bytearray(_ATTR_SIZE)
    struct.pack_into("IIQ", attr, 0, _HARDWARE, _ATTR_SIZE, config)
    struct.pack_into("Q", attr, 40, flags)
    buf = ctypes.create_string_buffer(bytes(attr), _ATTR_SIZE)
    fd = _LIBC.syscall(_SYSCALL, buf, tid, -1, -1, 0)
    return fd if fd >= 0 else -ctypes.get_errno()


class Counters:
    """Cycles and instructions of a set of threads, summed; C{close()} when done."""

    def __init__(self, pairs: list[tuple[int, int]], kernel: bool) -> None:
        self._pairs = pairs
        self.kernel = kernel

    def read(self) -> tuple[int, int]:
        """(cycles, instructions) so far; a thread that exited keeps its count."""
        cycles = instructions = 0
        for cycles_fd, instructions_fd in self._pairs:
            cycles += struct.unpack("Q", os.read(cycles_fd, 8))[0]
            instructions += struct.unpack("Q", os.read(instructions_fd, 8))[0]
        return cycles, instructions

    def close(self) -> None:
        for pair in self._pairs:
            for fd in pair:
                os.close(fd)
        self._pairs = []


def open_counters(pids: Iterable[int]) -> Counters | str:
    """
    Counters on every thread each of C{pids} has now (threads it starts
    later count through inheritance once they end), or a line saying why
    there can be none here.
    """
    tids = []
    for pid in pids:
        try:
            tids.extend(thread.id for thread in psutil.Process(pid).threads())
        except psutil.NoSuchProcess:
            continue
    last_error = 0
    for flags in (_EXCLUDE_HV | _INHERIT, _EXCLUDE_HV | _EXCLUDE_KERNEL | _INHERIT):
        pairs: list[tuple[int, int]] = []
        for tid in tids:
            cycles = _open(tid, _CYCLES, flags)
            instructions = _open(tid, _INSTRUCTIONS, flags) if cycles >= 0 else cycles
            if instructions < 0:
                if cycles >= 0:
                    os.close(cycles)
                last_error = -instructions
                break
            pairs.append((cycles, instructions))
        else:
            return Counters(pairs, kernel=not flags & _EXCLUDE_KERNEL)
        for pair in pairs:
            for fd in pair:
                os.close(fd)
    return f"no hardware counters here: perf_event_open: {os.strerror(last_error)}"
