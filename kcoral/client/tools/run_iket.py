"""C{kcoral run run-iket}: an instrumented timeline into outputs/."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def run(
    arguments: list[str],
    environment: dict[str, str],
    outputs: Path,
    launch: Callable[..., int],
) -> dict[str, Any]:
    # run-iket makes its output directory itself and asks if it exists.
    code = launch(["run-iket", "--output-dir", str(outputs), *arguments], create_outputs=False)
    produced = outputs.is_dir() and any(p.is_file() for p in outputs.rglob("*"))
    return {"returncode": code, "missing": [] if produced else ["run-iket output"]}
