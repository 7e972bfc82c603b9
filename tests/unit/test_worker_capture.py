# -*- test-case-name: tests.unit.test_worker_capture -*-
"""Tests for L{kcoral.worker.capture}: fd-level capture of stdout and stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from kcoral.worker.capture import OutputCapture, capture_paths


def captured(tmp_path: Any, limit: int, action: Any) -> Any:
    capture = OutputCapture(str(tmp_path), limit)
    capture.start()
    try:
        action()
    finally:
        result = capture.stop()
    return result


def test_fd_and_subprocess_output(tmp_path: Any) -> None:
    """Writes to fds 1 and 2, by Python and by a subprocess, are captured."""

    def action() -> None:
        print("py")
        os.write(2, b"err\n")
        subprocess.run([sys.executable, "-c", "print('child')"], check=True)

    result = captured(tmp_path, 1024, action)
    assert result.stdout == "py\nchild\n"
    assert result.stderr == "err\n"
    assert not result.stdout_truncated and not result.stderr_truncated


def test_limit_truncates(tmp_path: Any) -> None:
    """Limit 10 returns the first ten bytes and flags truncation (protocol §6.6)."""
    result = captured(tmp_path, 10, lambda: os.write(1, b"0123456789abcdef"))
    assert (result.stdout, result.stdout_truncated) == ("0123456789", True)


def test_exact_limit_not_truncated(tmp_path: Any) -> None:
    """Exactly C{limit} bytes are not truncated."""
    result = captured(tmp_path, 10, lambda: os.write(1, b"0123456789"))
    assert (result.stdout, result.stdout_truncated) == ("0123456789", False)


def test_limit_zero(tmp_path: Any) -> None:
    """Limit 0 disables capture: empty strings, no truncation."""
    result = captured(tmp_path, 0, lambda: os.write(1, b"hello"))
    assert (result.stdout, result.stdout_truncated) == ("", False)
    assert (result.stderr, result.stderr_truncated) == ("", False)


def test_invalid_utf8_replaced(tmp_path: Any) -> None:
    """Undecodable bytes become replacement characters."""
    result = captured(tmp_path, 100, lambda: os.write(1, b"a\xffb"))
    assert result.stdout == "a\ufffdb"


def test_files_removed_and_fds_restored(tmp_path: Any) -> None:
    """The capture files are deleted and fds 1/2 point where they pointed before."""
    before = os.fstat(1)
    captured(tmp_path, 100, lambda: print("x"))
    after = os.fstat(1)
    assert (before.st_dev, before.st_ino) == (after.st_dev, after.st_ino)
    out, err = capture_paths(str(tmp_path))
    assert not os.path.exists(out) and not os.path.exists(err)
    assert os.stat(os.path.dirname(out)).st_mode & 0o777 == 0o700


def test_sys_stdout_restored(tmp_path: Any) -> None:
    """sys.stdout and sys.stderr are the same objects after the capture."""
    stdout, stderr = sys.stdout, sys.stderr
    captured(tmp_path, 100, lambda: None)
    assert (sys.stdout, sys.stderr) == (stdout, stderr)
