# -*- test-case-name: tests.unit.test_wire_program -*-
"""
The program model: validated instructions as frozen attrs values.

A program arrives as strict JSON (protocol §4).  L{parse_program} turns its
bytes into a L{Program} or raises L{ValidationError} with the reference's
message; nothing here does I/O, so the server validates with it and the worker
re-reads the same bytes with it.
"""

from __future__ import annotations

from typing import Union

import attrs

#: Error kind used for every validation failure (HTTP 400, protocol §9.2).
PARSE = "parse"

#: Ops that bind a handle.
HANDLE_OPS = frozenset({"upload", "get_function", "run"})

#: Upload kinds whose bytes travel as blobs.
BLOB_KINDS = frozenset({"tensor", "bytes", "library", "file"})

#: Upload kinds kept in the memory cache (files go to the disk cache).
MEMORY_KINDS = frozenset({"tensor", "bytes", "library"})


class ValidationError(ValueError):
    """
    The request or program breaks a protocol rule.

    @ivar message: the text sent as C{error.message} in the 400 body.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@attrs.frozen
class Ref:
    """A C{{"$ref": id}} reference to an earlier handle."""

    target: str


@attrs.frozen
class BuiltinName:
    """A legacy string C{fn} naming a server builtin (protocol §10.2)."""

    name: str


#: A C{run} argument: a reference, or a decoded JSON literal.
Argument = Union[Ref, None, bool, int, float, str, list, dict]


@attrs.frozen
class Options:
    """
    The program's C{options}, as sent (before the server clamps them).

    C{None} means the key was absent.
    """

    gpu_count: int | None = None
    timeout_seconds: float | None = None
    output_limit_bytes: int | None = None


@attrs.frozen
class Upload:
    """
    An C{upload} instruction.

    Only the fields of its C{kind} are set; the others stay C{None}.
    C{id} is C{None} only for the legacy id-less file upload.
    C{path} is already normalized (protocol §4.10).
    """

    index: int
    id: str | None
    kind: str
    source: str | None = None
    language: str = "python"
    blob: str | None = None
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    path: str | None = None

    op = "upload"


@attrs.frozen
class GetFunction:
    """A C{get_function} instruction."""

    index: int
    id: str
    module: Ref
    name: str
    cpu_only: bool = False

    op = "get_function"


@attrs.frozen
class Run:
    """A C{run} instruction; C{fn} is a L{Ref} or a L{BuiltinName}."""

    index: int
    id: str
    fn: Ref | BuiltinName
    args: tuple[Argument, ...] = ()

    op = "run"


@attrs.frozen
class Return:
    """
    A C{return} instruction.

    A value return has C{value} set and C{kind} C{None}; a file or folder
    return has C{kind} (C{"file"} or C{"folder"}) and C{path}, a L{Ref} or a
    normalized literal path.
    """

    index: int
    key: str
    value: Ref | None = None
    kind: str | None = None
    path: Ref | str | None = None

    op = "return"
    id = None


Instruction = Union[Upload, GetFunction, Run, Return]


@attrs.frozen
class Program:
    """A validated program."""

    instructions: tuple[Instruction, ...]
    options: Options = Options()

    def referenced_blobs(self) -> tuple[str, ...]:
        """
        The distinct blob digests of blob-backed uploads, in order of first
        appearance (protocol §5.1 step 1).
        """
        seen: dict[str, None] = {}
        for instruction in self.instructions:
            if isinstance(instruction, Upload) and instruction.blob is not None:
                seen.setdefault(instruction.blob, None)
        return tuple(seen)

    def blob_kinds(self, digest: str) -> frozenset[str]:
        """The upload kinds that name C{digest}."""
        return frozenset(
            instruction.kind
            for instruction in self.instructions
            if isinstance(instruction, Upload) and instruction.blob == digest
        )
