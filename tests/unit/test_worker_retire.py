"""
Tests for the worker's side of a retirement (L{kcoral.worker.__main__._retire}):
a GPU worker waits for C{teardown}, destroys its contexts, answers
C{torn_down} and leaves at once; a CPU worker leaves at once.
"""

from __future__ import annotations

import io
from typing import Any

import pytest

from kcoral.ipc.channel_io import read_message, write_message
from kcoral.wire.channel import (
    Exit,
    Teardown,
    TornDown,
)
from kcoral.worker import __main__ as worker_main


class _Backend:
    def __init__(self, uses_lease: bool, destroyed: bool = True) -> None:
        self.uses_lease = uses_lease
        self.destroyed = destroyed
        self.calls = 0

    def destroy_context(self) -> bool:
        self.calls += 1
        return self.destroyed


class _Exited(Exception):
    pass


def _inbox(*messages: Any) -> io.BytesIO:
    stream = io.BytesIO()
    for message in messages:
        write_message(stream, message)
    stream.seek(0)
    return stream


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    codes: list[int] = []

    def fake_exit(code: int) -> None:
        codes.append(code)
        raise _Exited()

    monkeypatch.setattr(worker_main.os, "_exit", fake_exit)
    return codes


def test_cpu_worker_leaves_at_once(exits: list[int]) -> None:
    """A CPU worker has no context: it returns without reading anything."""
    outbox = io.BytesIO()
    assert worker_main._retire(_inbox(), outbox, _Backend(uses_lease=False)) == 0
    assert outbox.getvalue() == b"" and exits == []


@pytest.mark.parametrize("destroyed", [True, False])
def test_gpu_worker_tears_down_then_exits(exits: list[int], destroyed: bool) -> None:
    """On teardown: contexts destroyed, torn_down answered, then os._exit(0)."""
    backend = _Backend(uses_lease=True, destroyed=destroyed)
    outbox = io.BytesIO()
    with pytest.raises(_Exited):
        worker_main._retire(_inbox(Teardown()), outbox, backend)
    assert exits == [0] and backend.calls == 1
    outbox.seek(0)
    answer = read_message(outbox)
    assert isinstance(answer, TornDown) and answer.destroyed is destroyed
    assert answer.seconds >= 0


def test_gpu_worker_exit_or_end_leaves_normally(exits: list[int]) -> None:
    """Exit (or the channel's end) while waiting: a normal exit, nothing destroyed."""
    backend = _Backend(uses_lease=True)
    assert worker_main._retire(_inbox(Exit()), io.BytesIO(), backend) == 0
    assert worker_main._retire(_inbox(), io.BytesIO(), backend) == 0
    assert backend.calls == 0 and exits == []


def test_backend_notices_logged_between_programs() -> None:
    """A backend's notes go to the worker's stderr once; a backend without any is fine."""

    class Noting:
        notes = ["page-locking a result buffer failed (cuMemHostRegister returned 201)"]

        def take_notices(self) -> list[str]:
            notes, self.notes = self.notes, []
            return notes

    stream = io.StringIO()
    backend = Noting()
    worker_main._log_notices(backend, stream)
    worker_main._log_notices(backend, stream)
    worker_main._log_notices(_Backend(uses_lease=False), stream)
    assert stream.getvalue() == (
        "kcoral worker: page-locking a result buffer failed (cuMemHostRegister returned 201)\n"
    )
