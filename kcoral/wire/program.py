# -*- test-case-name: tests.unit.test_wire_program -*-
"""
The program model: validated instructions as frozen attrs values.

A program arrives as strict JSON (protocol §4).  L{parse_program} turns its
bytes into a L{Program} or raises L{ValidationError} with the reference's
message; nothing here does I/O, so the server validates with it and the worker
re-reads the same bytes with it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, Union

import attrs

#: Error kind used for every validation failure (HTTP 400, protocol §9.2).
PARSE = "parse"

#: Ops that bind a handle.
HANDLE_OPS = frozenset({"upload", "get_function", "run"})

#: Upload kinds whose bytes travel as blobs.
BLOB_KINDS = frozenset({"tensor", "bytes", "library", "file"})

#: Upload kinds kept in the memory cache (files go to the disk cache).
MEMORY_KINDS = frozenset({"tensor", "bytes", "library"})

#: Tensor dtypes and their item sizes in bytes (protocol §4.11).
DTYPES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "float32": 4,
    "int64": 8,
    "float64": 8,
}

#: The one table of builtins: every server function a legacy string
#: C{run.fn} may name (protocol §10.2), plus C{builtin.kernel}, kcoral's
#: launch-handle maker for library kernels, each with whether workers register
#: it C{cpu_only} (it runs without the GPU lease).
BUILTINS: Mapping[str, bool] = MappingProxyType(
    {
        "builtin.randn": False,
        "builtin.empty": False,
        "builtin.zeros": False,
        "builtin.compile_tirx": False,
        "builtin.compile_cuda": True,
        "builtin.compile_cuda_binary": True,
        "builtin.compile_cutedsl": True,
        "builtin.compile_triton": True,
        "builtin.benchmark": False,
        "builtin.compare": False,
        "builtin.check_close": False,
        "builtin.assert_close": False,
        "builtin.kernel": False,
    }
)

#: Builtins only a GPU worker registers; elsewhere they are unknown functions.
GPU_ONLY_BUILTINS = frozenset({"builtin.kernel"})

#: The names a program may use as C{run.fn}.
BUILTIN_NAMES = frozenset(BUILTINS)

#: Module languages of the legacy dialect (protocol §13.2 item 3).
LANGUAGES = frozenset({"python", "cuda"})

_DIGEST = re.compile(r"[0-9a-f]{64}")


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
Argument = Union[Ref, None, bool, int, float, str, list[Any], dict[str, Any]]


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


def is_digest(value: object) -> bool:
    """Whether C{value} is a lowercase hex SHA-256 digest (a blob name)."""
    return isinstance(value, str) and _DIGEST.fullmatch(value) is not None


def tensor_nbytes(dtype: str, shape: Iterable[int]) -> int:
    """
    The byte length of a tensor: product of C{shape} (1 for C{[]}) times the
    item size (protocol §4.11).
    """
    try:
        itemsize = DTYPES[dtype]
    except KeyError:
        raise ValidationError(f"unsupported tensor dtype: {dtype!r}") from None
    return math.prod(shape) * itemsize


def strict_json_loads(data: bytes | str) -> Any:
    """
    Parse strict JSON (protocol §4.1): UTF-8 without BOM, no duplicate keys,
    no C{NaN}/C{Infinity} tokens, at any depth.
    """

    def pairs_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                raise ValidationError(f"duplicate JSON key: {key!r}")
            result[key] = value
        return result

    def reject_constant(token: str) -> Any:
        raise ValidationError(f"non-finite number {token} is not allowed")

    try:
        text = data.decode("utf-8") if isinstance(data, bytes | bytearray) else data
        return json.loads(text, object_pairs_hook=pairs_hook, parse_constant=reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValidationError(f"malformed JSON: {e}") from None
    except ValidationError:
        raise
    except ValueError as e:
        # An integer longer than Python's conversion limit (4,300 digits).
        raise ValidationError(f"malformed JSON: {e}") from None
    except RecursionError:
        # The reference answers 500 here; a 400 is the honest answer.
        raise ValidationError("malformed JSON: nesting too deep") from None


def normalize_path(path: object) -> str:
    """
    Validate and canonicalize a workspace-relative POSIX path (protocol
    §4.10).  Raw components are checked before normalization so that
    C{a/../b} is rejected rather than silently made to look safe.
    """
    if not isinstance(path, str) or not path:
        raise ValidationError("filesystem 'path' must be a non-empty string")
    if "\x00" in path:
        raise ValidationError("filesystem 'path' must not contain NUL")
    if "\\" in path:
        raise ValidationError("filesystem 'path' must use POSIX '/' separators")
    if path.startswith("/"):
        raise ValidationError("filesystem 'path' must be relative")
    raw = path.split("/")
    if ".." in raw:
        raise ValidationError("filesystem 'path' must not contain a '..' component")
    parts = [part for part in raw if part not in ("", ".")]
    if not parts:
        raise ValidationError("filesystem 'path' must name a file or folder")
    for part in parts:
        if len(part.encode("utf-8", "surrogatepass")) > 255:
            raise ValidationError("filesystem 'path' contains a component longer than 255 bytes")
    normalized = "/".join(parts)
    if len(normalized.encode("utf-8", "surrogatepass")) > 4096:
        raise ValidationError("filesystem 'path' is longer than 4096 bytes")
    return normalized


def check_path_conflicts(paths: Iterable[str]) -> None:
    """
    Reject duplicate file-upload paths and paths that are both a file and a
    directory (protocol §4.10 conflict rule).
    """
    # Sorting by components puts a file right before its descendants, even
    # with names such as "a-b" between "a" and "a/b".
    ordered = sorted(paths, key=lambda p: p.split("/"))
    for previous, current in zip(ordered, ordered[1:], strict=False):
        if current == previous:
            raise ValidationError(f"duplicate file upload path: {current!r}")
        if current.startswith(previous + "/"):
            raise ValidationError(f"conflicting file upload paths: {previous!r} and {current!r}")


def clamp_options(
    options: Options,
    *,
    default_timeout: float,
    max_timeout: float,
    default_output_limit: int,
    max_output_limit: int,
) -> tuple[float, int]:
    """
    The effective execution budget and output limit (protocol §4.3): the
    requested or default value, clamped to the server maximum.  Large values
    are clamped, never rejected.
    """
    timeout = options.timeout_seconds
    limit = options.output_limit_bytes
    return (
        float(min(default_timeout if timeout is None else timeout, max_timeout)),
        int(min(default_output_limit if limit is None else limit, max_output_limit)),
    )


def _is_ref(value: object) -> bool:
    return (
        isinstance(value, dict)
        and len(value) == 1
        and isinstance(value.get("$ref"), str)
        and bool(value["$ref"])
    )


def _check_fields(
    value: Mapping[str, Any], allowed: Iterable[str], required: Iterable[str], label: str
) -> None:
    unknown = set(value) - set(allowed)
    if unknown:
        raise ValidationError(f"{label} has unknown field(s): {', '.join(sorted(unknown))}")
    missing = set(required) - set(value)
    if missing:
        raise ValidationError(f"{label} is missing field(s): {', '.join(sorted(missing))}")


def _resolve(reference: dict[str, Any], handles: set[str], owner: str) -> Ref:
    target: str = reference["$ref"]
    if target not in handles:
        raise ValidationError(f"{owner!r} references unknown/forward handle {target!r}")
    return Ref(target)


def _check_literal(value: object, label: str) -> None:
    # Iterative, so a literal nested as deep as the JSON parser allows cannot
    # exhaust the stack here.
    stack = [value]
    while stack:
        item = stack.pop()
        if item is None or isinstance(item, bool | str | int):
            continue
        if isinstance(item, float):
            if not math.isfinite(item):
                raise ValidationError(f"{label} contains a non-finite number")
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            if not all(isinstance(key, str) for key in item):
                raise ValidationError(f"{label} contains a non-string object key")
            stack.extend(item.values())
        else:
            raise ValidationError(f"{label} contains a non-JSON value")


def _finite_float(number: int | float) -> bool:
    """Whether C{number} is a finite float, or an integer that fits one."""
    try:
        return math.isfinite(float(number))
    except OverflowError:  # an integer of hundreds of digits
        return False


def _parse_options(value: object) -> Options:
    if not isinstance(value, dict):
        raise ValidationError("'options' must be an object")
    _check_fields(value, ("gpu_count", "timeout_seconds", "output_limit_bytes"), (), "options")
    gpu_count = value.get("gpu_count")
    if "gpu_count" in value and (
        isinstance(gpu_count, bool) or not isinstance(gpu_count, int) or not 1 <= gpu_count <= 8
    ):
        raise ValidationError("'gpu_count' must be an integer between 1 and 8")
    timeout = value.get("timeout_seconds")
    if "timeout_seconds" in value:
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not _finite_float(timeout)
            or timeout <= 0
        ):
            raise ValidationError("'timeout_seconds' must be a finite positive number")
        timeout = float(timeout)
    limit = value.get("output_limit_bytes")
    if "output_limit_bytes" in value and (
        isinstance(limit, bool) or not isinstance(limit, int) or limit < 0
    ):
        raise ValidationError("'output_limit_bytes' must be a non-negative integer")
    return Options(gpu_count=gpu_count, timeout_seconds=timeout, output_limit_bytes=limit)


_UPLOAD_FIELDS: dict[str, tuple[str, ...]] = {
    "module": ("op", "id", "kind", "source"),
    "tensor": ("op", "id", "kind", "blob", "dtype", "shape"),
    "bytes": ("op", "id", "kind", "blob"),
    "library": ("op", "id", "kind", "blob"),
    "file": ("op", "id", "kind", "blob", "path"),
}


def _parse_upload(item: dict[str, Any], index: int) -> Upload:
    kind = item.get("kind")
    ident: str | None = item.get("id")
    if not isinstance(kind, str) or kind not in _UPLOAD_FIELDS:
        raise ValidationError(f"upload {ident!r}: unknown kind {kind!r}")
    fields = _UPLOAD_FIELDS[kind]
    required = fields if ident is not None else tuple(f for f in fields if f != "id")
    allowed = (*fields, "language") if kind == "module" else fields
    _check_fields(item, allowed, required, f"instruction {index}")
    if kind == "module":
        source = item["source"]
        if not isinstance(source, str):
            raise ValidationError(f"module upload {ident!r}: 'source' must be a string")
        language = item.get("language", "python")
        if not isinstance(language, str) or language not in LANGUAGES:
            raise ValidationError(f"module upload {ident!r}: unsupported language {language!r}")
        return Upload(index=index, id=ident, kind=kind, source=source, language=language)
    blob = item["blob"]
    if not is_digest(blob):
        label = "file upload" if kind == "file" else f"{kind} upload {ident!r}"
        raise ValidationError(f"{label}: 'blob' must be a lowercase SHA-256 digest")
    if kind == "tensor":
        dtype, shape = item["dtype"], item["shape"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise ValidationError(f"tensor upload {ident!r}: unsupported dtype {dtype!r}")
        if not isinstance(shape, list) or any(
            isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape
        ):
            raise ValidationError(
                f"tensor upload {ident!r}: 'shape' must be an array of non-negative integers"
            )
        return Upload(index=index, id=ident, kind=kind, blob=blob, dtype=dtype, shape=tuple(shape))
    if kind == "file":
        path = normalize_path(item["path"])
        return Upload(index=index, id=ident, kind=kind, blob=blob, path=path)
    return Upload(index=index, id=ident, kind=kind, blob=blob)


def _parse_get_function(item: dict[str, Any], index: int, handles: set[str]) -> GetFunction:
    _check_fields(
        item,
        ("op", "id", "module", "name", "cpu_only"),
        ("op", "id", "module", "name"),
        f"instruction {index}",
    )
    ident: str = item["id"]
    module = item["module"]
    if not _is_ref(module):
        raise ValidationError(f"get_function {ident!r}: 'module' must be {{'$ref': id}}")
    name = item["name"]
    if not isinstance(name, str) or not name:
        raise ValidationError(f"get_function {ident!r}: 'name' must be a non-empty string")
    cpu_only = item.get("cpu_only", False)
    if not isinstance(cpu_only, bool):
        raise ValidationError(f"get_function {ident!r}: 'cpu_only' must be a boolean")
    return GetFunction(
        index=index,
        id=ident,
        module=_resolve(module, handles, ident),
        name=name,
        cpu_only=cpu_only,
    )


def _parse_run(
    item: dict[str, Any], index: int, handles: set[str], builtin_names: frozenset[str]
) -> Run:
    _check_fields(item, ("op", "id", "fn", "args"), ("op", "id", "fn"), f"instruction {index}")
    ident: str = item["id"]
    raw_fn = item["fn"]
    fn: Ref | BuiltinName
    if isinstance(raw_fn, str) and raw_fn in builtin_names:
        fn = BuiltinName(raw_fn)
    elif _is_ref(raw_fn):
        fn = _resolve(raw_fn, handles, ident)
    else:
        raise ValidationError(f"run {ident!r}: 'fn' must be {{'$ref': id}}")
    raw_args = item.get("args", [])
    if not isinstance(raw_args, list):
        raise ValidationError(f"run {ident!r}: 'args' must be an array")
    args: list[Argument] = []
    for argument in raw_args:
        # Only top-level elements are references; nested ones stay data.
        if _is_ref(argument):
            args.append(_resolve(argument, handles, ident))
        else:
            _check_literal(argument, f"run {ident!r} argument")
            args.append(argument)
    return Run(index=index, id=ident, fn=fn, args=tuple(args))


def _parse_return(item: dict[str, Any], index: int, handles: set[str], keys: set[str]) -> Return:
    fields = ("op", "key", "kind", "path") if "kind" in item else ("op", "key", "value")
    _check_fields(item, fields, fields, f"instruction {index}")
    key = item["key"]
    if not isinstance(key, str) or not key:
        raise ValidationError(f"return instruction {index} needs a non-empty string 'key'")
    if key in keys:
        raise ValidationError(f"duplicate return key: {key!r}")
    owner = f"return {key!r}"
    if "kind" in item:
        kind = item["kind"]
        if kind not in ("file", "folder"):
            raise ValidationError(f"return {key!r}: unknown kind {kind!r}")
        raw_path = item["path"]
        path = _resolve(raw_path, handles, owner) if _is_ref(raw_path) else normalize_path(raw_path)
        return Return(index=index, key=key, kind=kind, path=path)
    value = item["value"]
    if not _is_ref(value):
        raise ValidationError(f"return {key!r}: 'value' must be {{'$ref': id}}")
    return Return(index=index, key=key, value=_resolve(value, handles, owner))


def parse_program_object(body: object, *, builtin_names: frozenset[str] = frozenset()) -> Program:
    """
    Validate an already decoded program (protocol §4.2-4.10), in the
    reference's order so that the first broken rule gives its message.
    """
    if not isinstance(body, dict):
        raise ValidationError("program must be a JSON object")
    _check_fields(body, ("instructions", "options"), ("instructions",), "program")
    raw = body["instructions"]
    if not isinstance(raw, list) or not raw:
        raise ValidationError("'instructions' must be a non-empty array")
    options = _parse_options(body.get("options", {}))

    handles: set[str] = set()
    keys: set[str] = set()
    paths: list[str] = []
    instructions: list[Instruction] = []
    for index, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ValidationError(f"instruction {index} must be an object")
        op = item.get("op")
        instruction: Instruction
        if op == "return":
            instruction = _parse_return(item, index, handles, keys)
            keys.add(instruction.key)
        elif isinstance(op, str) and op in HANDLE_OPS:
            ident = item.get("id")
            idless_file = op == "upload" and "id" not in item and item.get("kind") == "file"
            if not idless_file:
                if not isinstance(ident, str) or not ident:
                    raise ValidationError(f"instruction {index} needs a non-empty string 'id'")
                if ident in handles:
                    raise ValidationError(f"duplicate instruction id: {ident!r}")
            if op == "upload":
                instruction = _parse_upload(item, index)
                if instruction.path is not None:
                    paths.append(instruction.path)
            elif op == "get_function":
                instruction = _parse_get_function(item, index, handles)
            else:
                instruction = _parse_run(item, index, handles, builtin_names)
            if instruction.id is not None:
                handles.add(instruction.id)
        else:
            raise ValidationError(f"instruction {index}: unknown op {op!r}")
        instructions.append(instruction)
    check_path_conflicts(paths)
    return Program(instructions=tuple(instructions), options=options)


def parse_program(data: bytes, *, builtin_names: frozenset[str] = frozenset()) -> Program:
    """
    Parse and validate the bytes of a C{program} part (protocol §4).

    @param builtin_names: legacy string C{run.fn} names this server
        implements; any other string C{fn} is rejected as in 0.1.1.
    @raise ValidationError: with the reference message of the first broken
        rule.
    """
    return parse_program_object(strict_json_loads(data), builtin_names=builtin_names)


def _dump_ref(ref: Ref) -> dict[str, Any]:
    return {"$ref": ref.target}


def dump_program(program: Program) -> dict[str, Any]:
    """
    The JSON object of a validated program, in the 0.1.1 client's shape
    (paths normalized).  C{parse_program_object(dump_program(p)) == p}.
    """
    out: list[dict[str, Any]] = []
    for i in program.instructions:
        item: dict[str, Any]
        if isinstance(i, Upload):
            item = {"op": "upload", "kind": i.kind}
            if i.kind == "module":
                item["source"] = i.source
                if i.language != "python":
                    item["language"] = i.language
            else:
                item["blob"] = i.blob
            if i.kind == "tensor":
                item["dtype"] = i.dtype
                item["shape"] = list(i.shape or ())
            if i.kind == "file":
                item["path"] = i.path
            if i.id is not None:
                item["id"] = i.id
        elif isinstance(i, GetFunction):
            item = {"op": "get_function", "id": i.id, "module": _dump_ref(i.module), "name": i.name}
            if i.cpu_only:
                item["cpu_only"] = True
        elif isinstance(i, Run):
            fn: Any = i.fn.name if isinstance(i.fn, BuiltinName) else _dump_ref(i.fn)
            args = [_dump_ref(a) if isinstance(a, Ref) else a for a in i.args]
            item = {"op": "run", "id": i.id, "fn": fn, "args": args}
        else:
            item = {"op": "return", "key": i.key}
            if i.kind is None:
                assert i.value is not None
                item["value"] = _dump_ref(i.value)
            else:
                item["kind"] = i.kind
                item["path"] = _dump_ref(i.path) if isinstance(i.path, Ref) else i.path
        out.append(item)
    result: dict[str, Any] = {"instructions": out}
    options = {
        name: value
        for name, value in (
            ("gpu_count", program.options.gpu_count),
            ("timeout_seconds", program.options.timeout_seconds),
            ("output_limit_bytes", program.options.output_limit_bytes),
        )
        if value is not None
    }
    if options:
        result["options"] = options
    return result
