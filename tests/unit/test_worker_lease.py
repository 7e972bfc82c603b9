# -*- test-case-name: tests.unit.test_worker_lease -*-
"""The worker's side of the lease over real pipes: asking, watching for the grant, giving back."""

from __future__ import annotations

import os
from typing import IO

import pytest

from kcoral.ipc.channel_io import read_message, write_message
from kcoral.wire.channel import (
    Exit,
    LeaseAcquire,
    LeaseGranted,
    LeaseNext,
    LeaseRelease,
)
from kcoral.worker import lease as lease_module
from kcoral.worker.lease import LeaseClient, watch_inbox


def _pipe() -> tuple[IO[bytes], IO[bytes]]:
    read_fd, write_fd = os.pipe()
    return os.fdopen(read_fd, "rb", buffering=1 << 16), os.fdopen(write_fd, "wb")


@pytest.fixture
def channel():
    """(the worker's lease client, the parent's end to it, the parent's end from it)."""
    inbox, to_worker = _pipe()
    from_worker, outbox = _pipe()
    yield LeaseClient(inbox, outbox), to_worker, from_worker
    for stream in (inbox, to_worker, from_worker, outbox):
        stream.close()


def test_acquire_asks_and_returns_on_the_grant(channel) -> None:
    client, to_worker, from_worker = channel
    write_message(to_worker, LeaseGranted())
    client.acquire()
    assert client.held
    assert isinstance(read_message(from_worker), LeaseAcquire)
    client.release()
    assert not client.held
    assert isinstance(read_message(from_worker), LeaseRelease)


def test_told_next_it_watches_and_takes_the_grant_already_buffered(channel) -> None:
    """
    LeaseNext and the grant in one read: the grant sits in the stream's
    buffer, not in the pipe, and the watch must see it there.
    """
    client, to_worker, _from_worker = channel
    write_message(to_worker, LeaseNext())
    write_message(to_worker, LeaseGranted())
    client.acquire()
    assert client.held
    assert os.get_blocking(client._inbox.fileno()), "the inbox is left blocking"


def test_a_watch_that_sees_nothing_ends_and_the_wait_goes_on_asleep(channel, monkeypatch) -> None:
    """Past GRANT_WATCH_SECONDS the worker sleeps in read; other messages are ignored."""
    monkeypatch.setattr(lease_module, "GRANT_WATCH_SECONDS", 0.0)
    client, to_worker, _from_worker = channel
    write_message(to_worker, LeaseNext())
    # The watch gives up at once; the blocking read then finds an unrelated
    # message, and the grant after it.
    write_message(to_worker, Exit())
    write_message(to_worker, LeaseGranted())
    client.acquire()
    assert client.held
    assert os.get_blocking(client._inbox.fileno())


def test_watch_gives_up_on_an_empty_pipe(channel, monkeypatch) -> None:
    monkeypatch.setattr(lease_module, "GRANT_WATCH_SECONDS", 0.005)
    client, _to_worker, _from_worker = channel
    client._watch_for_grant()
    assert os.get_blocking(client._inbox.fileno())


def test_watch_inbox_sees_what_arrives_and_gives_up_in_time(channel) -> None:
    client, to_worker, _from_worker = channel
    inbox = client._inbox
    assert watch_inbox(inbox, 0.0) is False
    write_message(to_worker, Exit())
    assert watch_inbox(inbox, 1.0) is True
    assert os.get_blocking(inbox.fileno())
    assert isinstance(read_message(inbox), Exit)
