"""Tests for L{kcoral.ipc.board}: the progress board a worker posts on."""

from __future__ import annotations

import fcntl
import os

import pytest

from kcoral.ipc import board, shared

pytestmark = pytest.mark.skipif(not shared.available(), reason="no sealed memfds here")


def test_posted_index_is_read_and_cleared() -> None:
    fd = board.create()
    try:
        assert board.read(fd) is None
        poster = board.attach(fd)
        assert poster is not None
        poster.post(7)
        assert board.read(fd) == 7
        poster.post(0)
        assert board.read(fd) == 0
        board.clear(fd)
        assert board.read(fd) is None
    finally:
        os.close(fd)


def test_a_program_cannot_shrink_or_grow_it() -> None:
    """Sealed: a truncated board could make a read of it fail or a mapping of it fault."""
    fd = board.create()
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 4096)
        with pytest.raises(PermissionError):
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        assert os.fstat(fd).st_size == board.SIZE
    finally:
        os.close(fd)


def test_negative_claims_read_as_nothing() -> None:
    fd = board.create()
    try:
        poster = board.attach(fd)
        assert poster is not None
        poster.post(-5)
        assert board.read(fd) is None
    finally:
        os.close(fd)


def test_attach_refuses_what_is_not_a_board() -> None:
    """An fd 6 inherited from elsewhere is never mapped and written to."""
    plain = os.memfd_create("not-a-board")
    os.ftruncate(plain, board.SIZE)
    r, w = os.pipe()
    try:
        assert board.attach(plain) is None
        assert board.attach(r) is None
        assert board.attach(999) is None
    finally:
        for fd in (plain, r, w):
            os.close(fd)
