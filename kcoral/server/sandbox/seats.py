# -*- test-case-name: tests.unit.test_sandbox -*-
"""
The host side of a seat: its private workspace directory and the reserved
layout beneath it, made, checked, emptied and removed without following a
link a program left there.

Everything here is BLOCKING (run it in a thread) except
L{is_clean_layout}, which is bounded to a few dozen system calls.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path

#: The reserved top-level directory of a workspace.
RESERVED = ".kcoral"

#: Subdirectories of the reserved directory, recreated (mode 0700) after every clear.
RESERVED_SUBDIRS = (
    "tmp",
    "home",
    "cache",
    "cuda",
    "triton",
    "extensions",
    "libraries",
    "output",
    "shm",
)


#: The reserved subdirectories of an nvcc compile's seat: its temporary
#: files' (each directory made and removed costs a compile a little).
COMPILE_SUBDIRS = ("tmp",)


def mkdir_private(path: str) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise
    os.chmod(path, 0o700)


def layout_paths(work_dir: str) -> list[str]:
    """The reserved directories of a workspace at C{work_dir}, parents first."""
    private = f"{work_dir}/{RESERVED}"
    return [private, *(f"{private}/{sub}" for sub in RESERVED_SUBDIRS)]


def make_layout(work_dir: str, subdirs: Iterable[str]) -> None:
    mkdir_private(os.path.join(work_dir, RESERVED))
    for sub in subdirs:
        mkdir_private(os.path.join(work_dir, RESERVED, sub))


#: A tree of names to keep while clearing: C{{}} marks a kept leaf.
KeepTree = dict[str, "KeepTree"]


def _clear_dir_fd(dirfd: int, keep: KeepTree | None = None) -> None:
    """
    Remove every entry of the directory open at C{dirfd}; never follows links.

    Entries named in C{keep} stay: a leaf is left alone entirely, an inner
    node is kept as a directory and cleared with its subtree.
    """
    keep = keep or {}
    with os.scandir(dirfd) as it:
        names = [entry.name for entry in it]
    for name in names:
        kept = keep.get(name)
        if kept is not None and not kept:
            continue
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dirfd)
            try:
                os.fchmod(fd, 0o700)
                _clear_dir_fd(fd, kept)
            finally:
                os.close(fd)
            if kept is None:
                os.rmdir(name, dir_fd=dirfd)
        else:
            os.unlink(name, dir_fd=dirfd)


def empty_directory(path: Path | str, keep: KeepTree | None = None) -> None:
    """
    BLOCKING: remove everything inside C{path} but keep C{path} itself (its
    inode may be bind-mounted). Read-only files and directories are removed
    too; symbolic links are unlinked, never followed, and C{path} itself must
    not be a link.

    @param keep: relative paths to keep (see L{_clear_dir_fd}): the mount
        points that a running sandbox has inside this directory.  Removing
        one would unmount it in that sandbox.
    """
    fd = os.open(os.fspath(path), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchmod(fd, 0o700)
        _clear_dir_fd(fd, keep)
    finally:
        os.close(fd)


def _names(path: str, limit: int) -> list[str] | None:
    """At most C{limit} entry names of directory C{path}; C{None} if it has more."""
    names: list[str] = []
    with os.scandir(path) as it:
        for entry in it:
            if len(names) == limit:
                return None
            names.append(entry.name)
    return names


def _private_directory(path: str) -> bool:
    """A directory itself (not a link to one) with mode 0700."""
    st = os.lstat(path)
    return stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700


def is_clean_layout(work_dir: Path | str, subdirs: Sequence[str]) -> bool:
    """
    Whether C{work_dir} holds the reserved layout with C{subdirs} and nothing
    else: every directory private (0700) and the subdirectories empty, as
    L{empty_directory} and L{make_layout} leave it.  At most a few dozen
    system calls whatever a program did (listings stop early), so the
    reactor may ask; any doubt (an error included) answers C{False}.
    """
    work = os.fspath(work_dir)
    reserved = os.path.join(work, RESERVED)
    try:
        if not _private_directory(work) or _names(work, 1) != [RESERVED]:
            return False
        if not _private_directory(reserved):
            return False
        names = _names(reserved, len(subdirs))
        if names is None or sorted(names) != sorted(subdirs):
            return False
        for sub in subdirs:
            path = os.path.join(reserved, sub)
            if not _private_directory(path) or _names(path, 0) != []:
                return False
    except OSError:
        return False
    return True


def make_seat(seat_dir: Path, subdirs: Sequence[str]) -> Path:
    os.makedirs(seat_dir, mode=0o700, exist_ok=True)
    work = os.path.join(os.fspath(seat_dir), "work")
    mkdir_private(work)
    make_layout(work, subdirs)
    return Path(os.path.realpath(work))


def remove_seat(seat: Path) -> None:
    """BLOCKING: remove a sandbox seat, read-only leftovers included."""
    empty_directory(seat)
    os.rmdir(seat)
