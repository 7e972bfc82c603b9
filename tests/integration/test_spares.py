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


def _ready_spares(health: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in health.get("spares", []) if s["state"] == "ready"]


@pytest.fixture
def spare_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """One CPU worker, fresh per request, two spares."""
    with ServerProcess(
        [*BASE_ARGS, "--num-workers", "1", "--spare-workers-per-gpu", "2"],
        log_path=tmp_path / "server.log",
    ) as s:
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
    is refilled at once (capacity stays 1) and the spares are replenished.
    """
    wait_for(lambda: len(_ready_spares(spare_server.health())) == 2)
    spare_pids = {s["pid"] for s in spare_server.health()["spares"]}
    first = result_value(spare_server.execute(program(PID)))
    health = spare_server.health()
    # The seat's new worker is a former spare, ready at once.
    assert health["workers"][0]["pid"] in spare_pids
    assert health["load"]["request_capacity"] == 1
    second = result_value(spare_server.execute(program(PID)))
    assert second != first
    assert gone([first])
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
