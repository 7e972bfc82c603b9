"""
Shared fixtures for integration tests that start real kcoral servers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kcoral.testing.live_server import ServerProcess, servers_by_flags

from .refclient import RefClientUnavailable, ensure_venv


@pytest.fixture(scope="module")
def cpu_server() -> Iterator[Callable[..., ServerProcess]]:
    """
    A factory for CPU-mode servers that live as long as the test module.

    C{cpu_server("--sandbox", "none")} starts (once per distinct argument
    list) C{kcoral server --device cpu --num-workers 2 --log-dir ''} plus the
    given arguments, and returns the running L{ServerProcess}.
    """
    yield from servers_by_flags(["--device", "cpu", "--num-workers", "2", "--log-dir", ""])


@pytest.fixture(scope="module")
def refclient() -> Path:
    """The reference client 0.1.1's virtualenv (L{ensure_venv}); skips without PyPI."""
    try:
        return ensure_venv()
    except RefClientUnavailable as e:  # pragma: no cover - needs PyPI
        pytest.skip(str(e))
