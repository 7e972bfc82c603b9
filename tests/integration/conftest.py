"""
Shared fixtures for integration tests that start real kcoral servers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kcoral.testing.live_server import ServerProcess, servers_by_flags


@pytest.fixture(scope="module")
def cpu_server() -> Iterator[Callable[..., ServerProcess]]:
    """
    A factory for CPU-mode servers that live as long as the test module.

    C{cpu_server("--sandbox", "none")} starts (once per distinct argument
    list) C{kcoral server --device cpu --num-workers 2 --log-dir ''} plus the
    given arguments, and returns the running L{ServerProcess}.
    """
    yield from servers_by_flags(["--device", "cpu", "--num-workers", "2", "--log-dir", ""])
