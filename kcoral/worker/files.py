# -*- test-case-name: tests.unit.test_worker_engine -*-
"""
Safe file I/O inside a request's workspace: C{upload file} writes and
C{return file}/C{return folder} reads (protocol §5.4, §7.3).

Every path component is opened relative to its parent's fd with
C{O_NOFOLLOW}, so a symbolic link planted by the program never leads
outside the workspace, and a file is checked not to change while it is read.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from typing import Any

from kcoral.wire.values import PartCollector, SerializationError, file_node

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@contextlib.contextmanager
def _open_parent(workspace: str, components: list[str], create: bool) -> Iterator[int]:
    """
    Yield a directory fd for C{components} below C{workspace}, opening each
    component without following symbolic links (and creating missing ones
    with mode 0700 when C{create}).
    """
    fd = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for component in components:
            if create:
                try:
                    os.mkdir(component, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass
            child = os.open(component, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def materialize_file(workspace: str, path: str, data: bytes | memoryview) -> None:
    """Create C{path} (normalized) below C{workspace} exclusively, mode 0600."""
    *parents, name = path.split("/")
    with _open_parent(workspace, parents, create=True) as parent:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(name, flags, 0o600, dir_fd=parent)
        try:
            os.fchmod(fd, 0o600)
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
        finally:
            os.close(fd)


class Budget:
    """Bytes that file and folder returns may still add to the response."""

    def __init__(self, remaining: int) -> None:
        self.remaining = remaining

    def take(self, count: int) -> None:
        if count > self.remaining:
            raise SerializationError("file return exceeds max_response_bytes binary budget")
        self.remaining -= count


def _read_regular(dir_fd: int, name: str, budget: Budget) -> bytes:
    before = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if stat.S_ISLNK(before.st_mode):
        raise SerializationError(f"{name!r} is a symbolic link")
    if not stat.S_ISREG(before.st_mode):
        raise SerializationError(f"{name!r} is not a regular file")
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (before.st_dev, before.st_ino):
            raise SerializationError(f"{name!r} changed while it was read")
        budget.take(opened.st_size)
        chunks = []
        remaining = opened.st_size + 1
        while remaining > 0:
            chunk = os.read(fd, min(remaining, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
        data = b"".join(chunks)
        after = os.fstat(fd)
    finally:
        os.close(fd)
    if len(data) != opened.st_size or (after.st_size, after.st_mtime_ns) != (
        opened.st_size,
        opened.st_mtime_ns,
    ):
        raise SerializationError(f"{name!r} changed while it was read")
    return data


def _file_node(data: bytes, parts: PartCollector) -> dict[str, Any]:
    name, sha = parts.add(data)
    return file_node(name, sha, len(data))


def collect_file(workspace: str, path: str, parts: PartCollector, budget: Budget) -> dict[str, Any]:
    """Capture the regular file at C{path} (protocol §7.3)."""
    *parents, name = path.split("/")
    with _open_parent(workspace, parents, create=False) as parent:
        return _file_node(_read_regular(parent, name, budget), parts)


def collect_folder(
    workspace: str, path: str, parts: PartCollector, budget: Budget
) -> dict[str, Any]:
    """Capture the folder at C{path}: every file and directory, no symlinks."""
    components = path.split("/")
    files: dict[str, bytes] = {}
    directories: list[str] = []
    seen: set[tuple[int, int]] = set()

    def walk(fd: int, prefix: str) -> None:
        info = os.fstat(fd)
        if (info.st_dev, info.st_ino) in seen:
            raise SerializationError(f"directory {prefix or '.'!r} was reached twice")
        seen.add((info.st_dev, info.st_ino))
        for entry in sorted(os.listdir(fd)):
            relative = f"{prefix}{entry}"
            mode = os.stat(entry, dir_fd=fd, follow_symlinks=False).st_mode
            if stat.S_ISDIR(mode):
                directories.append(relative)
                child = os.open(entry, _DIR_FLAGS, dir_fd=fd)
                try:
                    walk(child, relative + "/")
                finally:
                    os.close(child)
            elif stat.S_ISREG(mode):
                files[relative] = _read_regular(fd, entry, budget)
            elif stat.S_ISLNK(mode):
                raise SerializationError(f"{relative!r} is a symbolic link")
            else:
                raise SerializationError(f"{relative!r} is not a regular file or directory")

    with _open_parent(workspace, components, create=False) as root:
        walk(root, "")
    return {
        "type": "folder",
        "files": {key: _file_node(files[key], parts) for key in sorted(files)},
        "directories": sorted(directories),
    }
