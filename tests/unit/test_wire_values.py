"""Tests for L{kcoral.wire.values}: the value tree of protocol §7."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence

import ml_dtypes
import numpy as np
import pytest

from kcoral.ipc import shared
from kcoral.ipc.shared import PARALLEL_HASH_BYTES, SHARE_THRESHOLD
from kcoral.wire.errors import json_dumps
from kcoral.wire.multipart import decode_response, encode_response
from kcoral.wire.program import DTYPES, ValidationError
from kcoral.wire.values import (
    DecodedFile,
    DecodedFolder,
    PartCollector,
    SerializationError,
    decode_results,
    decode_value,
    encode_plain,
    file_node,
    folder_node,
    numpy_tensor_parts,
    tensor_node,
)


def round_trip(value: object) -> object:
    collector = PartCollector()
    node = encode_plain(value, collector, numpy_tensor_parts)
    # Through the real response framing, as the client would see it.
    content_type, chunks = encode_response({"results": {"v": node}}, collector.parts)
    body, parts = decode_response(content_type, b"".join(chunks))
    return decode_results(body["results"], parts)["v"]


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        False,
        0,
        -(2**100),
        2.5,
        -0.0,
        "",
        "ünïcode",
        b"",
        b"\x00\r\n",
        [],
        [1, [2, [3]]],
        {},
        {"a": {"b": [None, b"x", b"y"]}, "": "z"},
    ],
)
def test_plain_round_trip(value: object) -> None:
    """Every plain type decodes to what was encoded."""
    assert round_trip(value) == value


def test_plain_node_shapes() -> None:
    """Nodes match the table of §7.1; bool is tested before int; tuples are arrays."""
    collector = PartCollector()
    assert encode_plain(True, collector) == {"type": "boolean", "value": True}
    assert encode_plain(3, collector) == {"type": "integer", "value": 3}
    assert encode_plain((1,), collector) == {
        "type": "array",
        "value": [{"type": "integer", "value": 1}],
    }
    assert encode_plain(bytearray(b"ab"), collector) == {
        "type": "bytes",
        "part": "return:0",
        "sha256": hashlib.sha256(b"ab").hexdigest(),
    }
    assert encode_plain(memoryview(b"c"), collector)["part"] == "return:1"


def test_number_decodes_as_float() -> None:
    """A C{number} holding an integer decodes to a float (observed client)."""
    assert decode_value({"type": "number", "value": 3}, {}) == 3.0
    assert isinstance(decode_value({"type": "number", "value": 3}, {}), float)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (float("nan"), "cannot return a non-finite number"),
        ([float("inf")], "cannot return a non-finite number"),
        ({1: "a"}, "returned objects must have string keys"),
        (object(), "cannot return value of type object"),
        ({1, 2}, "cannot return value of type set"),
        (np.float32(1), "cannot return value of type float32"),
    ],
)
def test_plain_rejections(value: object, message: str) -> None:
    """Unencodable values raise the reference serialization messages."""
    with pytest.raises(SerializationError) as info:
        encode_plain(value, PartCollector())
    assert info.value.message == message


def test_deep_nesting_is_serialization_error() -> None:
    """A cyclic or absurdly deep value fails cleanly."""
    cyclic: list[object] = []
    cyclic.append(cyclic)
    with pytest.raises(SerializationError):
        encode_plain(cyclic, PartCollector())


def test_failed_encode_rewinds() -> None:
    """A value failing half-way drops the parts it registered (§7.2)."""
    collector = PartCollector()
    encode_plain(b"keep", collector)
    with pytest.raises(SerializationError):
        encode_plain([b"a", b"b", float("nan")], collector)
    assert len(collector) == 1 and collector.total_bytes == 4
    assert encode_plain(b"next", collector)["part"] == "return:1"


def test_collector_mark_rewind() -> None:
    """Parts are numbered in order; rewinding restores count and bytes."""
    collector = PartCollector()
    assert collector.add(b"abc") == ("return:0", hashlib.sha256(b"abc").hexdigest())
    mark = collector.mark()
    collector.add(b"de")
    collector.add(b"f")
    assert collector.total_bytes == 6
    collector.rewind(mark)
    assert collector.parts == [b"abc"] and collector.total_bytes == 3
    assert collector.add(b"")[0] == "return:1"


def test_depth_first_numbering() -> None:
    """Binary nodes are numbered depth-first in key order across returns."""
    collector = PartCollector()
    first = encode_plain({"b": b"0", "a": [b"1", {"x": b"2"}]}, collector)
    second = encode_plain(b"3", collector)
    parts = [json.loads(json_dumps(first))]
    assert parts[0]["value"]["b"]["part"] == "return:0"
    assert parts[0]["value"]["a"]["value"][1]["value"]["x"]["part"] == "return:2"
    assert second["part"] == "return:3"
    named = {f"return:{n}": p for n, p in enumerate(collector.parts)}
    assert decode_results({"r1": first, "r2": second}, named)["r2"] == b"3"
    with pytest.raises(ValidationError, match="depth-first"):
        decode_results({"r2": second, "r1": first}, named)


def make_array(dtype: str, shape: Sequence[int]) -> np.ndarray:
    rng = np.random.default_rng(0)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        return rng.standard_normal(shape).astype(getattr(ml_dtypes, dtype))
    if dtype.startswith("float"):
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3, 5)])
def test_tensor_round_trip(dtype: str, shape: tuple[int, ...]) -> None:
    """Tensors of all twelve dtypes round-trip byte-exact and writable."""
    array = make_array(dtype, shape)
    collector = PartCollector()
    node = encode_plain(array, collector, numpy_tensor_parts)
    assert node["dtype"] == dtype and node["shape"] == list(shape)
    assert collector.total_bytes == array.size * DTYPES[dtype]
    decoded = round_trip(array)
    assert isinstance(decoded, np.ndarray)
    assert decoded.dtype == array.dtype and decoded.shape == shape
    assert decoded.tobytes() == array.tobytes()
    assert decoded.flags.writeable


def test_tensor_big_endian_and_strided() -> None:
    """Non-native layouts are sent as little-endian C-contiguous bytes."""
    array = np.arange(12, dtype=">i4").reshape(3, 4).T
    decoded = round_trip(array)
    assert isinstance(decoded, np.ndarray)
    assert (decoded == array).all()


def test_tensor_callback_rules() -> None:
    """A C{tensor_parts} callback's output is checked like the reference."""
    collector = PartCollector()

    def bad_dtype(v: object) -> tuple[str, Sequence[int], bytes]:
        return ("uint16", [1], b"\0\0")

    def bad_len(v: object) -> tuple[str, Sequence[int], bytes]:
        return ("int32", [2], b"\0" * 4)

    def boom(v: object) -> None:
        raise RuntimeError("device lost")

    for callback, message in [
        (bad_dtype, "cannot return tensor dtype uint16"),
        (bad_len, "returned tensor metadata expects 8 bytes, got 4"),
        (boom, "failed to export tensor: RuntimeError: device lost"),
    ]:
        with pytest.raises(SerializationError) as info:
            encode_plain(object(), collector, callback)
        assert info.value.message == message
    with pytest.raises(SerializationError, match="complex64"):
        encode_plain(np.zeros(1, np.complex64), collector, numpy_tensor_parts)
    assert len(collector) == 0


