"""C{kcoral run compute-sanitizer}: CUDA memory and race checks."""

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
    return {"returncode": launch(["compute-sanitizer", *arguments]), "missing": []}
