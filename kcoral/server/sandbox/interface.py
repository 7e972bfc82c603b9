# -*- test-case-name: tests.unit.test_sandbox,tests.unit.test_sandbox_contract -*-
"""
The sandbox seam: L{ISandbox}, what every way of isolating workers provides,
and L{SandboxError}.

The providers are L{kcoral.server.sandbox.bubblewrap.BubblewrapSandbox} and
L{kcoral.server.sandbox.nosandbox.NoSandbox}; the server picks one at start
(L{kcoral.server.sandbox.probe.choose_sandbox}).  C{prepare_seat} and
C{clear_workspace} do file-system work and must run in a thread; the rest
is cheap.
"""

from __future__ import annotations

import os
from pathlib import Path

from zope.interface import Attribute, Interface


class SandboxError(Exception):
    """The sandbox cannot be built for this configuration (the message says why)."""


class ISandbox(Interface):
    """How worker processes are isolated, and the host side of their workspaces."""

    name = Attribute("C{'bubblewrap'} or C{'none'}.")
    reserved = Attribute(
        "The reserved top-level directory name of a workspace (C{'.kcoral'}), or C{None} "
        "when uploads may use any name."
    )
    isolates_devices = Attribute(
        "C{True} when a worker sees only the device nodes of its own GPUs (so CUDA "
        "numbers them from 0), C{False} when it sees every GPU of the machine."
    )
    capture_bytes = Attribute(
        "Bytes of the private tmpfs a worker's captured stdout and stderr go to, or "
        "C{None}: they are captured into its workspace."
    )
    workspace_bytes = Attribute(
        "Bytes of the private tmpfs a one-request worker gets as its workspace, or "
        "C{None}: the seat's host directory is its workspace."
    )

    def prepare_seat(seat_dir: Path) -> Path:
        """
        BLOCKING (run in a thread): create C{<seat_dir>/work} (mode 0700) and the
        reserved layout beneath it.

        @return: the resolved host path of the work directory.
        """

    def clear_workspace(work_dir: Path) -> None:
        """
        BLOCKING (run in a thread): remove everything inside C{work_dir}
        without following symbolic links, keep the directory itself, then
        recreate the reserved layout.

        @raise OSError: the workspace could not be cleared; retire the worker.
        """

    def workspace_is_clean(work_dir: Path) -> bool:
        """
        Whether C{work_dir} is as L{clear_workspace} leaves it (the reserved
        layout, every directory empty and private), read with a few bounded
        calls, so it may run on the reactor: a program that wrote nothing
        needs no clear.  C{False} when in doubt.
        """

    def command(
        *, python: str, worker_args: list[str], work_dir: Path, gpu_devices: list[str]
    ) -> tuple[str, list[str], dict[str, str]]:
        """
        The C{(executable, argv, env)} to pass to C{reactor.spawnProcess} for a
        worker running C{python -m kcoral.worker *worker_args} in C{work_dir}.

        @param gpu_devices: the worker's GPUs: device node paths
            (C{'/dev/nvidia0'}) or minor numbers (C{'0'}); empty for a CPU worker.
        @raise SandboxError: the command line would be unsafe or cannot be built.
        """

    def worker_path(work_dir: Path) -> str:
        """The path under which the worker sees C{work_dir}."""

    def template_command(
        *,
        python: str,
        template_args: list[str],
        template_dir: Path,
        spaces_dir: Path,
        gpu_devices: list[str],
    ) -> tuple[str, list[str], dict[str, str]]:
        """
        The C{(executable, argv, env)} of a worker template
        (C{python -m kcoral.worker.template *template_args}) whose children
        are workers seeing C{gpu_devices}, each with its own workspace below
        C{spaces_dir}; the template's own (unused) workspace is C{template_dir}.

        @raise SandboxError: the command line would be unsafe or cannot be built.
        """


def package_root() -> str:
    """The resolved directory that contains the C{kcoral} package (every sandbox puts it on the path)."""
    import kcoral

    return os.path.dirname(os.path.dirname(os.path.realpath(kcoral.__file__)))
