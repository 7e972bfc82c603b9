# -*- test-case-name: tests.unit.test_client_program -*-
"""
L{Program}: the client-side builder of a KCoral program (protocol §4), with
the 0.1.1 client's methods, arguments and wire output.

Building contacts no server.  Uploads snapshot their data when the method is
called; each distinct blob is kept once, by SHA-256, until the program is
sent.  Instruction objects carry their keys in the order 0.1.1 writes them,
so both clients send byte-identical program JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kcoral.wire.program import (
    DTYPES,
    LANGUAGES,
    check_path_conflicts,
    normalize_path,
    tensor_nbytes,
)

#: A server function a C{run} may name instead of a register (protocol §10.2).
_BUILTIN = re.compile(r"builtin\.[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Register:
    """A handle to the value an earlier instruction of the same program produced."""

    id: str


def _ref(register: Register) -> dict[str, str]:
    return {"$ref": register.id}


def _as_bytes(value: Any, message: str) -> bytes:
    """A private copy of bytes-like C{value} (C{bytes} is immutable: kept as is)."""
    if isinstance(value, bytes):
        return value
    try:
        return bytes(memoryview(value))
    except TypeError:
        raise TypeError(message) from None


def _reference(value: Register | dict[str, str], what: str) -> dict[str, str]:
    reference = _ref(value) if isinstance(value, Register) else value
    if not (
        isinstance(reference, dict)
        and set(reference) == {"$ref"}
        and isinstance(reference["$ref"], str)
    ):
        raise TypeError(f"{what} must be a Register or {{'$ref': id}}")
    return reference


def _little_endian(array: Any) -> Any:
    import numpy as np

    array = np.ascontiguousarray(array)
    order = array.dtype.byteorder
    if order == ">" or (order == "=" and sys.byteorder == "big"):
        array = array.astype(array.dtype.newbyteorder("<"))
    return array


def tensor_bytes(value: Any) -> tuple[str, list[int], bytes]:
    """
    C{(dtype, shape, little-endian C-contiguous bytes)} of a NumPy array, a
    PyTorch tensor or any DLPack tensor.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        return str(tensor.dtype).removeprefix("torch."), [int(d) for d in tensor.shape], data
    import numpy as np

    if isinstance(value, np.ndarray):
        array = _little_endian(value)
        return array.dtype.name, [int(d) for d in array.shape], array.tobytes()
    if hasattr(value, "__dlpack__"):
        try:
            array = np.from_dlpack(value)
        except Exception:
            array = None
        if array is not None:
            return tensor_bytes(array)
    if all(hasattr(value, name) for name in ("dtype", "shape", "tobytes")):
        return str(value.dtype), [int(d) for d in value.shape], value.tobytes()
    raise TypeError(f"cannot upload {type(value).__name__!r} as a tensor")


def _tensor_fields(
    value: Any, dtype: str | None, shape: list[int] | None
) -> tuple[str, list[int], bytes]:
    if isinstance(value, bytes | bytearray | memoryview):
        if dtype is None or shape is None:
            raise TypeError("raw tensor bytes require 'dtype' and 'shape'")
        fields = (
            dtype,
            list(shape),
            _as_bytes(value, "tensor upload requires bytes-like raw data"),
        )
    else:
        fields = tensor_bytes(value)
        if dtype is not None and dtype != fields[0]:
            raise ValueError(f"declared dtype {dtype!r} does not match value dtype {fields[0]!r}")
        if shape is not None and list(shape) != fields[1]:
            raise ValueError(f"declared shape {shape!r} does not match value shape {fields[1]!r}")
    name, dims, raw = fields
    if name not in DTYPES:
        raise ValueError(f"unsupported tensor dtype: {name!r}")
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in dims):
        raise ValueError("tensor shape must be a list of non-negative integers")
    expected = tensor_nbytes(name, dims)
    if len(raw) != expected:
        raise ValueError(f"tensor metadata expects {expected} bytes, got {len(raw)}")
    return name, dims, raw


