"""
What a process's open descriptors point at, for the tests that check that
shared buffers are neither leaked nor lost.

A memfd's link reads C{/memfd:<name> (deleted)}; counting those apart from
the rest is what lets a leak check ignore the blobs a memory cache keeps on
purpose, or a file an earlier test left to the garbage collector.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator

#: How every memfd's link begins.
MEMFD_PREFIX = "/memfd:"


def descriptor_targets(pid: int | str = "self") -> dict[int, str]:
    """
    Each open descriptor of C{pid} (this process by default) and what its
    link names; one that closes while it is read is left out.
    """
    found: dict[int, str] = {}
    directory = f"/proc/{pid}/fd"
    for name in os.listdir(directory):
        try:
            found[int(name)] = os.readlink(f"{directory}/{name}")
        except OSError:
            continue
    return found


def memfd_count(pid: int | str = "self") -> int:
    """How many of C{pid}'s descriptors are memfds."""
    return sum(target.startswith(MEMFD_PREFIX) for target in descriptor_targets(pid).values())


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """
    Collect what is garbage now, then nothing until the block ends, so a
    count taken inside changes only by what the block does (not by an
    earlier test's buffer the collector happens to free meanwhile).
    """
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
