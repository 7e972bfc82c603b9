"""C{kcoral run python}: the worker's own interpreter."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def run(
    arguments: list[str],
    environment: dict[str, str],
    outputs: Path,
    launch: Callable[..., int],
) -> dict[str, Any]:
    return {"returncode": launch([sys.executable, *arguments]), "missing": []}
