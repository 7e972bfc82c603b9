# -*- test-case-name: tests.unit.test_sandbox,tests.unit.test_sandbox_contract -*-
"""
L{NoSandbox}: workers run directly, with the server's filesystem, network
and environment (server spec 6.6: C{--sandbox none}, or C{auto} where
bubblewrap cannot run).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar

import attrs
from zope.interface import implementer

from kcoral.server.sandbox.interface import ISandbox, package_root
from kcoral.server.sandbox.seats import empty_directory, is_clean_layout, make_layout, make_seat


@implementer(ISandbox)
@attrs.define
class NoSandbox:
    """Workers run directly, with the server's filesystem and network (spec 6.6)."""

    name: ClassVar[str] = "none"
    reserved: ClassVar[None] = None
    isolates_devices: ClassVar[bool] = False
    capture_bytes: ClassVar[None] = None
    workspace_bytes: ClassVar[None] = None

    def prepare_seat(self, seat_dir: Path) -> Path:
        return make_seat(seat_dir, ("output",))

    def clear_workspace(self, work_dir: Path) -> None:
        empty_directory(work_dir)
        make_layout(os.fspath(work_dir), ("output",))

    def workspace_is_clean(self, work_dir: Path) -> bool:
        return is_clean_layout(work_dir, ("output",))

    def worker_path(self, work_dir: Path) -> str:
        return os.fspath(work_dir)

    def command(
        self, *, python: str, worker_args: list[str], work_dir: Path, gpu_devices: list[str]
    ) -> tuple[str, list[str], dict[str, str]]:
        env = {k: v for k, v in os.environ.items() if isinstance(v, str)}
        pkg = package_root()
        existing = [p for p in env.get("PYTHONPATH", "").split(":") if p]
        env["PYTHONPATH"] = ":".join([pkg, *(p for p in existing if p != pkg)])
        return python, [python, "-m", "kcoral.worker", *worker_args], env

    def template_command(
        self,
        *,
        python: str,
        template_args: list[str],
        template_dir: Path,
        spaces_dir: Path,
        gpu_devices: list[str],
    ) -> tuple[str, list[str], dict[str, str]]:
        """The template runs unsandboxed; its children get fresh directories only."""
        _, _, env = self.command(
            python=python, worker_args=[], work_dir=template_dir, gpu_devices=gpu_devices
        )
        argv = [python, "-m", "kcoral.worker.template", *template_args, "--isolation", "none"]
        return python, argv, env
