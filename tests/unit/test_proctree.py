"""
kcoral.proctree against real processes: a child with a grandchild, and
processes that are gone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from kcoral.proctree import children_of, descendants_of
from kcoral.testing.processes import ThreadWithChild

#: A child that starts a grandchild, prints its pid, and waits.
PARENT = (
    "import subprocess, sys\n"
    "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print(g.pid, flush=True)\n"
    "sys.stdin.read()\n"
)


@pytest.fixture
def family() -> Iterator[tuple[int, int]]:
    """C{(child pid, grandchild pid)}, both killed afterwards."""
    child = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        yield child.pid, int(child.stdout.readline())
    finally:
        for p in psutil.Process(child.pid).children(recursive=True):
            p.kill()
        child.kill()
        child.wait()


def test_child_and_grandchild_parents_first(family: tuple[int, int]) -> None:
    child, grandchild = family
    assert descendants_of(child) == [grandchild]
    found = descendants_of(os.getpid())
    assert found is not None
    assert found.index(child) < found.index(grandchild)
    # The same set psutil's full scan finds.
    scanned = {p.pid for p in psutil.Process().children(recursive=True)}
    assert set(found) == scanned
    assert children_of(child) == [grandchild]


def test_a_process_that_is_gone_has_none() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    deadline = time.monotonic() + 5
    while psutil.pid_exists(child.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert children_of(child.pid) == []
    assert descendants_of(child.pid) == []


def test_worker_tree_is_the_worker_and_its_descendants(
    family: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    The server's view of a worker's tree (what it freezes and kills): the
    process first, then its descendants, from procfs, or from psutil's scan
    where the kernel has no children files.
    """
    from kcoral.server.workers import processes

    child, grandchild = family
    tree = processes.process_tree(child)
    assert [p.pid for p in tree] == [child, grandchild]
    monkeypatch.setattr(processes, "descendants_of", lambda pid: None)
    tree = processes.process_tree(child)
    assert [p.pid for p in tree] == [child, grandchild]
    assert processes.process_tree(None) == []


def test_quiet_tasks_are_not_read() -> None:
    """
    A process started from a thread named quiet is not listed; the same
    walk without it finds the process (the thread's C{children} file).
    """
    with ThreadWithChild() as thread:
        child = thread.start_child()
        tid = str(thread.native_id)
        assert child in (descendants_of(os.getpid()) or [])
        assert child not in (descendants_of(os.getpid(), quiet_tasks={tid}) or [])
        assert child not in (children_of(os.getpid(), quiet_tasks={tid}) or [])
