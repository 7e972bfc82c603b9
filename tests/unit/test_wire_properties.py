"""
Property tests for L{kcoral.wire}: valid programs round-trip, and no input
makes the parsers raise anything but their documented errors.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kcoral.ipc.uploads import BlobStore
from kcoral.wire import multipart
from kcoral.wire.multipart import (
    RequestBodyParser,
    RequestTooLarge,
    check_blob_references,
    check_tensor_lengths,
)
from kcoral.wire.program import DTYPES, ValidationError, dump_program, parse_program

B = "0123456789abcdef0123456789abcdef"
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_literals = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=8,
)
digests = st.binary(max_size=4).map(lambda b: hashlib.sha256(b).hexdigest())


@st.composite
def programs(draw: st.DrawFn) -> dict[str, Any]:
    """A random valid program in the 0.1.1 client's shape (plus dialects)."""
    ids: list[str] = []
    keys: set[str] = set()
    out: list[dict[str, Any]] = []
    for index in range(draw(st.integers(1, 8))):
        ident = f"i{index}"
        choice = draw(st.sampled_from(["module", "blob", "file", "gf", "run", "return"]))
        if choice in ("gf", "run", "return") and not ids:
            choice = "module"
        if choice == "module":
            item: dict[str, Any] = {"op": "upload", "kind": "module", "source": draw(st.text())}
            if draw(st.booleans()):
                # "python" is the default, so only "cuda" survives a round trip.
                item["language"] = "cuda"
        elif choice == "blob":
            kind = draw(st.sampled_from(["tensor", "bytes", "library"]))
            item = {"op": "upload", "kind": kind, "blob": draw(digests)}
            if kind == "tensor":
                item["dtype"] = draw(st.sampled_from(sorted(DTYPES)))
                item["shape"] = draw(st.lists(st.integers(0, 5), max_size=3))
        elif choice == "file":
            item = {"op": "upload", "kind": "file", "blob": draw(digests), "path": f"d{index}/f"}
            if draw(st.booleans()):
                out.append(item)
                continue
        elif choice == "gf":
            item = {"op": "get_function", "module": {"$ref": draw(st.sampled_from(ids))}}
            item["name"] = draw(st.text(min_size=1, max_size=5))
            if draw(st.booleans()):
                item["cpu_only"] = True
        elif choice == "run":
            refs = st.sampled_from(ids).map(lambda t: {"$ref": t})
            item = {
                "op": "run",
                "fn": draw(refs),
                "args": draw(
                    st.lists(refs | json_literals.filter(lambda v: not _is_ref(v)), max_size=4)
                ),
            }
        else:
            key = draw(st.text(min_size=1, max_size=4).filter(lambda k: k not in keys))
            keys.add(key)
            if draw(st.booleans()):
                out.append(
                    {"op": "return", "key": key, "value": {"$ref": draw(st.sampled_from(ids))}}
                )
            else:
                path: Any = draw(st.sampled_from([*(f"{{{i}}}" for i in ids), "out", "a/b"]))
                if path.startswith("{"):
                    path = {"$ref": path[1:-1]}
                kind = draw(st.sampled_from(["file", "folder"]))
                out.append({"op": "return", "key": key, "kind": kind, "path": path})
            continue
        item["id"] = ident
        ids.append(ident)
        out.append(item)
    program: dict[str, Any] = {"instructions": out}
    options = draw(
        st.fixed_dictionaries(
            {},
            optional={
                "gpu_count": st.integers(1, 8),
                "timeout_seconds": st.floats(0.001, 1e12),
                "output_limit_bytes": st.integers(0, 1 << 40),
            },
        )
    )
    if options:
        program["options"] = options
    return program


def _is_ref(value: object) -> bool:
    return (
        isinstance(value, dict)
        and len(value) == 1
        and isinstance(value.get("$ref"), str)
        and bool(value["$ref"])
    )


@SETTINGS
@given(programs())
def test_valid_programs_round_trip(program: dict[str, Any]) -> None:
    """Every generated valid program parses, and dumps back to itself."""
    data = json.dumps(program, ensure_ascii=False, separators=(",", ":")).encode()
    parsed = parse_program(data)
    assert dump_program(parsed) == program
    assert parse_program(json.dumps(dump_program(parsed)).encode()) == parsed


@SETTINGS
@given(st.binary(max_size=300))
def test_program_random_bytes(data: bytes) -> None:
    """Arbitrary bytes only ever raise L{ValidationError}."""
    try:
        parse_program(data)
    except ValidationError:
        pass


def _body(program: bytes, blobs: list[bytes]) -> bytes:
    out = [
        f'--{B}\r\nContent-Disposition: form-data; name="program"\r\n'
        f"Content-Type: application/json\r\n\r\n".encode()
        + program
        + b"\r\n"
    ]
    for blob in blobs:
        out.append(
            f'--{B}\r\nContent-Disposition: form-data; name="blob:{hashlib.sha256(blob).hexdigest()}"\r\n'
            f"Content-Type: application/octet-stream\r\n\r\n".encode()
            + blob
            + b"\r\n"
        )
    out.append(f"--{B}--\r\n".encode())
    return b"".join(out)


def _full_parse(body: bytes, chunk: int, max_bytes: int = 1 << 20) -> None:
    parser = RequestBodyParser(B, max_bytes=max_bytes, new_blob=BlobStore(16))
    try:
        for i in range(0, len(body), chunk):
            parser.feed(body[i : i + chunk])
        parsed = parser.close()
        try:
            program = parse_program(parsed.program)
            check_blob_references(program, parsed.blobs)
            check_tensor_lengths(program, {k: v.size for k, v in parsed.blobs.items()})
        finally:
            parsed.close()
    except (ValidationError, RequestTooLarge):
        pass