def test_tensor_node_shape() -> None:
    """C{tensor_node} has exactly the five fields of §7.1."""
    assert set(tensor_node("return:0", "s", "int8", (2,))) == {
        "type",
        "part",
        "sha256",
        "dtype",
        "shape",
    }


def test_folder_nodes() -> None:
    """Folder manifests sort paths and decode to file contents (§7.3)."""
    collector = PartCollector()
    files = {}
    for path, data in [("e/.hidden", b"h"), ("x.txt", b"x")]:
        part, sha = collector.add(data)
        files[path] = file_node(part, sha, len(data))
    node = folder_node({"x.txt": files["x.txt"], "e/.hidden": files["e/.hidden"]}, ["empty", "e"])
    assert list(node["files"]) == ["e/.hidden", "x.txt"]
    assert node["directories"] == ["e", "empty"]
    named = {f"return:{n}": p for n, p in enumerate(collector.parts)}
    decoded = decode_value(node, named)
    assert decoded == DecodedFolder({"e/.hidden": b"h", "x.txt": b"x"}, ("e", "empty"))
    assert decode_value(folder_node({}, []), {}) == DecodedFolder({}, ())
    assert decode_value(
        file_node("return:0", hashlib.sha256(b"").hexdigest(), 0), {"return:0": b""}
    ) == DecodedFile(b"")


@pytest.mark.parametrize(
    ("node", "parts"),
    [
        ({"type": "null", "value": None}, {}),
        ({"type": "mystery"}, {}),
        ({"type": "integer", "value": True}, {}),
        ({"type": "bytes", "part": "return:0", "sha256": "0" * 64}, {"return:0": b""}),
        ({"type": "bytes", "part": "return:1", "sha256": "0" * 64}, {}),
        ({"type": "null"}, {"return:0": b""}),
        ({"type": "folder", "files": {}, "directories": ["a/b"]}, {}),
        ({"type": "folder", "files": {}, "directories": ["b", "a"]}, {}),
        ({"type": "folder", "files": {}, "directories": ["./a"]}, {}),
    ],
)
def test_decode_rejects(node: dict[str, object], parts: dict[str, bytes]) -> None:
    """Malformed nodes, bad digests and stray parts are refused like the client."""
    with pytest.raises(ValidationError):
        decode_value(node, parts)


@pytest.mark.skipif(not shared.available(), reason="no sealed memfds here")
@pytest.mark.parametrize("size", [100, SHARE_THRESHOLD, PARALLEL_HASH_BYTES + 3])
def test_parts_shared_and_hashed(size: int) -> None:
    """
    With a sharer (L{shared.PARTS}), parts of SHARE_THRESHOLD bytes or more become
    sealed buffers (hashed in a thread beside the copy past
    PARALLEL_HASH_BYTES); the digest is the bytes' either way, and the
    part is a copy: changing the source afterwards changes nothing.
    """
    source = bytearray(os.urandom(size))
    collector = PartCollector(shared.PARTS)
    name, digest = collector.add(memoryview(source))
    expected = bytes(source)
    source[:4] = b"EVIL"
    (part,) = collector.parts
    assert name == "return:0"
    assert digest == hashlib.sha256(expected).hexdigest()
    assert isinstance(part, shared.SharedBuffer) == (size >= SHARE_THRESHOLD)
    assert (part if isinstance(part, bytes) else part.tobytes()) == expected
    assert collector.total_bytes == size
