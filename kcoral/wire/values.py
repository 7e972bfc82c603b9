# -*- test-case-name: tests.unit.test_wire_values -*-
"""
The returned-value tree of protocol §7: node constructors, the numbering of
binary parts, encoding of plain Python values, and client-side decoding.

The worker encodes with L{encode_plain} and a L{PartCollector}; device
backends plug their tensor types in through the C{tensor_parts} callback, so
nothing here depends on a GPU library.  L{decode_results} mirrors the 0.1.1
client's checks, for our own tests and client.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import attrs

from kcoral.wire.parts import SHARE_THRESHOLD, is_shared
from kcoral.wire.program import DTYPES, ValidationError, normalize_path, tensor_nbytes

if TYPE_CHECKING:
    from kcoral.ipc.shared import SharedBuffer

#: One encoded node: a JSON object with a C{type} member.
Node = dict[str, Any]

#: Given a value, return C{(dtype, shape, little-endian C-contiguous bytes)}
#: when it is a tensor, else C{None}.
TensorParts = Callable[
    [object], "tuple[str, Sequence[int], bytes | memoryview | SharedBuffer] | None"
]


class SerializationError(Exception):
    """
    A value cannot be returned (instruction error kind C{serialization}).

    @ivar message: the reference message.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def null() -> Node:
    return {"type": "null"}


def boolean(value: bool) -> Node:
    return {"type": "boolean", "value": bool(value)}


def integer(value: int) -> Node:
    return {"type": "integer", "value": int(value)}


def number(value: float) -> Node:
    """A finite float; non-finite numbers cannot cross the wire."""
    value = float(value)
    if not math.isfinite(value):
        raise SerializationError("cannot return a non-finite number")
    return {"type": "number", "value": value}


def string(value: str) -> Node:
    return {"type": "string", "value": str(value)}


def array(items: Sequence[Node]) -> Node:
    return {"type": "array", "value": list(items)}


def object_(members: Mapping[str, Node]) -> Node:
    return {"type": "object", "value": dict(members)}


def bytes_node(part: str, sha: str) -> Node:
    return {"type": "bytes", "part": part, "sha256": sha}


def tensor_node(part: str, sha: str, dtype: str, shape: Sequence[int]) -> Node:
    return {"type": "tensor", "part": part, "sha256": sha, "dtype": dtype, "shape": list(shape)}


def file_node(part: str, sha: str, size: int) -> Node:
    return {"type": "file", "part": part, "sha256": sha, "size": int(size)}


def folder_node(files: Mapping[str, Node], directories: Sequence[str]) -> Node:
    """A folder manifest; paths are sorted as the client requires (§7.3)."""
    return {
        "type": "folder",
        "files": {path: files[path] for path in sorted(files)},
        "directories": sorted(directories),
    }


class PartSharer(Protocol):
    """
    Makes sealed shared buffers of returned parts (a worker's
    L{kcoral.ipc.shared.PARTS}): the wire decides which parts are shared,
    the sharer owns the memfds, mappings and threads that takes.
    """

    def share(self, view: memoryview) -> tuple[SharedBuffer, str]:
        """C{view} copied once into a new sealed buffer, and its SHA-256."""

    def digest(self, buffer: SharedBuffer) -> str:
        """The SHA-256 of a sealed buffer's bytes."""


class PartCollector:
    """
    The binary parts of one response, numbered C{return:0..n-1} in the order
    they are added (§7.2).  A failing return rewinds to its L{mark}, so the
    numbering stays contiguous.
    """

    def __init__(self, share: PartSharer | None = None) -> None:
        self.parts: list[bytes | SharedBuffer] = []
        self.total_bytes = 0
        #: Makes sealed shared buffers of parts (L{PartSharer}): parts of
        #: L{SHARE_THRESHOLD} bytes or more are copied into one at once
        #: and cross to the parent as a descriptor; C{None} keeps every
        #: part as bytes.
        self._share = share

    def __len__(self) -> int:
        return len(self.parts)

    def add(self, data: bytes | bytearray | memoryview | SharedBuffer) -> tuple[str, str]:
        """
        Register a part (copied now: C{data} may be a view of the program's
        own array); return its name and SHA-256.  A shared buffer (a
        returned tensor copied from the device straight into one) is kept
        as it is when parts are shared, else copied out.
        """
        if is_shared(data):
            if self._share is not None:
                return self._append(data), self._share.digest(data)
            data = data.tobytes()
        view = memoryview(cast("bytes | bytearray | memoryview", data)).cast("B")
        payload: bytes | SharedBuffer
        if self._share is not None and view.nbytes >= SHARE_THRESHOLD:
            payload, digest = self._share.share(view)
        else:
            digest = hashlib.sha256(view).hexdigest()
            payload = view.tobytes()
        return self._append(payload), digest

    def _append(self, payload: bytes | SharedBuffer) -> str:
        name = f"return:{len(self.parts)}"
        self.parts.append(payload)
        self.total_bytes += len(payload)
        return name

    def mark(self) -> int:
        """A point to L{rewind} to."""
        return len(self.parts)

    def rewind(self, mark: int) -> None:
        """Drop every part added since C{mark}."""
        for payload in self.parts[mark:]:
            self.total_bytes -= len(payload)
        del self.parts[mark:]


