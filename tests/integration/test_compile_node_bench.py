"""
C{bench/compile_node.py} (issue 38) in CI form: one compile of each kind,
one client, kcoral under bubblewrap only.

No time is asserted.  What is asserted is that every figure of the table
was measured: nvcc alone, nvcc in a compile's sandbox of each shape (so every
command line still compiles), and through the server a null program, a
cold compile, a cache hit and the compiles/s phase with its CPU record.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from .benchscripts import run_bench

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on PATH"),
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
]


def test_compile_node(tmp_path: Path) -> None:
    output = tmp_path / "compile_node.json"
    run_bench(
        "compile_node.py",
        *("--requests", "1", "--rounds", "1", "--cores", "1", "--modes", "bubblewrap"),
        *("--output", str(output)),
        timeout=600,
    )
    result = json.loads(output.read_text())
    results = result["results"]
    assert results["nvcc"]["cold"]["n"] == 1
    assert set(results["sandboxes"]) == {"netns", "compile-sh", "compile"}
    for shape in results["sandboxes"].values():
        assert (shape["start"]["n"], shape["cold"]["n"]) == (1, 1)
        assert shape["rate"] > 0 and shape["cpu"]["machine_ms"] >= 0
    kcoral = results["bubblewrap"]
    for figure in ("null", "cold", "hit"):
        assert kcoral[figure]["n"] == 1, figure
    assert kcoral["rate"] > 0
    assert set(kcoral["cpu"]) == {"machine_ms", "process_ms"}
    assert "cold compiles/s at 1 clients" in result["table"]
