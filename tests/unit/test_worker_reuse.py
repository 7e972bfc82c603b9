"""
The reuse checks of kcoral.worker.reuse against real threads, processes and
descriptors: what a program leaves behind is found, however the baseline's
own threads and descriptors are skipped.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from kcoral.testing.processes import SLEEPER, ThreadWithChild
from kcoral.worker.reuse import ProcessState, _open_fds_under


def test_a_child_of_a_baseline_python_thread_is_found() -> None:
    """Python threads of the baseline are read: a program may use them."""
    with ThreadWithChild() as thread:
        state = ProcessState.snapshot()
        assert str(thread.native_id) not in state.quiet_tasks
        assert thread.start_child() in state.new_children()


def test_a_child_of_a_new_thread_is_found() -> None:
    state = ProcessState.snapshot()
    with ThreadWithChild() as thread:
        assert thread.start_child() in state.new_children()


def test_a_baseline_descriptor_reused_for_a_workspace_file_is_found(tmp_path: Path) -> None:
    """The descriptor number is the baseline's, the file is not: it is resolved."""
    tmp_path = tmp_path.resolve()
    outside = open(os.devnull, "rb")  # noqa: SIM115 - closed below
    number = outside.fileno()
    try:
        state = ProcessState.snapshot()
        assert number in state.files
        assert _open_fds_under(str(tmp_path), state.files) == []
        outside.close()
        inside = tmp_path / "left-open.txt"
        inside.write_text("x")
        fd = os.open(inside, os.O_RDONLY)
        try:
            if fd != number:
                os.dup2(fd, number)
                os.close(fd)
            assert _open_fds_under(str(tmp_path), state.files) == [str(inside)]
        finally:
            os.close(number)
    finally:
        if not outside.closed:
            outside.close()


def test_a_forked_worker_reads_its_own_main_thread() -> None:
    """
    After a fork (a worker made by a template) the thread that runs
    programs is never quiet, though Python may keep the template's id for it.
    """
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            state = ProcessState.snapshot()
            child = subprocess.Popen(SLEEPER)
            found = child.pid in state.new_children()
            child.kill()
            child.wait()
            os.write(write, b"found" if found else b"missed")
        finally:
            os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 16) == b"found"
    finally:
        os.close(read)
        os.waitpid(pid, 0)