def _read_regular(path: Path) -> bytes:
    """A regular file's bytes, refusing links and files that change meanwhile."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as stream:
        before = os.fstat(stream.fileno())
        if not stat.S_ISREG(before.st_mode):
            raise ValueError(f"upload_folder requires a regular file: {path}")
        data = stream.read(before.st_size)
        after = os.fstat(stream.fileno())
    if len(data) != before.st_size or (after.st_size, after.st_mtime_ns) != (
        before.st_size,
        before.st_mtime_ns,
    ):
        raise ValueError(f"upload_folder file changed while reading: {path}")
    return data


def folder_files(folder: str | os.PathLike[str], destination: str) -> list[tuple[str, bytes]]:
    """
    Every regular file below C{folder} as C{(destination path, bytes)},
    hidden files included; symbolic links, special files and a directory
    reached twice are refused.
    """
    root = Path(folder)
    if root.is_symlink():
        raise ValueError(f"upload_folder rejects symbolic links: {root}")
    if not root.is_dir():
        raise NotADirectoryError(f"upload_folder needs a directory: {root}")
    found: list[tuple[str, bytes]] = []
    seen: set[tuple[int, int]] = set()
    pending = [(root, destination)]
    while pending:
        directory, remote = pending.pop()
        info = directory.stat(follow_symlinks=False)
        if (info.st_dev, info.st_ino) in seen:
            raise ValueError(f"upload_folder encountered a repeated directory: {remote}")
        seen.add((info.st_dev, info.st_ino))
        with os.scandir(directory) as entries:
            for entry in entries:
                target = normalize_path(f"{remote}/{entry.name}")
                mode = entry.stat(follow_symlinks=False).st_mode
                if stat.S_ISDIR(mode):
                    pending.append((Path(entry.path), target))
                elif stat.S_ISREG(mode):
                    found.append((target, _read_regular(Path(entry.path))))
                else:
                    raise ValueError(
                        f"upload_folder rejects symbolic links and special files: {target}"
                    )
    return sorted(found)


class Program:
    """
    An ordered, self-contained sequence of instructions for one request.

    Each handle-producing instruction gets an id (C{upload_0},
    C{get_function_1}, C{run_2}...) unless one is given; ids and return
    keys are unique.  Only values selected with L{return_},
    L{return_file} or L{return_folder} come back.
    """

    def __init__(self) -> None:
        self._instructions: list[dict[str, Any]] = []
        self._blobs: dict[str, bytes] = {}
        self._ids: set[str] = set()
        self._next_id = 0
        self._return_keys: set[str] = set()
        self._file_paths: set[str] = set()

    def __repr__(self) -> str:
        return f"Program({len(self._instructions)} instructions, {len(self._blobs)} blobs)"

    @property
    def instructions(self) -> list[dict[str, Any]]:
        """A shallow copy of the wire instruction list (treat the dicts as read-only)."""
        return list(self._instructions)

    @property
    def blobs(self) -> dict[str, bytes]:
        """The program's distinct blobs by SHA-256, in order of first use."""
        return dict(self._blobs)

    def _blob(self, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        self._blobs.setdefault(digest, data)
        return digest

    def _add_id(self, wanted: str | None, op: str) -> str:
        if wanted is None:
            wanted = f"{op}_{self._next_id}"
            while wanted in self._ids:
                self._next_id += 1
                wanted = f"{op}_{self._next_id}"
            self._next_id += 1
        if not isinstance(wanted, str) or not wanted:
            raise ValueError("instruction id must be a non-empty string")
        if wanted in self._ids:
            raise ValueError(f"duplicate instruction id: {wanted!r}")
        self._ids.add(wanted)
        return wanted

    def _known(self, reference: dict[str, str], owner: str) -> None:
        if reference["$ref"] not in self._ids:
            raise ValueError(f"{owner} references unknown handle {reference['$ref']!r}")

    def upload(
        self,
        *,
        id: str | None = None,
        kind: str,
        source: str | None = None,
        value: Any = None,
        dtype: str | None = None,
        shape: list[int] | None = None,
        language: str | None = None,
    ) -> Register:
        """
        Upload a Python module (C{source}), a tensor (C{value}: NumPy, torch
        or DLPack tensor, or raw bytes with C{dtype} and C{shape}), bytes or
        a library (C{value}, bytes-like).  Use L{upload_file} for files.

        C{language} (modules only; an addition to the 0.1.1 API) is
        C{"python"} (the default) or C{"cuda"}: a CUDA C module runs nothing
        when uploaded; L{get_function} names one of its kernels for
        C{builtin.compile_cuda} or C{builtin.compile_cuda_binary}.  Without
        C{language} the instruction is byte-identical to 0.1.1's.
        """
        if language is not None and kind != "module":
            raise TypeError(f"{kind} upload does not accept 'language'")
        if kind == "module":
            if not isinstance(source, str):
                raise TypeError("module upload requires string 'source'")
            if value is not None or dtype is not None or shape is not None:
                raise TypeError("module upload does not accept tensor fields")
            instruction: dict[str, Any] = {"op": "upload", "kind": "module"}
            if language is not None:
                if language not in LANGUAGES:
                    raise ValueError(
                        f"module language must be one of {sorted(LANGUAGES)}, got {language!r}"
                    )
                instruction["language"] = language
            instruction["source"] = source
        elif kind == "tensor":
            if source is not None:
                raise TypeError("tensor upload does not accept 'source'")
            name, dims, raw = _tensor_fields(value, dtype, shape)
            digest = self._blob(raw)
            instruction = {"op": "upload", "kind": "tensor", "blob": digest}
            instruction.update(dtype=name, shape=dims)
        elif kind in ("bytes", "library"):
            if source is not None:
                raise TypeError(f"{kind} upload does not accept 'source'")
            if dtype is not None or shape is not None:
                raise TypeError(f"{kind} upload does not accept tensor fields")
            raw = _as_bytes(value, f"{kind} upload requires a bytes-like 'value'")
            instruction = {"op": "upload", "kind": kind, "blob": self._blob(raw)}
        else:
            raise ValueError("upload kind must be 'module', 'tensor', 'bytes', or 'library'")
        instruction["id"] = self._add_id(id, "upload")
        self._instructions.append(instruction)
        return Register(instruction["id"])

    def upload_file(self, *, blob: Any, path: str, id: str | None = None) -> Register:
        """
        Write bytes-like C{blob} at the relative C{path} of the request's
        workspace; the register holds the normalized path string.
        """
        normalized = normalize_path(path)
        raw = _as_bytes(blob, "file upload requires a bytes-like 'blob'")
        check_path_conflicts([*self._file_paths, normalized])
        digest = hashlib.sha256(raw).hexdigest()
        new_id = self._add_id(id, "upload")
        self._file_paths.add(normalized)
        self._blobs.setdefault(digest, raw)
        self._instructions.append(
            {"op": "upload", "id": new_id, "kind": "file", "blob": digest, "path": normalized}
        )
        return Register(new_id)

    def upload_folder(self, folder: str | os.PathLike[str], *, path: str) -> None:
        """
        Upload every regular file below local C{folder} beneath C{path}
        (C{folder/a.bin} with C{path="inputs"} becomes C{inputs/a.bin}).
        Empty directories and metadata are not sent; a failed call leaves
        the program unchanged.
        """
        destination = normalize_path(path)
        files = folder_files(folder, destination)
        check_path_conflicts([*self._file_paths, *(name for name, _ in files)])
        for name, data in files:
            digest = self._blob(data)
            self._file_paths.add(name)
            self._instructions.append(
                {
                    "op": "upload",
                    "kind": "file",
                    "blob": digest,
                    "path": name,
                    "id": self._add_id(None, "upload"),
                }
            )

    def get_function(
        self,
        *,
        id: str | None = None,
        module: Register | dict[str, str],
        name: str,
        cpu_only: bool = False,
    ) -> Register:
        """
        Select C{name} from an earlier module or library upload; C{cpu_only}
        declares that running it needs no GPU (the lease is released).
        """
        reference = _reference(module, "module")
        self._known(reference, f"get_function {id!r}")
        if not isinstance(name, str) or not name:
            raise ValueError("function name must be a non-empty string")
        if not isinstance(cpu_only, bool):
            raise TypeError("cpu_only must be a bool")
        new_id = self._add_id(id, "get_function")
        instruction: dict[str, Any] = {
            "op": "get_function",
            "id": new_id,
            "module": reference,
            "name": name,
        }
        if cpu_only:
            instruction["cpu_only"] = True
        self._instructions.append(instruction)
        return Register(new_id)

    def run(
        self, *, id: str | None = None, fn: Register | str, args: list[Any] | None = None
    ) -> Register:
        """
        Call C{fn} with C{args}: top-level registers are passed as handles,
        everything else as JSON literals (nested C{{"$ref": ...}} stays data).

        C{fn} is a register (a L{get_function} handle, or a callable an
        earlier C{run} returned), or, as an addition to the 0.1.1 API, the
        name of a server builtin such as C{"builtin.compile_cuda_binary"},
        C{"builtin.kernel"}, C{"builtin.benchmark"} or
        C{"builtin.check_close"} (protocol §10.2; docs/client.md lists them).
        A server that lacks the builtin answers 400 C{parse} or fails the
        instruction with C{unavailable}.
        """
        wire_fn: str | dict[str, str]
        if isinstance(fn, str):
            if not _BUILTIN.fullmatch(fn):
                raise ValueError(f"a function name must be 'builtin.<name>', got {fn!r}")
            wire_fn = fn
        elif isinstance(fn, Register):
            self._known(_ref(fn), f"run {id!r}")
            wire_fn = _ref(fn)
        else:
            raise TypeError("fn must be a Register or a 'builtin.<name>' string")
        wire_args = [_ref(a) if isinstance(a, Register) else a for a in (args or [])]
        new_id = self._add_id(id, "run")
        self._instructions.append({"op": "run", "id": new_id, "fn": wire_fn, "args": wire_args})
        return Register(new_id)

    def _check_key(self, key: str) -> None:
        if not isinstance(key, str) or not key:
            raise ValueError("return key must be a non-empty string")
        if key in self._return_keys:
            raise ValueError(f"duplicate return key: {key!r}")

    def return_(self, *, key: str, value: Register | dict[str, str]) -> None:
        """Return an earlier value under C{key} (kept even if a later instruction fails)."""
        self._check_key(key)
        reference = _reference(value, "return value")
        self._known(reference, f"return {key!r}")
        self._return_keys.add(key)
        self._instructions.append({"op": "return", "key": key, "value": reference})

    def _return_path(self, key: str, path: str | Register, kind: str) -> None:
        self._check_key(key)
        wire_path: str | dict[str, str]
        if isinstance(path, Register):
            reference = _ref(path)
            self._known(reference, f"return {key!r}")
            wire_path = reference
        else:
            wire_path = normalize_path(path)
        self._instructions.append({"op": "return", "key": key, "kind": kind, "path": wire_path})
        self._return_keys.add(key)

    def return_file(self, *, key: str, path: str | Register) -> None:
        """Return the regular file at C{path} (workspace-relative) at this point."""
        self._return_path(key, path, "file")

    def return_folder(self, *, key: str, path: str | Register) -> None:
        """Return the folder at C{path}: hidden files and empty directories included."""
        self._return_path(key, path, "folder")


def program_json(program: Program, options: dict[str, Any] | None = None) -> bytes:
    """
    The C{program} part (protocol §3.1): compact UTF-8 JSON, non-ASCII kept
    raw, no non-finite numbers, C{options} only when one was given.
    """
    payload: dict[str, Any] = {"instructions": program.instructions}
    if options:
        payload["options"] = options
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def execute_options(
    timeout_seconds: float | None, gpu_count: int | None, output_limit_bytes: int | None
) -> dict[str, Any]:
    """The C{options} object of one execution, in the 0.1.1 key order."""
    options: dict[str, Any] = {}
    if gpu_count is not None:
        if isinstance(gpu_count, bool) or not isinstance(gpu_count, int) or not 1 <= gpu_count <= 8:
            raise ValueError("gpu_count must be an integer between 1 and 8")
        options["gpu_count"] = gpu_count
    if timeout_seconds is not None:
        options["timeout_seconds"] = timeout_seconds
    if output_limit_bytes is not None:
        options["output_limit_bytes"] = output_limit_bytes
    return options


__all__ = [
    "Program",
    "Register",
    "execute_options",
    "folder_files",
    "program_json",
    "tensor_bytes",
]
