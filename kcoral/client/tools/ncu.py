"""C{kcoral run ncu}: an Nsight Compute capture into outputs/capture.ncu-rep."""

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
    split = arguments.index("--")
    report = outputs / "capture.ncu-rep"
    environment.setdefault("NCU_PROFILE", "1")
    command = ["ncu", "--config-file", "0", "--export", str(report)]
    code = launch([*command, *arguments[:split], *arguments[split + 1 :]])
    return {"returncode": code, "missing": [] if report.is_file() else ["capture.ncu-rep"]}
