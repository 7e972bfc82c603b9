# -*- test-case-name: tests.unit.test_client_install -*-
"""
Detecting the reference client installed beside kcoral-server.

The reference client (PyPI C{kcoral}, 0.1.1) and this project
(C{kcoral-server}) are both the import package C{kcoral}: pip installs them
into one environment without a word, each overwriting the other's files,
and uninstalling either breaks the other.  L{conflict} finds the reference
distribution in the environment; the CLI prints its one line, and the
client modules warn once at import (L{warn_once}).

Standard library only.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Sequence
from typing import TextIO

#: What pip leaves for the reference distribution (C{kcoral_server-...} is ours).
_DISTRIBUTION = re.compile(r"kcoral-([^-]+)\.(?:dist|egg)-info", re.IGNORECASE)


class KCoralInstallWarning(UserWarning):
    """The reference client shares this environment with kcoral-server."""


def conflict(path: Sequence[str] | None = None) -> str | None:
    """
    The one-line explanation when the reference client's distribution
    (a C{kcoral-VERSION.dist-info} or C{.egg-info} directory) is installed
    on C{path} (C{sys.path} by default), else C{None}.

    A directory listing per path entry, not C{importlib.metadata}, which
    costs a quarter of a second on every C{kcoral} command.
    """
    for entry in sys.path if path is None else path:
        if not entry:
            continue  # the working directory: not an installation
        try:
            names = os.listdir(entry)
        except OSError:
            continue  # a zip file or a missing directory
        for name in names:
            found = _DISTRIBUTION.fullmatch(name)
            if found is not None:
                return (
                    f"kcoral {found.group(1)} (the reference client) is installed in this "
                    f"environment beside kcoral-server; both are the 'kcoral' package and "
                    f"overwrite each other's files: run 'pip uninstall -y kcoral kcoral-server', "
                    f"then reinstall kcoral-server alone (the reference client belongs in its "
                    f"own virtualenv)"
                )
    return None


_warned = False


def report(stream: TextIO) -> None:
    """
    Write L{conflict}'s line (as C{kcoral: warning: ...}) on C{stream} when
    there is one; the import-time warning is then not repeated.
    """
    global _warned
    _warned = True
    line = conflict()
    if line is not None:
        stream.write(f"kcoral: warning: {line}\n")
        stream.flush()


def warn_once() -> None:
    """Warn (L{KCoralInstallWarning}) once per process when L{conflict} finds one."""
    global _warned
    if _warned:
        return
    _warned = True
    line = conflict()
    if line is not None:
        warnings.warn(line, KCoralInstallWarning, stacklevel=3)


__all__ = ["KCoralInstallWarning", "conflict", "report", "warn_once"]
