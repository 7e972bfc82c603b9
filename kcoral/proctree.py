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

__all__ = ["children_of", "descendants_of"]


def children_of(pid: int) -> list[int] | None:
    """
    The direct children of C{pid} (those of all its threads); C{[]} when it
    is gone, C{None} where the kernel has no C{children} file.
    """
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for task in tasks:
        try:
            # Bytes: no codec to look up (a fresh worker's first lookup
            # imports one, milliseconds of its first answer).
            with open(f"/proc/{pid}/task/{task}/children", "rb") as f:
                found.extend(int(child) for child in f.read().split())
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{task}"):
                continue  # the thread exited meanwhile
            return None
        except OSError:
            continue
    return found


def descendants_of(pid: int) -> list[int] | None:
    """
    Every descendant of C{pid}, parents before their children; C{None}
    where the kernel has no C{children} file (the caller falls back to a
    full scan).
    """
    result: list[int] = []
    pending = [pid]
    seen = {pid}
    while pending:
        children = children_of(pending.pop())
        if children is None:
            return None
        for child in children:
            if child not in seen:
                seen.add(child)
                result.append(child)
                pending.append(child)
    return result
