# -*- test-case-name: tests.unit.test_scratch -*-
"""
The server's scratch root: the temporary directory that holds every seat.

Its name carries the server's pid (C{kcoral-<pid>-XXXXXXXX}), so the next
server to start can tell what a killed one left behind (its pid is gone) and
remove it; a directory whose pid lives, or that another user owns, is left
alone.  Both functions block: the service runs them in its thread pool.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import psutil

PREFIX = "kcoral-"

_NAME = re.compile(r"^kcoral-(\d+)-[A-Za-z0-9_]+$")


def make_root(directory: str | None = None) -> Path:
    """Create this server's scratch root (mode 0700) under C{directory}."""
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=directory))


def remove_leftovers(directory: str | None = None) -> list[str]:
    """
    Remove the scratch roots of servers that are gone: named for a pid that
    no longer runs and owned by this user.  Returns the names removed.
    """
    base = Path(directory or tempfile.gettempdir())
    removed = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return []
    for entry in entries:
        match = _NAME.match(entry.name)
        if match is None:
            continue
        pid = int(match.group(1))
        if pid == os.getpid() or psutil.pid_exists(pid):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not entry.is_dir(follow_symlinks=False) or info.st_uid != os.getuid():
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.name)
    return removed
