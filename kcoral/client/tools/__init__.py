"""
The remote halves of C{kcoral run <tool>}: modules uploaded as source.

C{runner.py} unpacks the sent files into C{inputs/}, calls the tool's
C{run(arguments, environment, outputs, launch)} and gathers C{--fetch}
paths into C{outputs/}; one module per tool builds the command line.  They
use only the standard library, because they execute inside the worker.
"""

from __future__ import annotations

from pathlib import Path

#: CLI spelling -> source module of the tool's remote half.
TOOLS = {
    "python": "python",
    "compute-sanitizer": "compute_sanitizer",
    "ncu": "ncu",
    "run-iket": "run_iket",
    "shell": "shell",
}


def source(module: str) -> str:
    """The text of one of these modules, as uploaded."""
    return Path(__file__).with_name(f"{module}.py").read_text()