@SETTINGS
@given(st.binary(max_size=400), st.integers(1, 64))
def test_request_random_bytes(body: bytes, chunk: int) -> None:
    """Arbitrary request bodies only raise the documented errors."""
    _full_parse(body, chunk)


TOKENS = [b"\r", b"\n", b"--", B.encode(), b" ", b"-", b"\r\n--" + B.encode(), b'"', b";", b":"]


@SETTINGS
@given(
    st.lists(st.binary(max_size=20), max_size=3),
    st.lists(
        st.tuples(
            st.integers(0, 10_000),
            st.integers(0, 3),
            st.sampled_from(TOKENS),
            st.binary(max_size=3),
        ),
        min_size=1,
        max_size=4,
    ),
    st.integers(1, 50),
    st.integers(50, 2000),
)
def test_request_mutations(
    blobs: list[bytes], edits: list[tuple[int, int, bytes, bytes]], chunk: int, limit: int
) -> None:
    """Mutated valid bodies (and tight limits) only raise the documented errors."""
    program = json.dumps(
        {
            "instructions": [
                {
                    "op": "upload",
                    "kind": "bytes",
                    "id": f"b{i}",
                    "blob": hashlib.sha256(b).hexdigest(),
                }
                for i, b in enumerate(blobs)
            ]
            or [{"op": "upload", "kind": "module", "id": "m", "source": ""}]
        }
    ).encode()
    body = bytearray(_body(program, blobs))
    for position, op, token, junk in edits:
        at = position % (len(body) + 1)
        if op == 0:
            body[at:at] = token
        elif op == 1:
            del body[at : at + len(junk) + 1]
        elif op == 2:
            body[at:at] = junk
        else:
            body = body[:at]
    _full_parse(bytes(body), chunk, max_bytes=limit if limit < 1000 else 1 << 20)


def _pattern(i: int, size: int) -> bytes:
    block = hashlib.sha256(i.to_bytes(8, "little")).digest() * (size // 32)
    return block[:size]


@pytest.mark.slow
def test_streaming_memory(tmp_path: Any) -> None:
    """A 256 MiB body fed in 64 KiB chunks never costs memory near its size."""
    chunk, total = 64 * 1024, 256 * 1024 * 1024
    head_room = 4096
    blob_size = total - head_room
    digest = hashlib.sha256()
    for i in range(0, blob_size, chunk):
        digest.update(_pattern(i, min(chunk, blob_size - i)))
    h = digest.hexdigest()
    program = json.dumps(
        {"instructions": [{"op": "upload", "kind": "bytes", "id": "b", "blob": h}]}
    ).encode()
    head = (
        f'--{B}\r\nContent-Disposition: form-data; name="program"\r\n'
        f"Content-Type: application/json\r\n\r\n".encode()
        + program
        + f'\r\n--{B}\r\nContent-Disposition: form-data; name="blob:{h}"\r\n'
        f"Content-Type: application/octet-stream\r\n\r\n".encode()
    )
    tail = f"\r\n--{B}--\r\n".encode()
    process = psutil.Process()
    parser = RequestBodyParser(
        B,
        max_bytes=len(head) + blob_size + len(tail),
        new_blob=BlobStore(spool_dir=str(tmp_path)),
    )
    baseline = peak = process.memory_info().rss
    parser.feed(head)
    for i in range(0, blob_size, chunk):
        parser.feed(_pattern(i, min(chunk, blob_size - i)))
        if i % (16 * chunk) == 0:
            peak = max(peak, process.memory_info().rss)
    parser.feed(tail)
    parsed = parser.close()
    peak = max(peak, process.memory_info().rss)
    blob = parsed.blobs[h]
    assert blob.size == blob_size and blob.path is not None
    parsed.close()
    assert peak - baseline < 32 * 1024 * 1024


def _outcome(body: bytes, chunks: list[int]) -> Any:
    """What parsing C{body} fed in pieces of the given sizes gives: parts or the error."""
    parser = RequestBodyParser(B, max_bytes=1 << 20, new_blob=BlobStore(16))
    position, sizes = 0, iter(chunks)
    try:
        while position < len(body):
            step = next(sizes, len(body))
            parser.feed(body[position : position + step])
            position += step
        parsed = parser.close()
    except (ValidationError, RequestTooLarge) as e:
        return type(e).__name__, str(e)
    try:
        return parsed.program, {d: b.read() for d, b in parsed.blobs.items()}
    finally:
        parsed.close()


@SETTINGS
@given(
    st.lists(st.binary(max_size=60), max_size=3),
    st.lists(st.tuples(st.integers(0, 10_000), st.sampled_from(TOKENS)), max_size=3),
    st.lists(st.integers(1, 80), min_size=1, max_size=40),
)
def test_direct_feed_matches_the_buffered_scan(
    blobs: list[bytes], edits: list[tuple[int, bytes]], chunks: list[int]
) -> None:
    """
    Chunks handed over as views of themselves (the scanner's direct path,
    here taken for every chunk it applies to) give the same parts, or the
    same error, as the whole body fed at once through the buffer.
    """
    body = bytearray(_body(b'{"instructions":[]}', blobs))
    for position, token in edits:
        at = position % (len(body) + 1)
        body[at:at] = token
    whole = _outcome(bytes(body), [len(body)])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(multipart, "DIRECT_FEED_BYTES", 1)
        direct = _outcome(bytes(body), chunks)
    assert direct == whole
