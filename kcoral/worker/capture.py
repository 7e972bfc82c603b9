# -*- test-case-name: tests.unit.test_worker_capture -*-
"""
File-descriptor-level capture of a program's stdout and stderr.

While a program runs, fds 1 and 2 point at two files under
C{<workspace>/.kcoral/output/} (C{<pid>.out} and C{<pid>.err}), so output of
subprocesses and native code is captured too (protocol §6.6, spec/server.md
§3.10).  Afterwards at most C{limit + 1} bytes of each file are read, so memory
use is bounded by the limit rather than by what the program wrote.
"""

from __future__ import annotations

import os
import sys

import attrs

#: Capture files live here, relative to the workspace ...
OUTPUT_DIR = (".kcoral", "output")

#: ... unless the sandbox names a directory of its own in this variable: a
#: size-limited tmpfs, so output cannot fill the host's disk.
CAPTURE_DIR_ENV = "KCORAL_CAPTURE_DIR"


def _output_dir(workspace: str) -> str:
    return os.environ.get(CAPTURE_DIR_ENV) or os.path.join(workspace, *OUTPUT_DIR)


@attrs.frozen
class Captured:
    """What one program wrote, cut to the limit."""

    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False


def capture_paths(workspace: str, pid: int | None = None) -> tuple[str, str]:
    """The stdout and stderr capture files of process C{pid} (default: this one)."""
    pid = os.getpid() if pid is None else pid
    directory = _output_dir(workspace)
    return os.path.join(directory, f"{pid}.out"), os.path.join(directory, f"{pid}.err")


def _read_limited(path: str, limit: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    return data[:limit].decode("utf-8", errors="replace"), len(data) > limit


def _flush_python_streams() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass


@attrs.define
class OutputCapture:
    """
    Redirect fds 1 and 2 into capture files between L{start} and L{stop}.

    @ivar workspace: the request's workspace (absolute path).
    @ivar limit: bytes returned per stream; C{0} returns nothing.
    """

    workspace: str
    limit: int
    _paths: tuple[str, str] | None = None
    _saved_fds: tuple[int, int] | None = None
    _saved_streams: tuple[object, object] | None = None
    _streams: tuple[object, ...] = ()

    def start(self) -> None:
        """Flush Python's streams and point fds 1 and 2 at fresh capture files."""
        directory = _output_dir(self.workspace)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._paths = capture_paths(self.workspace)
        _flush_python_streams()
        self._saved_streams = (sys.stdout, sys.stderr)
        saved = (os.dup(1), os.dup(2))
        for fd in saved:
            os.set_inheritable(fd, False)
        self._saved_fds = saved
        for target, path in zip((1, 2), self._paths, strict=True):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.dup2(fd, target)
            finally:
                os.close(fd)
        # Python-level writes must reach the redirected fds even when
        # sys.stdout/sys.stderr had been replaced by something else.
        self._streams = tuple(
            open(fd, "w", 1, "utf-8", "backslashreplace", closefd=False) for fd in (1, 2)
        )
        sys.stdout, sys.stderr = self._streams

    def stop(self) -> Captured:
        """Restore fds 1 and 2, read the captured output and delete the files."""
        if self._saved_fds is None or self._paths is None:
            return Captured()
        _flush_python_streams()
        for stream in self._streams:
            try:
                stream.close()  # type: ignore[attr-defined]
            except (OSError, ValueError):
                pass
        self._streams = ()
        if self._saved_streams is not None:
            sys.stdout, sys.stderr = self._saved_streams  # type: ignore[assignment]
            self._saved_streams = None
        for target, saved in zip((1, 2), self._saved_fds, strict=True):
            os.dup2(saved, target)
            os.close(saved)
        self._saved_fds = None
        out_path, err_path = self._paths
        self._paths = None
        try:
            if self.limit <= 0:
                return Captured()
            stdout, stdout_truncated = _read_limited(out_path, self.limit)
            stderr, stderr_truncated = _read_limited(err_path, self.limit)
            return Captured(stdout, stderr, stdout_truncated, stderr_truncated)
        finally:
            for path in (out_path, err_path):
                try:
                    os.unlink(path)
                except OSError:
                    pass
