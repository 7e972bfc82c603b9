"""Tests for L{kcoral.server.workers.scratch}: what a killed server left is removed at the next start."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kcoral.server.workers import scratch

#: Above Linux's largest pid_max (2**22): never a running process.
DEAD_PID = 2**22 + 17


def test_root_is_named_for_the_pid_and_private(tmp_path: Path) -> None:
    root = scratch.make_root(str(tmp_path))
    assert root.name.startswith(f"kcoral-{os.getpid()}-")
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


def test_leftovers_of_dead_servers_removed(tmp_path: Path) -> None:
    dead = tmp_path / f"kcoral-{DEAD_PID}-abc123"
    (dead / "cpu-w0-g1" / "work").mkdir(parents=True)
    (dead / "cpu-w0-g1" / "work" / "out.txt").write_text("x")
    alive = tmp_path / f"kcoral-{os.getppid()}-def456"
    alive.mkdir()
    mine = scratch.make_root(str(tmp_path))
    other = tmp_path / "kcoral-notapid"
    other.mkdir()
    removed = scratch.remove_leftovers(str(tmp_path))
    assert removed == [dead.name]
    assert not dead.exists()
    assert alive.exists() and mine.exists() and other.exists()


def test_a_file_of_that_name_is_left(tmp_path: Path) -> None:
    (tmp_path / f"kcoral-{DEAD_PID}-file").write_text("not a directory")
    assert scratch.remove_leftovers(str(tmp_path)) == []


def test_missing_directory(tmp_path: Path) -> None:
    assert scratch.remove_leftovers(str(tmp_path / "absent")) == []
