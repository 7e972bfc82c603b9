"""
Tests for L{kcoral.wire.multipart}: the request framing of protocol §3 and
the response framing of §8.2.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from kcoral.ipc import shared
from kcoral.ipc.uploads import MAX_SHARED_BLOBS, BlobStore, StreamedBody
from kcoral.testing.live_server import multipart_body
from kcoral.wire.multipart import (
    Blob,
    RequestBodyParser,
    RequestTooLarge,
    boundary_from_content_type,
    check_blob_references,
    check_tensor_lengths,
    decode_response,
    encode_response,
    parse_request_body,
)
from kcoral.wire.program import ValidationError, parse_program

B = "0123456789abcdef0123456789abcdef"
CT = f"multipart/form-data; boundary={B}"
EMPTY = hashlib.sha256(b"").hexdigest()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def program_for(*blobs: bytes) -> bytes:
    instructions = [
        {"op": "upload", "kind": "bytes", "blob": sha(b), "id": f"b{i}"}
        for i, b in enumerate(blobs)
    ] or [{"op": "upload", "kind": "module", "source": "", "id": "m"}]
    return json.dumps({"instructions": instructions}, separators=(",", ":")).encode()


def part(name: str, content_type: str, data: bytes, headers: bytes = b"") -> bytes:
    return (
        f"--{B}\r\n"
        f'Content-Disposition: form-data; name="{name}"\r\n'
        f"Content-Type: {content_type}\r\n".encode()
        + headers
        + b"\r\n"
        + data
        + b"\r\n"
    )


def body(*parts: bytes) -> bytes:
    return b"".join(parts) + f"--{B}--\r\n".encode()


def client_body(*blobs: bytes) -> bytes:
    """The byte-exact layout the 0.1.1 client sends (§3.1)."""
    return body(
        part("program", "application/json", program_for(*blobs)),
        *(part(f"blob:{sha(b)}", "application/octet-stream", b) for b in blobs),
    )


def parse(data: bytes, chunk: int | None = None, **kw: Any) -> dict[str, bytes]:
    parser = RequestBodyParser(B, max_bytes=kw.pop("max_bytes", 1 << 30), **kw)
    step = chunk or max(1, len(data))
    for i in range(0, len(data), step):
        parser.feed(data[i : i + step])
    result = parser.close()
    out = {"program": result.program, **{k: v.read() for k, v in result.blobs.items()}}
    for digest, blob in result.blobs.items():
        assert blob.digest == digest and blob.size == len(out[digest])
    result.close()
    return out


def reject(data: bytes) -> str:
    with pytest.raises(ValidationError) as info:
        parse(data)
    for chunk in (1, 3):
        with pytest.raises(ValidationError) as again:
            parse(data, chunk)
        assert again.value.message == info.value.message
    return info.value.message


@pytest.mark.parametrize("chunk", [None, 1, 2, 5, 33, 4096])
def test_client_layout_accepted(chunk: int | None) -> None:
    """The §3.1 body, with an empty blob and awkward payloads, parses byte-exact."""
    blobs = [b"", b"\r\n", b"x\r", b"\n--" + B.encode() + b"-", bytes(range(256)) * 3]
    parsed = parse(client_body(*blobs), chunk, new_blob=BlobStore(4))
    assert parsed["program"] == program_for(*blobs)
    for b in blobs:
        assert parsed[sha(b)] == b


def test_empty_blob_name() -> None:
    """A zero-length blob is legal and named by the empty-string digest."""
    assert parse(client_body(b""))[EMPTY] == b""


def test_bare_lf_framing() -> None:
    """Framing with bare LF line ends is accepted (observed reference)."""
    data = client_body(b"payload").replace(b"\r\n", b"\n")
    assert parse(data, 1)[sha(b"payload")] == b"payload"


def test_preamble_padding_epilogue() -> None:
    """A preamble, spaces/tabs after delimiters and an epilogue are accepted."""
    data = client_body(b"p")
    data = b"preamble\r\n" + data.replace(f"--{B}\r\n".encode(), f"--{B} \t\r\n".encode())
    data = data.replace(f"--{B}--\r\n".encode(), f"--{B}-- \r\nepilogue".encode())
    assert parse(data, 2)[sha(b"p")] == b"p"


def test_closing_delimiter_at_end() -> None:
    """The closing delimiter may end the body without a line break."""
    assert parse(client_body(b"z")[:-2])[sha(b"z")] == b"z"


def test_quoted_boundary_and_filename() -> None:
    """A quoted boundary and a C{filename} parameter are accepted."""
    assert boundary_from_content_type(f'multipart/form-data; boundary="{B}"') == B
    data = client_body().replace(b'name="program"', b'name="program"; filename="p.json"')
    assert parse(data)["program"] == program_for()


def test_charset_and_binary_encoding() -> None:
    """C{charset} on the program part and binary/8bit encodings are fine."""
    data = body(
        part("program", "application/json; charset=utf-8", program_for(b"a")),
        part(
            f"blob:{sha(b'a')}",
            "application/octet-stream",
            b"a",
            b"Content-Transfer-Encoding: 8bit\r\n",
        ),
    )
    assert parse(data)[sha(b"a")] == b"a"


def test_part_order_irrelevant() -> None:
    """Blob parts may precede the program part."""
    data = body(
        part(f"blob:{sha(b'a')}", "application/octet-stream", b"a"),
        part("program", "application/json", program_for(b"a")),
    )
    assert parse(data)["program"] == program_for(b"a")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (None, "expected a multipart/form-data request"),
        ("application/json", "expected a multipart/form-data request"),
        ("multipart/form-data", "malformed multipart/form-data boundary"),
        ("multipart/form-datax; boundary=a", "malformed multipart/form-data boundary"),
        ("multipart/form-data; boundary=", "malformed multipart/form-data boundary"),
        ("multipart/form-data; boundary=é", "malformed multipart/form-data boundary"),
    ],
)
def test_boundary_rejections(value: str | None, message: str) -> None:
    """The outer header rules of §3.3."""
    with pytest.raises(ValidationError) as info:
        boundary_from_content_type(value)
    assert info.value.message == message


def test_boundary_case_insensitive() -> None:
    """The media type is matched case-insensitively."""
    assert boundary_from_content_type(f"Multipart/Form-Data; boundary={B}") == B


P = part("program", "application/json", program_for())
BLOB = part(f"blob:{sha(b'a')}", "application/octet-stream", b"a")
CLOSE = f"--{B}--\r\n".encode()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (P, "malformed multipart/form-data body"),
        (b"no delimiter at all", "malformed multipart/form-data body"),
        (b"", "malformed multipart/form-data body"),
        (P + f"--{B}--x".encode(), "malformed multipart/form-data body"),
        (CLOSE, "multipart body has no parts"),
        (b"x\n" + CLOSE, "multipart body has no parts"),
        (f"--{B}\r\nContent-Type: a/b\r\n".encode() + CLOSE, "malformed multipart part headers"),
        (
            f"--{B}\r\nContent-Type: a/b\r\n\r\n--{B}--".encode(),
            "malformed multipart part headers",
        ),
        (
            f"--{B}\r\nContent-Type: application/json\r\n\r\n{{}}\r\n".encode() + CLOSE,
            "each multipart part must have one Content-Disposition",
        ),
        (
            f'--{B}\r\nContent-Disposition: form-data; name="program"\r\n\r\nx\r\n'.encode()
            + CLOSE,
            "each multipart part must have one Content-Type",
        ),
        (
            body(part("program", "application/json", b"{}", b"Content-Type: a/b\r\n")),
            "each multipart part must have one Content-Type",
        ),
        (
            body(part("program", "multipart/mixed", b"{}")),
            "nested multipart parts are not supported",
        ),
        (body(part("program", "garbage", b"{}")), "multipart part has a malformed Content-Type"),
        (
            body(P.replace(b"form-data;", b"attachment;")),
            "multipart parts must use form-data disposition",
        ),
        (body(P.replace(b'name="program"', b'name=""')), "multipart part is missing its name"),
        (
            body(
                part("program", "application/json", b"{}", b"Content-Transfer-Encoding: base64\r\n")
            ),
            "encoded multipart parts are not supported",
        ),
        (body(P, P), "duplicate multipart part: 'program'"),
        (
            body(part("program", "text/plain", b"{}")),
            "the 'program' part must use application/json",
        ),
        (body(BLOB), "missing multipart part: 'program'"),
        (body(P, part("other", "text/plain", b"")), "unsupported multipart part: 'other'"),
        (
            body(P, part(f"blob:{sha(b'a').upper()}", "application/octet-stream", b"a")),
            f"malformed blob part name: 'blob:{sha(b'a').upper()}'",
        ),
        (body(P, BLOB, BLOB), f"duplicate blob part: {sha(b'a')}"),
        (
            body(P, part(f"blob:{sha(b'a')}", "application/json", b"a")),
            f"blob part {sha(b'a')} must use application/octet-stream",
        ),
        (
            body(P, part(f"blob:{sha(b'a')}", "application/octet-stream", b"b")),
            f"blob hash mismatch: declared {sha(b'a')}, computed {sha(b'b')}",
        ),
        # Framing errors of later parts win over name errors of earlier ones.
        (
            body(part("other", "text/plain", b""), f"--{B}\r\nbroken\r\n".encode()),
            "malformed multipart part headers",
        ),
        (part("other", "text/plain", b""), "malformed multipart/form-data body"),
        # Among part rules, the first offending part decides.
        (
            body(part("x", "text/plain", b""), part("program", "text/plain", b"")),
            "unsupported multipart part: 'x'",
        ),
    ],
)
def test_rejections(data: bytes, message: str) -> None:
    """Every §3.3 rejection, with the reference message, at any chunking."""
    assert reject(data) == message


def test_max_bytes_during_feed() -> None:
    """The size limit trips in L{feed}, as soon as the total exceeds it."""
    parser = RequestBodyParser(B, max_bytes=100)
    parser.feed(b"x" * 100)
    with pytest.raises(RequestTooLarge):
        parser.feed(b"x")
    with pytest.raises(RequestTooLarge):
        parser.close()


def test_spooling_and_cleanup(tmp_path: Path) -> None:
    """Large blobs spool into C{spool_dir}; closing deletes the files."""
    payload = os.urandom(10_000)
    parser = RequestBodyParser(
        B, max_bytes=1 << 20, new_blob=BlobStore(1000, spool_dir=str(tmp_path))
    )
    data = client_body(payload, b"small")
    for i in range(0, len(data), 777):
        parser.feed(data[i : i + 777])
    result = parser.close()
    big, small = result.blobs[sha(payload)], result.blobs[sha(b"small")]
    assert big.path is not None and big.path.startswith(str(tmp_path))
    assert small.path is None
    assert big.read() == payload and big.size == len(payload)
    with big.open() as f:
        assert f.read() == payload
    result.close()
    assert list(tmp_path.iterdir()) == []


def test_error_deletes_spool(tmp_path: Path) -> None:
    """A failing body leaves no spool file behind."""
    payload = os.urandom(5000)
    data = body(P, part(f"blob:{sha(b'x')}", "application/octet-stream", payload))
    parser = RequestBodyParser(B, max_bytes=1 << 20, new_blob=BlobStore(10, str(tmp_path)))
    parser.feed(data[:3000])
    parser.abort()
    assert list(tmp_path.iterdir()) == []
    parser = RequestBodyParser(B, max_bytes=1 << 20, new_blob=BlobStore(10, str(tmp_path)))
    parser.feed(data)
    with pytest.raises(ValidationError):
        parser.close()
    assert list(tmp_path.iterdir()) == []


def test_parse_request_body() -> None:
    """The one-shot helper combines header and body parsing."""
    parsed = parse_request_body(CT, client_body(b"q"))
    assert parsed.blobs[sha(b"q")].read() == b"q"


def test_blob_references() -> None:
    """Supplied blobs must be referenced; one blob may serve several uploads."""
    program = parse_program(program_for(b"a", b"a"))
    check_blob_references(program, {sha(b"a"): Blob.from_bytes(b"a")})
    with pytest.raises(ValidationError) as info:
        check_blob_references(program, [sha(b"c"), sha(b"a"), sha(b"b")])
    assert info.value.message == (
        f"unreferenced blob part(s): {', '.join(sorted([sha(b'b'), sha(b'c')]))}"
    )


def test_tensor_lengths() -> None:
    """Tensor blobs must have product(shape) * itemsize bytes once known."""
    digest = "ab" * 32
    program = parse_program(
        json.dumps(
            {
                "instructions": [
                    {
                        "op": "upload",
                        "kind": "tensor",
                        "id": "t",
                        "blob": digest,
                        "dtype": "float16",
                        "shape": [2, 3],
                    }
                ]
            }
        ).encode()
    )
    check_tensor_lengths(program, {digest: 12})
    check_tensor_lengths(program, {})
    with pytest.raises(ValidationError) as info:
        check_tensor_lengths(program, {digest: 11})
    assert info.value.message == "tensor upload 't' expects 12 bytes, got 11"


def test_response_json() -> None:
    """Without binary parts the response is compact JSON."""
    content_type, chunks = encode_response({"status": "COMPLETED", "stdout": "ü"}, [])
    assert content_type == "application/json"
    assert b"".join(chunks) == '{"status":"COMPLETED","stdout":"ü"}'.encode()
    assert decode_response("application/json; charset=utf-8", b"".join(chunks))[0]["stdout"] == "ü"


def test_response_multipart_round_trip() -> None:
    """With binary parts: C{result} then C{return:<n>}, byte-exact."""
    parts = [b"", b"\r\n", os.urandom(1000), b"--\r\n"]
    result = {"status": "COMPLETED", "results": {}}
    content_type, chunks = encode_response(result, parts)
    assert re.fullmatch(r"multipart/form-data; boundary=kcoral-[0-9a-f]{32}", content_type)
    data = b"".join(chunks)
    assert data.endswith(b"--\r\n")
    assert data.index(b'name="result"') < data.index(b'name="return:0"')
    decoded, binary = decode_response(content_type, data)
    assert decoded == result
    assert binary == {f"return:{n}": p for n, p in enumerate(parts)}


def test_response_boundary_never_in_payload(monkeypatch: pytest.MonkeyPatch) -> None:
    """The boundary is redrawn while CRLF--boundary occurs in any part."""
    import secrets

    draws = iter(["0" * 32, "0" * 32, "1" * 32])
    monkeypatch.setattr(secrets, "token_hex", lambda n: next(draws))
    evil = b"x\r\n--kcoral-" + b"0" * 32 + b"--\r\n"
    content_type, chunks = encode_response({"s": 1}, [evil])
    assert content_type.endswith("kcoral-" + "1" * 32)
    assert decode_response(content_type, b"".join(chunks))[1]["return:0"] == evil


@pytest.mark.parametrize(
    ("content_type", "data"),
    [
        ("text/plain", b"{}"),
        (None, b"{}"),
        ("application/json", b"[]"),
        ("application/json", b'{"a":NaN}'),
        (CT, body(part("return:0", "application/octet-stream", b""))),
        (CT, body(part("result", "application/json", b"{}"), part("x", "text/plain", b""))),
    ],
)
def test_decode_response_rejects(content_type: str | None, data: bytes) -> None:
    """Responses the 0.1.1 client would refuse raise L{ValidationError}."""
    with pytest.raises(ValidationError):
        decode_response(content_type, data)


class TestRememberedVerdicts:
    """The fast paths give the email parser's verdicts, every time."""

    def test_simple_boundary_as_the_email_parser(self) -> None:
        from kcoral.wire import multipart

        for value in (
            "multipart/form-data; boundary=0123456789abcdef0123456789abcdef",
            "multipart/form-data; boundary=kcoral-" + "a" * 32,
            "multipart/form-data; boundary=A_b-C",
        ):
            fast = multipart.boundary_from_content_type(value)
            # The same value with a trailing space leaves the fast path.
            slow = multipart.boundary_from_content_type(value + " ")
            assert fast == slow

    def test_part_verdicts_repeat(self) -> None:
        from kcoral.wire import multipart
        from kcoral.wire.program import ValidationError

        good = b'Content-Disposition: form-data; name="program"\r\nContent-Type: application/json\r\n\r\n'
        bad = b'Content-Disposition: form-data; name="program"\r\n\r\n'
        for _ in range(3):
            assert multipart._parse_part_headers(good) == ("program", "application/json")
            with pytest.raises(ValidationError, match="one Content-Type"):
                multipart._parse_part_headers(bad)
        long = (
            b'Content-Disposition: form-data; name="'
            + b"x" * 2000
            + b'"\r\nContent-Type: application/octet-stream\r\n\r\n'
        )
        assert multipart._parse_part_headers(long) == ("x" * 2000, "application/octet-stream")


