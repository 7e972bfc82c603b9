"""Running a script of C{bench/} as CI does: its own interpreter, this checkout's root."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def run_bench(script: str, *args: str, timeout: float = 300) -> str:
    """
    Run C{bench/<script>} with C{args}; its standard output, once it has
    exited 0 (else the test fails with the tail of both streams).
    """
    completed = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    print(completed.stdout)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    return completed.stdout
