# -*- test-case-name: tests.gpu.test_gpu_deploy -*-
"""
contrib/kcoral-gpu.tac runs a GPU node under twistd (run on the GPU
machine; skipped elsewhere).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kcoral.testing.live_server import free_port, request

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
TWISTD = "import sys; sys.argv[0] = 'twistd'; from twisted.scripts.twistd import run; run()"


def _edit(source: str, port: int) -> str:
    replacements = [
        (r"PORT = \d+", f"PORT = {port}"),
        (r"workers_per_gpu=\d+,", "workers_per_gpu=2,"),
        # PyCUDA may come from PYTHONPATH here; the sandbox is tested elsewhere.
        (r'sandbox="bubblewrap"', 'sandbox="none"'),
        (r'log_dir=Path\("logs"\)', "log_dir=None"),
        (r"disk_cache_capacity_mbytes=\d+", "disk_cache_capacity_mbytes=0"),
    ]
    for pattern, replacement in replacements:
        source, count = re.subn(pattern, replacement, source)
        assert count == 1, f"contrib/kcoral-gpu.tac no longer contains {pattern!r}"
    return source


def test_gpu_tac(tmp_path: Path) -> None:
    """The GPU tac serves /health with a GPU target, prints each event once, stops cleanly."""
    port = free_port()
    tac = tmp_path / "kcoral-gpu.tac"
    tac.write_text(_edit((ROOT / "contrib" / "kcoral-gpu.tac").read_text(), port))
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    output = tmp_path / "twistd.txt"
    with open(output, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", TWISTD, "-n", "--pidfile=", "-y", str(tac)],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 180
        health = None
        while health is None:
            assert process.poll() is None, output.read_text()[-4000:]
            assert time.monotonic() < deadline, "no /health in time"
            try:
                response = request(port, "GET", "/health", timeout=2)
                if response.status == 200:
                    health = response.json()
            except OSError:
                time.sleep(0.2)
        assert health["gpu_count"] >= 1
        assert health["target"]["arch"].startswith("sm_")
        assert [w["worker_id"] for w in health["workers"]] == ["gpu0/w0", "gpu0/w1"]
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(120)
    text = output.read_text()
    # twistd re-raises the SIGTERM it stopped on after a graceful stop (as in
    # tests/integration/test_twistd.py); anything else is a failure.
    assert code in (0, -signal.SIGTERM), text[-4000:]
    assert "Server Shut Down." in text, text[-4000:]
    assert text.count("pool ready:") == 1, text[-4000:]
