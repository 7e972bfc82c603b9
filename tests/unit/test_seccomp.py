"""Tests for L{kcoral.server.sandbox.seccomp} and its place in the bwrap command line."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kcoral.server.sandbox.bubblewrap import SECCOMP_FD, SHELL, BubblewrapSandbox
from kcoral.server.sandbox.seccomp import build_filter, write_filter


def test_filter_is_a_bpf_program() -> None:
    """A classic BPF program: whole 8-byte instructions."""
    program = build_filter()
    assert program and len(program) % 8 == 0


def test_written_private(tmp_path: Path) -> None:
    path = write_filter(tmp_path)
    assert Path(path).read_bytes() == build_filter()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_command_loads_filter(tmp_path: Path) -> None:
    """
    With a filter, a shell opens it on the seccomp fd and execs bwrap with
    C{--seccomp}; without one the command is bwrap itself.
    """
    work = tmp_path / "seat" / "work"
    work.mkdir(parents=True)
    plain = BubblewrapSandbox([])
    executable, argv, _ = plain.command(
        python="/usr/bin/python3", worker_args=[], work_dir=work, gpu_devices=[]
    )
    assert "--seccomp" not in argv
    filtered = BubblewrapSandbox([], seccomp_path=str(tmp_path / "f.bpf"))
    executable, argv, _ = filtered.command(
        python="/usr/bin/python3", worker_args=[], work_dir=work, gpu_devices=[]
    )
    assert executable == SHELL
    assert argv[:2] == [SHELL, "-c"]
    assert argv[2] == f'exec "$0" "$@" {SECCOMP_FD}<{tmp_path / "f.bpf"}'
    assert argv[4:6] == ["--seccomp", str(SECCOMP_FD)]
