# -*- test-case-name: tests.unit.test_proctree -*-
"""
A process's descendants, read from procfs without scanning every process.

C{/proc/<pid>/task/<tid>/children} lists a task's children, so a walk
reads only the files of the tree itself; psutil's C{children(recursive=True)}
reads the C{stat} of every process on the machine, several milliseconds on
a host with many (kernel threads included).  The server lists a worker's
tree to freeze and kill it on the reactor, and a worker lists its own
children after every program, so the walk's cost is on every request.
"""

from __future__ import annotations

import os
from collections.abc import Container

__all__ = ["children_of", "descendants_of"]


def children_of(pid: int, quiet_tasks: Container[str] = ()) -> list[int] | None:
    """
    The direct children of C{pid} (those of all its threads but
    C{quiet_tasks}, thread ids the caller knows start no process); C{[]}
    when it is gone, C{None} where the kernel has no C{children} file.
    """
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for task in tasks:
        if task in quiet_tasks:
            continue
        try:
            found.extend(int(child) for child in _read(f"/proc/{pid}/task/{task}/children").split())
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{task}"):
                continue  # the thread exited meanwhile
            return None
        except OSError:
            continue
    return found


def _read(path: str) -> bytes:
    """
    The whole of a procfs file, in bytes, through bare descriptors: a GPU
    worker has a few dozen threads, each with its C{children} file, and a
    file object costs several times the system calls.  (Bytes: no codec to
    look up, which a fresh worker's first lookup would import.)
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        # A procfs file fills a read as far as it can: a short one is all.
        chunks = [os.read(fd, _CHUNK)]
        while len(chunks[-1]) == _CHUNK:
            chunks.append(os.read(fd, _CHUNK))
        return b"".join(chunks)
    finally:
        os.close(fd)


_CHUNK = 1 << 16


def descendants_of(pid: int, quiet_tasks: Container[str] = ()) -> list[int] | None:
    """
    Every descendant of C{pid}, parents before their children; C{None}
    where the kernel has no C{children} file (the caller falls back to a
    full scan).

    @param quiet_tasks: threads of C{pid} itself whose children are not
        read (see L{children_of}).
    """
    result: list[int] = []
    pending = [pid]
    seen = {pid}
    while pending:
        parent = pending.pop()
        children = children_of(parent, quiet_tasks if parent == pid else ())
        if children is None:
            return None
        for child in children:
            if child not in seen:
                seen.add(child)
                result.append(child)
                pending.append(child)
    return result
