# -*- test-case-name: tests.integration.test_twistd -*-
"""
The server under plain twistd: the C{kcoral} plugin and C{contrib/kcoral-cpu.tac}.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kcoral.testing.live_server import free_port, request

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

#: twistd's entry point.  C{python -m twisted.scripts.twistd} does nothing:
#: the module has no C{__main__} guard, so call its C{run()} the way the
#: C{twistd} console script does.
TWISTD = "import sys; sys.argv[0] = 'twistd'; from twisted.scripts.twistd import run; run()"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    return env


def _twistd(args: list[str], cwd: Path) -> subprocess.Popen[bytes]:
    log = open(cwd / "twistd-output.txt", "wb")
    try:
        return subprocess.Popen(
            [sys.executable, "-c", TWISTD, *args],
            cwd=cwd,
            env=_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    finally:
        log.close()


def _wait_health(process: subprocess.Popen[bytes], port: int, cwd: Path) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            output = (cwd / "twistd-output.txt").read_text(errors="replace")
            raise AssertionError(f"twistd exited with {process.returncode}:\n{output[-4000:]}")
        try:
            response = request(port, "GET", "/health", timeout=2)
            if response.status == 200:
                body: dict[str, Any] = response.json()
                return body
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError("twistd did not serve /health in time")


def _terminate(process: subprocess.Popen[bytes]) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
    return process.returncode


def test_plugin(tmp_path: Path) -> None:
    port = free_port()
    process = _twistd(
        [
            "-n",
            "--pidfile=",
            "kcoral",
            "--device",
            "cpu",
            "--num-workers",
            "1",
            "--sandbox",
            "none",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-dir",
            "",
            "--disk-cache-dir",
            "",
        ],
        tmp_path,
    )
    try:
        health = _wait_health(process, port, tmp_path)
        assert health["status"] == "ok"
        assert health["gpu_count"] == 0
        assert len(health["workers"]) == 1
    finally:
        code = _terminate(process)
    # A clean shutdown: twistd may re-raise the signal after stopping.
    assert code in (0, -signal.SIGTERM)
    output = (tmp_path / "twistd-output.txt").read_text(errors="replace")
    assert "shutdown_complete" in output or "shutdown complete" in output
    assert not (tmp_path / "logs").exists()


def test_plugin_default_pidfile_in_cwd(tmp_path: Path) -> None:
    """Without C{--pidfile=} twistd writes C{twistd.pid} in the cwd and removes it."""
    port = free_port()
    process = _twistd(
        [
            "-n",
            "kcoral",
            "--device",
            "cpu",
            "--num-workers",
            "1",
            "--sandbox",
            "none",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-dir",
            "",
            "--disk-cache-dir",
            "",
        ],
        tmp_path,
    )
    try:
        _wait_health(process, port, tmp_path)
        assert (tmp_path / "twistd.pid").read_text().strip() == str(process.pid)
    finally:
        _terminate(process)
    assert not (tmp_path / "twistd.pid").exists()


def _edit_tac(source: str, port: int) -> str:
    replacements = [
        (r"PORT = \d+", f"PORT = {port}"),
        (r"num_workers=\d+,", "num_workers=1,"),
        (r'sandbox="bubblewrap"', 'sandbox="none"'),
        (r'log_dir=Path\("logs"\)', "log_dir=None"),
        (r"disk_cache_capacity_mbytes=\d+", "disk_cache_capacity_mbytes=0"),
        # No load balancer here: stop at once.
        (r"lame_duck_seconds=[\d.]+", "lame_duck_seconds=0.0"),
    ]
    for pattern, replacement in replacements:
        source, count = re.subn(pattern, replacement, source)
        assert count == 1, f"contrib/kcoral-cpu.tac no longer contains {pattern!r}"
    return source


def test_tac(tmp_path: Path) -> None:
    port = free_port()
    tac = tmp_path / "kcoral.tac"
    tac.write_text(_edit_tac((ROOT / "contrib" / "kcoral-cpu.tac").read_text(), port))
    process = _twistd(["-n", "--pidfile=", "-y", str(tac)], tmp_path)
    try:
        health = _wait_health(process, port, tmp_path)
        assert health["status"] == "ok"
        assert health["target"] == {}
        assert [w["worker_id"] for w in health["workers"]] == ["cpu/w0"]
    finally:
        code = _terminate(process)
    assert code in (0, -signal.SIGTERM)
    assert not (tmp_path / "logs").exists()


def _wait_exit(process: subprocess.Popen[bytes], cwd: Path) -> tuple[int, str]:
    """The exit status and console output of a server that must stop by itself."""
    try:
        # A guard against a hang, not a timing assertion.
        code = process.wait(120)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        output = (cwd / "twistd-output.txt").read_text(errors="replace")
        raise AssertionError(f"the server did not exit by itself:\n{output[-4000:]}") from None
    return code, (cwd / "twistd-output.txt").read_text(errors="replace")


def _kcoral_server(args: list[str], cwd: Path) -> subprocess.Popen[bytes]:
    log = open(cwd / "twistd-output.txt", "wb")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "kcoral", "server", *args],
            cwd=cwd,
            env=_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    finally:
        log.close()


#: A GPU server that cannot start anywhere: no GPU 97 on a GPU host, no
#: GPU (or no PyCUDA) on a CPU host.
_BAD_GPU_SERVER = ["--device", "gpu", "--gpus", "97", "--workers-per-gpu", "1"]
_QUIET = ["--sandbox", "none", "--log-dir", "", "--disk-cache-dir", ""]


def test_kcoral_server_gpu_start_failure_exits(tmp_path: Path) -> None:
    """
    C{kcoral server --device gpu} that cannot start exits 1 by itself with
    the cause on the console; no thread keeps it alive (issue 17, item 12).
    """
    process = _kcoral_server([*_BAD_GPU_SERVER, *_QUIET, "--port", str(free_port())], tmp_path)
    code, output = _wait_exit(process, tmp_path)
    assert code == 1, output[-4000:]
    assert "server_start_failed" in output
    assert "worker_failed" in output


def test_plugin_gpu_start_failure_exits(tmp_path: Path) -> None:
    """C{twistd -n kcoral --device gpu} that cannot start exits 1 (issue 17, item 12)."""
    args = ["-n", "--pidfile=", "kcoral", *_BAD_GPU_SERVER, *_QUIET]
    process = _twistd([*args, "--port", str(free_port())], tmp_path)
    code, output = _wait_exit(process, tmp_path)
    assert code == 1, output[-4000:]
    assert "server failed to start" in output


def test_tac_gpu_start_failure_exits(tmp_path: Path) -> None:
    """
    C{twistd -ny contrib/kcoral-gpu.tac} whose GPU server cannot start
    exits 1 and removes its pidfile (issue 17, item 12).
    """
    source = (ROOT / "contrib" / "kcoral-gpu.tac").read_text()
    for pattern, replacement in [
        (r"PORT = \d+", f"PORT = {free_port()}"),
        (r"gpus=\(0,\),", "gpus=(97,),"),
        (r"workers_per_gpu=\d+,", "workers_per_gpu=1,"),
        (r'sandbox="bubblewrap"', 'sandbox="none"'),
        (r'log_dir=Path\("logs"\)', "log_dir=None"),
        (r"disk_cache_capacity_mbytes=\d+", "disk_cache_capacity_mbytes=0"),
    ]:
        source, count = re.subn(pattern, replacement, source)
        assert count == 1, f"contrib/kcoral-gpu.tac no longer contains {pattern!r}"
    tac = tmp_path / "kcoral.tac"
    tac.write_text(source)
    process = _twistd(["-ny", str(tac)], tmp_path)
    code, output = _wait_exit(process, tmp_path)
    assert code == 1, output[-4000:]
    assert "server failed to start" in output
    assert not (tmp_path / "twistd.pid").exists()


def test_log_dir_cannot_be_created(tmp_path: Path) -> None:
    """
    A C{--log-dir} that cannot be created stops the server with status 1
    and a console line naming the path and why (issue 17, item 13).
    """
    (tmp_path / "afile").write_text("")
    args = ["--device", "cpu", "--sandbox", "none", "--disk-cache-dir", ""]
    process = _kcoral_server(
        [*args, "--log-dir", "afile/logs", "--port", str(free_port())], tmp_path
    )
    code, output = _wait_exit(process, tmp_path)
    assert code == 1, output[-4000:]
    line = next(line for line in output.splitlines() if "server_start_failed" in line)
    assert "cannot create the log directory afile/logs" in line
    assert "Not a directory" in line


def test_start_failure_without_console(tmp_path: Path) -> None:
    """
    With C{--no-log-console} a failed start still says why, in one line on
    standard error, and exits 1 (issue 36, item 5).
    """
    (tmp_path / "afile").write_text("")
    args = ["--device", "cpu", "--sandbox", "none", "--disk-cache-dir", "", "--no-log-console"]
    process = _kcoral_server(
        [*args, "--log-dir", "afile/logs", "--port", str(free_port())], tmp_path
    )
    code, output = _wait_exit(process, tmp_path)
    assert code == 1, output[-4000:]
    lines = [line for line in output.splitlines() if "afile/logs" in line]
    assert len(lines) == 1, output[-4000:]
    assert lines[0].startswith(
        "kcoral server: error: the server failed to start: LogDirectoryError: cannot create "
        "the log directory afile/logs: Not a directory"
    ), lines


def test_plugin_prints_each_event_once(tmp_path: Path) -> None:
    """
    Under plain twistd, twistd's log shows each event once: kcoral's console
    mirror does not repeat them.
    """
    port = free_port()
    process = _twistd(
        ["-n", "--pidfile=", "kcoral", "--device", "cpu", "--num-workers", "1"]
        + ["--sandbox", "none", "--port", str(port), "--log-dir", "", "--disk-cache-dir", ""],
        tmp_path,
    )
    try:
        _wait_health(process, port, tmp_path)
    finally:
        _terminate(process)
    output = (tmp_path / "twistd-output.txt").read_text()
    assert output.count("pool ready:") == 1, output
    assert output.count("shutdown complete") == 1, output
    assert not re.search(r"INFO\s+pool_ready", output), output


def test_plugin_log_dir_cannot_be_created(tmp_path: Path) -> None:
    """
    Under plain twistd the log directory failure shows once, through
    twistd's log, and twistd exits 1 (issue 17, item 13).
    """
    (tmp_path / "afile").write_text("")
    args = ["-n", "--pidfile=", "kcoral", "--device", "cpu", "--sandbox", "none"]
    process = _twistd(
        [*args, "--disk-cache-dir", "", "--log-dir", "afile/logs", "--port", str(free_port())],
        tmp_path,
    )
    code, output = _wait_exit(process, tmp_path)
    assert code == 1, output[-4000:]
    assert output.count("cannot create the log directory afile/logs") == 1, output
