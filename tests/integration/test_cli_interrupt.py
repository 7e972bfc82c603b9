# -*- test-case-name: tests.integration.test_cli_interrupt -*-
"""
Ctrl-C in C{kcoral run} and C{kcoral health}: a real subprocess and a real
SIGINT while it waits for a server; one line, exit status 130, no traceback,
and the running program is cancelled on the server.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kcoral.testing.live_server import ServerProcess, _interruptible

pytestmark = pytest.mark.integration


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KCORAL_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    return env


def _until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def _kcoral(*args: str, cwd: Path | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kcoral", *args],
        env=_env(),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_interruptible,  # SIGINT raises KeyboardInterrupt, as at a terminal
    )


def test_ctrl_c_in_kcoral_run(cpu_server: Callable[..., ServerProcess], tmp_path: Path) -> None:
    """
    SIGINT while the program runs: C{kcoral run python: interrupted} on
    stderr, exit 130, and the server cancels the program.
    """
    server = cpu_server("--sandbox", "none")
    process = _kcoral(
        "run", "python", "--url", f"http://127.0.0.1:{server.port}",
        "--", "-c", "import time; time.sleep(120)",
        cwd=tmp_path,
    )  # fmt: skip
    _until(lambda: server.health()["active_requests"] >= 1)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=30)
    assert process.returncode == 130, stderr
    assert stderr == "kcoral run python: interrupted\n"
    assert stdout == ""
    # The request was cancelled: its two-minute sleep does not hold the worker.
    _until(lambda: server.health()["active_requests"] == 0, timeout=30)


def test_ctrl_c_in_kcoral_health() -> None:
    """SIGINT while a server accepts the connection and never answers: one line, 130."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        port = silent.getsockname()[1]
        process = _kcoral("health", "--url", f"http://127.0.0.1:{port}")
        connection, _ = silent.accept()
        with connection:
            connection.recv(65536)  # the request; no answer follows
            process.send_signal(signal.SIGINT)
            stdout, stderr = process.communicate(timeout=30)
    assert process.returncode == 130, stderr
    assert stderr == "kcoral health: interrupted\n"
    assert stdout == ""