def _encode_tensor(
    exported: tuple[str, Sequence[int], bytes | memoryview | SharedBuffer],
    collector: PartCollector,
) -> Node:
    dtype, shape, data = exported
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise SerializationError(f"cannot return tensor dtype {dtype}")
    if not isinstance(shape, list | tuple) or any(
        isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape
    ):
        raise SerializationError("returned tensor has an invalid shape")
    if not isinstance(data, bytes | bytearray | memoryview) and not is_shared(data):
        raise SerializationError("returned tensor data must be bytes")
    expected = tensor_nbytes(dtype, shape)
    if len(data) != expected:
        raise SerializationError(
            f"returned tensor metadata expects {expected} bytes, got {len(data)}"
        )
    part, sha = collector.add(data)
    return tensor_node(part, sha, dtype, shape)


def _encode(value: object, collector: PartCollector, tensor_parts: TensorParts | None) -> Node:
    if value is None:
        return null()
    if isinstance(value, bool):
        return boolean(value)
    if isinstance(value, int):
        return integer(value)
    if isinstance(value, float):
        return number(value)
    if isinstance(value, str):
        return string(value)
    if isinstance(value, bytes | bytearray | memoryview):
        part, sha = collector.add(value)
        return bytes_node(part, sha)
    if isinstance(value, list | tuple):
        return array([_encode(item, collector, tensor_parts) for item in value])
    if isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            raise SerializationError("returned objects must have string keys")
        return object_({k: _encode(v, collector, tensor_parts) for k, v in value.items()})
    if tensor_parts is not None:
        try:
            exported = tensor_parts(value)
        except SerializationError:
            raise
        except Exception as e:
            raise SerializationError(f"failed to export tensor: {type(e).__name__}: {e}") from e
        if exported is not None:
            return _encode_tensor(exported, collector)
    raise SerializationError(f"cannot return value of type {type(value).__name__}")


def encode_plain(
    value: object, collector: PartCollector, tensor_parts: TensorParts | None = None
) -> Node:
    """
    Encode a Python value as in protocol §7.1, registering binary parts in
    C{collector}.  On failure the parts added so far are rewound.

    @raise SerializationError: with the reference message.
    """
    mark = collector.mark()
    try:
        return _encode(value, collector, tensor_parts)
    except RecursionError:
        collector.rewind(mark)
        raise SerializationError("cannot return a value nested this deeply") from None
    except BaseException:
        collector.rewind(mark)
        raise


def numpy_tensor_parts(value: object) -> tuple[str, Sequence[int], bytes | memoryview] | None:
    """
    A C{tensor_parts} callback for NumPy arrays (an extension §7.1 allows):
    little-endian, C-contiguous bytes; unsupported dtypes are refused.
    """
    import numpy as np

    if not isinstance(value, np.ndarray):
        return None
    name = value.dtype.name
    if name not in DTYPES:
        raise SerializationError(f"cannot return tensor dtype {name}")
    # A view, not a copy: the part collector copies it once, into its part.
    array = np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("<"))
    return name, list(value.shape), array.reshape(-1).view(np.uint8).data


def numpy_dtype(name: str) -> Any:
    """The little-endian NumPy dtype of a wire dtype name (ml_dtypes for
    bfloat16 and float8)."""
    import numpy as np

    if name not in DTYPES:
        raise ValidationError(f"unsupported tensor dtype: {name!r}")
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name).newbyteorder("<")


@attrs.frozen
class DecodedFile:
    """A decoded C{file} value."""

    data: bytes


@attrs.frozen
class DecodedFolder:
    """A decoded C{folder} value: file contents by path, and directories."""

    files: dict[str, bytes]
    directories: tuple[str, ...]