@pytest.mark.skipif(not shared.available(), reason="no sealed memfds here")
def test_streamed_body_shares_the_first_blobs_only() -> None:
    """A body of many large blobs gets memfds for MAX_SHARED_BLOBS of them."""
    blobs = [bytes([i % 256]) * 70_000 + i.to_bytes(4, "big") for i in range(MAX_SHARED_BLOBS + 3)]
    content_type, body = multipart_body({"instructions": []}, blobs)
    streamed = StreamedBody.for_content_type(content_type, max_bytes=1 << 30)
    assert streamed is not None
    for offset in range(0, len(body), 1 << 16):
        streamed.feed(body[offset : offset + (1 << 16)])
    parsed = streamed.result()
    kinds = [blob.shared is not None for blob in parsed.blobs.values()]
    assert kinds.count(True) == MAX_SHARED_BLOBS
    assert [blob.read() for blob in parsed.blobs.values()] == blobs


@pytest.mark.skipif(not shared.available(), reason="no sealed memfds here")
def test_streamed_body_without_memfds(monkeypatch: pytest.MonkeyPatch) -> None:
    """No memfd to be had: the error is kept for the API (which answers 503)."""
    content_type, body = multipart_body({"instructions": []}, [b"x" * 100_000])

    def no_memfd(*args: object) -> int:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(os, "memfd_create", no_memfd)
    streamed = StreamedBody.for_content_type(content_type, max_bytes=1 << 30)
    assert streamed is not None
    streamed.feed(body)
    with pytest.raises(OSError, match="Too many open files"):
        streamed.result()
