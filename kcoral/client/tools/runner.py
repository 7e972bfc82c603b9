"""
Remote runner of C{kcoral run}: executes inside a worker, with the request
workspace as current directory.  Standard library only.
"""

from __future__ import annotations

import io
import os
import shutil
import stat
import subprocess
import sys
import tarfile
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath
from typing import Any


def checked(name: str) -> PurePosixPath:
    """A relative POSIX path with no '..', or ValueError."""
    path = PurePosixPath(name)
    if not name or "\\" in name or path.is_absolute() or ".." in path.parts or not path.parts:
        raise ValueError(f"expected a relative file path: {name!r}")
    return path


def unpack(archive: bytes, into: Path) -> None:
    """Write the archive's regular files below C{into} (mode 0700 or 0600)."""
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:") as tar:
        for member in tar:
            if not member.isfile():
                raise ValueError(f"input is not a regular file: {member.name!r}")
            target = into.joinpath(*checked(member.name).parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            data = tar.extractfile(member)
            if data is None:
                raise ValueError(f"input is not a regular file: {member.name!r}")
            with data, open(target, "xb") as out:
                shutil.copyfileobj(data, out)
            target.chmod(0o700 if member.mode & 0o111 else 0o600)


def fetch(inputs: Path, outputs: Path, names: Iterable[str]) -> list[str]:
    """Copy each selected path of C{inputs} into C{outputs}; return the absent ones."""
    missing = []
    for name in names:
        parts = checked(name).parts
        current = inputs
        for part in parts:
            current = current / part
            if current.is_symlink():
                raise ValueError(f"artifact is a symlink: {name}")
        if not current.exists():
            missing.append(name)
            continue
        selected = [current, *sorted(current.rglob("*"))] if current.is_dir() else [current]
        for entry in selected:
            mode = entry.lstat().st_mode
            target = outputs / entry.relative_to(inputs)
            if stat.S_ISDIR(mode):
                target.mkdir(parents=True, exist_ok=True)
            elif stat.S_ISREG(mode):
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(entry, target)
            else:
                raise ValueError(f"artifact is not a regular file or directory: {entry}")
    return missing


def run(
    archive: bytes,
    tool_run: Callable[..., dict[str, Any]],
    arguments: list[str],
    overrides: dict[str, str],
    fetch_paths: list[str],
) -> dict[str, Any]:
    inputs = Path("inputs").absolute()
    outputs = Path("outputs").absolute()
    inputs.mkdir()
    unpack(archive, inputs)
    environment = dict(os.environ)
    environment.update(overrides)
    environment["KCORAL_DIR"] = str(inputs)
    environment["PATH"] = os.pathsep.join(
        [str(Path(sys.executable).parent), environment.get("PATH", "")]
    )

    def launch(command: list[str], create_outputs: bool = True) -> int:
        if create_outputs:
            outputs.mkdir(exist_ok=True)
        program = command[0]
        if "/" in program and not os.path.isabs(program):
            program = str(inputs / program)
        found = shutil.which(program, path=environment["PATH"])
        if found is None:
            raise RuntimeError(f"{command[0]} is not installed in the remote server environment")
        # Same process group as the worker: the request timeout kills it too.
        completed = subprocess.run(
            [found, *command[1:]], cwd=inputs, env=environment, stdin=subprocess.DEVNULL
        )
        return completed.returncode

    outcome = tool_run(arguments, environment, outputs, launch)
    outputs.mkdir(exist_ok=True)
    outcome["missing"].extend(fetch(inputs, outputs, fetch_paths))
    return outcome
