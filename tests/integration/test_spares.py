"""
Warm spares with real worker processes on a CPU server: they appear on
/health, a fresh-mode request's seat is refilled from them, and without
them the server behaves as before (docs/architecture.md, "Warm spares").
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kcoral.testing.live_server import ServerProcess

from .test_server import BASE_ARGS, PID, gone, program, result_value, wait_for

pytestmark = pytest.mark.integration

#: A value only this process has (pids repeat in a sandbox's PID namespace).
TOKEN = (
    "import sys, uuid\n"
    "def f():\n"
    "    return sys.__dict__.setdefault('_kcoral_test_token', uuid.uuid4().hex)\n"
)


def _ready_spares(health: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in health.get("spares", []) if s["state"] == "ready"]


@pytest.fixture(params=["none", "bubblewrap"])
def spare_server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """One CPU worker, fresh per request, two spares; without a sandbox and in bubblewrap."""
    args = [*BASE_ARGS, "--num-workers", "1", "--spare-workers-per-gpu", "2"]
    args[args.index("--sandbox") + 1] = request.param
    with ServerProcess(args, log_path=tmp_path / "server.log") as s:
        yield s


def test_spares_on_health(spare_server: ServerProcess) -> None:
    """Spares are listed apart from the workers and add no request capacity."""
    wait_for(lambda: len(_ready_spares(spare_server.health())) == 2)
    health = spare_server.health()
    assert len(health["workers"]) == 1
    assert health["load"]["request_capacity"] == 1
    spares = health["spares"]
    assert [s["spare_id"] for s in spares] == ["cpu/s1", "cpu/s2"]
    assert all(isinstance(s["pid"], int) for s in spares)


def test_fresh_requests_use_spares(spare_server: ServerProcess) -> None:
    """
    Each request runs in a new process, which was a ready spare: the seat
    is refilled at once (capacity stays 1), the old process goes, and the
    spares are replenished.
    """
    wait_for(lambda: len(_ready_spares(spare_server.health())) == 2)
    health = spare_server.health()
    spare_pids = {s["pid"] for s in health["spares"]}
    first_pid = health["workers"][0]["pid"]
    first = result_value(spare_server.execute(program(TOKEN)))
    health = spare_server.health()
    # The seat's new worker is a former spare, ready at once.
    second_pid = health["workers"][0]["pid"]
    assert second_pid in spare_pids
    assert health["load"]["request_capacity"] == 1
    second = result_value(spare_server.execute(program(TOKEN)))
    assert second != first
    assert gone([first_pid, second_pid])
    wait_for(lambda: len(_ready_spares(spare_server.health())) == 2)


def test_no_spares_as_before(tmp_path: Path) -> None:
    """With --spare-workers-per-gpu 0 there are no spares; requests still get fresh workers."""
    with ServerProcess(
        [*BASE_ARGS, "--num-workers", "1", "--spare-workers-per-gpu", "0"],
        log_path=tmp_path / "server.log",
    ) as server:
        assert server.health()["spares"] == []
        first = result_value(server.execute(program(PID)))
        second = result_value(server.execute(program(PID)))
        assert first != second
        assert server.health()["spares"] == []
