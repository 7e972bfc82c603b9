# -*- test-case-name: tests.unit.test_client_results -*-
"""
Returned files and folders (protocol §7.3): in-memory snapshots that a
caller reads or saves explicitly, with the 0.1.1 client's names.

They are standard-library dataclasses, as in 0.1.1, so that scripts using
C{dataclasses} helpers on them keep working.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from kcoral.wire.program import ValidationError, normalize_path


def check_manifest(files: Mapping[str, object], directories: tuple[str, ...] | list[str]) -> None:
    """
    Reject a folder manifest that is not canonical, sorted and closed under
    parents (the rules of protocol §7.3), before anything touches a disk.
    """
    names = [*files, *directories]
    for name in names:
        if not isinstance(name, str) or normalize_path(name) != name:
            raise ValidationError("folder paths must be canonical relative POSIX paths")
    if list(files) != sorted(files) or list(directories) != sorted(directories):
        raise ValidationError("folder entries must be sorted")
    if len(set(names)) != len(names):
        raise ValidationError("folder contains duplicate or conflicting paths")
    known = set(directories)
    for name in names:
        parent = name.rpartition("/")[0]
        if parent and parent not in known:
            raise ValidationError(f"folder entry has a missing or conflicting parent: {name!r}")


def _check_destination(path: Path) -> None:
    if ".." in path.parts or path.name in ("", ".", ".."):
        raise ValueError("save destination must name a file or folder without '..'")


@dataclass(frozen=True)
class ReturnedFile:
    """A returned regular file: its bytes, independent of the remote workspace."""

    _data: bytes

    def __post_init__(self) -> None:
        if not isinstance(self._data, bytes):
            raise TypeError("ReturnedFile contents must be bytes")

    def read_bytes(self) -> bytes:
        """The file's contents."""
        return self._data

    def save(self, destination: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """
        Write the file at C{destination}, whose parent must exist.

        The destination must be new unless C{overwrite=True}, which may only
        replace a regular file; a symbolic link is never followed.  The file
        appears whole (written under a temporary name, then linked or
        renamed).
        """
        path = Path(destination)
        _check_destination(path)
        try:
            info = path.lstat()
        except FileNotFoundError:
            info = None
        if info is not None:
            if not overwrite:
                raise FileExistsError(f"save destination already exists: {str(path)!r}")
            if not stat.S_ISREG(info.st_mode):
                raise ValueError("overwrite requires a regular file destination")
        staging = path.with_name(f".kcoral-{secrets.token_hex(16)}")
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "wb") as stream:
                stream.write(self._data)
            if overwrite:
                os.replace(staging, path)
            else:
                os.link(staging, path)
        finally:
            try:
                os.unlink(staging)
            except FileNotFoundError:
                pass
        return path


@dataclass(frozen=True)
class ReturnedFolder:
    """
    A returned folder: files by relative path and every subdirectory
    (sorted, empty ones included, the root excluded).
    """

    files: Mapping[str, ReturnedFile]
    directories: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        files = dict(self.files)
        directories = tuple(self.directories)
        check_manifest(files, directories)
        if any(not isinstance(item, ReturnedFile) for item in files.values()):
            raise TypeError("ReturnedFolder files must contain ReturnedFile values")
        object.__setattr__(self, "files", MappingProxyType(files))
        object.__setattr__(self, "directories", directories)

    def save(self, destination: str | os.PathLike[str]) -> Path:
        """
        Create the folder at C{destination} (which must not exist; its
        parent must) with its directories and files; on failure nothing is
        left behind.
        """
        path = Path(destination)
        _check_destination(path)
        os.mkdir(path, 0o700)
        try:
            for directory in self.directories:
                os.mkdir(path / directory, 0o700)
            for name, item in self.files.items():
                fd = os.open(
                    path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600
                )
                with os.fdopen(fd, "wb") as stream:
                    stream.write(item.read_bytes())
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        return path


__all__ = ["ReturnedFile", "ReturnedFolder", "check_manifest"]
