"""
The reuse checks of kcoral.worker.reuse against real threads, processes and
descriptors: what a program leaves behind is found, however the baseline's
own threads and descriptors are skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from kcoral.worker.reuse import ProcessState, _open_fds_under

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_a_child_of_a_baseline_python_thread_is_found() -> None:
    """Python threads of the baseline are read: a program may use them."""
    wake = threading.Event()
    started: list[subprocess.Popen[bytes]] = []
    done = threading.Event()

    def pool_thread() -> None:
        wake.wait()
        started.append(subprocess.Popen(SLEEPER))
        done.set()

    thread = threading.Thread(target=pool_thread)
    thread.start()
    try:
        state = ProcessState.snapshot()
        assert str(thread.native_id) not in state.quiet_tasks
        wake.set()
        assert done.wait(10)
        assert started[0].pid in state.new_children()
    finally:
        wake.set()
        thread.join()
        for child in started:
            child.kill()
            child.wait()


def test_a_child_of_a_new_thread_is_found() -> None:
    state = ProcessState.snapshot()
    started: list[subprocess.Popen[bytes]] = []
    spawned = threading.Event()
    release = threading.Event()

    def program_thread() -> None:
        started.append(subprocess.Popen(SLEEPER))
        spawned.set()
        release.wait()

    thread = threading.Thread(target=program_thread)
    thread.start()
    try:
        assert spawned.wait(10)
        assert started[0].pid in state.new_children()
    finally:
        release.set()
        thread.join()
        for child in started:
            child.kill()
            child.wait()


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