_FIELDS: dict[str, frozenset[str]] = {
    "null": frozenset({"type"}),
    "boolean": frozenset({"type", "value"}),
    "integer": frozenset({"type", "value"}),
    "number": frozenset({"type", "value"}),
    "string": frozenset({"type", "value"}),
    "array": frozenset({"type", "value"}),
    "object": frozenset({"type", "value"}),
    "bytes": frozenset({"type", "part", "sha256"}),
    "tensor": frozenset({"type", "part", "sha256", "dtype", "shape"}),
    "file": frozenset({"type", "part", "sha256", "size"}),
    "folder": frozenset({"type", "files", "directories"}),
}


class _Decoder:
    def __init__(self, parts: Mapping[str, bytes]) -> None:
        self.parts = parts
        self.used: set[str] = set()

    def binary(self, node: Node) -> bytes:
        part = node["part"]
        if part != f"return:{len(self.used)}":
            raise ValidationError("binary values are not numbered in depth-first order")
        if part not in self.parts:
            raise ValidationError("missing binary response part")
        data = self.parts[part]
        if hashlib.sha256(data).hexdigest() != node["sha256"]:
            raise ValidationError(f"binary response part {part} has the wrong sha256")
        self.used.add(part)
        return data

    def decode(self, node: object) -> Any:
        if not isinstance(node, dict) or node.get("type") not in _FIELDS:
            raise ValidationError("malformed encoded value")
        kind: str = node["type"]
        if set(node) != _FIELDS[kind]:
            raise ValidationError(f"encoded {kind} value has the wrong fields")
        value = node.get("value")
        if kind == "null":
            return None
        if kind == "boolean" and isinstance(value, bool):
            return value
        if kind == "integer" and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind == "number" and isinstance(value, int | float) and not isinstance(value, bool):
            if math.isfinite(value):
                return float(value)
        if kind == "string" and isinstance(value, str):
            return value
        if kind == "array" and isinstance(value, list):
            return [self.decode(item) for item in value]
        if kind == "object" and isinstance(value, dict):
            return {key: self.decode(item) for key, item in value.items()}
        if kind == "bytes":
            return self.binary(node)
        if kind == "tensor":
            return self.tensor(node)
        if kind == "file":
            data = self.binary(node)
            size = node["size"]
            if isinstance(size, bool) or size != len(data):
                raise ValidationError("file size does not match its part")
            return DecodedFile(data)
        if kind == "folder":
            return self.folder(node)
        raise ValidationError(f"malformed {kind} value")

    def tensor(self, node: Node) -> Any:
        import numpy as np

        dtype, shape = node["dtype"], node["shape"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise ValidationError(f"unsupported tensor dtype: {dtype!r}")
        if not isinstance(shape, list) or any(
            isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape
        ):
            raise ValidationError("malformed tensor shape")
        data = self.binary(node)
        if len(data) != tensor_nbytes(dtype, shape):
            raise ValidationError("tensor part has the wrong length")
        return np.frombuffer(data, dtype=numpy_dtype(dtype)).reshape(shape).copy()

    def folder(self, node: Node) -> DecodedFolder:
        files, directories = node["files"], node["directories"]
        if not isinstance(files, dict) or not isinstance(directories, list):
            raise ValidationError("malformed folder value")
        for paths in (list(files), directories):
            if any(not isinstance(p, str) or normalize_path(p) != p for p in paths):
                raise ValidationError("folder paths must be canonical")
            if paths != sorted(paths) or len(set(paths)) != len(paths):
                raise ValidationError("folder paths must be sorted and unique")
        known = set(directories)
        for path in [*files, *directories]:
            parent = path.rpartition("/")[0]
            if parent and parent not in known:
                raise ValidationError("folder manifest lacks a parent directory")
        contents: dict[str, bytes] = {}
        for path, item in files.items():
            decoded = self.decode(item)
            if not isinstance(decoded, DecodedFile):
                raise ValidationError("folder entries must be files")
            contents[path] = decoded.data
        return DecodedFolder(contents, tuple(directories))


def decode_results(results: Mapping[str, object], parts: Mapping[str, bytes]) -> dict[str, Any]:
    """
    Decode a response's C{results} as the 0.1.1 client does (§7.4): parts
    numbered depth-first in key order, digests checked, none left over.
    """
    decoder = _Decoder(parts)
    decoded = {key: decoder.decode(node) for key, node in results.items()}
    if set(parts) - decoder.used:
        raise ValidationError("unreferenced binary response parts")
    return decoded


def decode_value(node: Node, parts: Mapping[str, bytes]) -> Any:
    """Decode one value whose binary parts are numbered from C{return:0}."""
    return decode_results({"value": node}, parts)["value"]
