"""Tests for L{kcoral.wire.errors}: kinds, bodies, truncation, request ids."""

from __future__ import annotations

import json
import uuid

import pytest

from kcoral.wire.errors import (
    INSTRUCTION_KINDS,
    REQUEST_KIND_HEADERS,
    REQUEST_KINDS,
    choose_request_id,
    error_body,
    http_status,
    instruction_error,
    json_dumps,
    truncate_traceback,
)


def test_vocabularies() -> None:
    """The eight instruction kinds, the six request kinds of §9, and the HTTP layer's own."""
    assert len(INSTRUCTION_KINDS) == 8
    assert REQUEST_KINDS == {
        "parse": 400,
        "request_too_large": 413,
        "busy": 503,
        "timeout": 504,
        "engine": 500,
        "response_too_large": 500,
        "unauthorized": 401,
        "not_found": 404,
        "method_not_allowed": 405,
        "request_timeout": 408,
        "uri_too_long": 414,
        "header_too_large": 431,
    }
    assert REQUEST_KIND_HEADERS["busy"] == {"Retry-After": "1"}
    assert http_status("busy") == 503
    assert http_status("mystery") == 500


def test_error_body() -> None:
    """ERROR bodies have exactly status, request_id and error{kind, message}."""
    assert error_body("id", "busy", "server saturated") == {
        "status": "ERROR",
        "request_id": "id",
        "error": {"kind": "busy", "message": "server saturated"},
    }


def test_instruction_error_shape() -> None:
    """A FAILED error has the six fields, in the reference order."""
    error = instruction_error("runtime", "boom", 3, "run", "r", "tb")
    assert list(error) == [
        "kind",
        "message",
        "instruction_index",
        "instruction_op",
        "instruction_id",
        "traceback",
    ]
    assert error["instruction_id"] == "r"


def test_instruction_error_unknown_kind() -> None:
    """Kinds outside the eight (e.g. internal C{timeout}) become C{engine}."""
    assert instruction_error("timeout", "x", 0, "return", None)["kind"] == "engine"


def test_instruction_error_gpu_access() -> None:
    """C{gpu_access} errors carry exactly three extra fields."""
    error = instruction_error(
        "gpu_access", "m", 1, "run", "r", "", cuda_call="cuMemAlloc", location="f:1 in g"
    )
    assert len(error) == 9
    assert error["interfered_request_id"] is None
    assert error["cuda_call"] == "cuMemAlloc"


@pytest.mark.parametrize("text", ["a" * 10000, "é" * 9000, "x" + "😀" * 3000, "short"])
def test_traceback_tail(text: str) -> None:
    """The tail keeps at most 8192 characters and 8192 UTF-8 bytes."""
    tail = truncate_traceback(text)
    assert len(tail) <= 8192
    assert len(tail.encode()) <= 8192
    assert text.endswith(tail)
    assert len(tail.encode()) > 8192 - 4 or tail == text[-8192:]


def test_choose_request_id() -> None:
    """A single canonical UUID is echoed; anything else is replaced."""
    good = "6d1f0b9e-5a4c-4f1e-9b7a-2c3d4e5f6a7b"
    assert choose_request_id([good.encode()]) == good
    assert choose_request_id([b"00000000-0000-0000-0000-000000000000"]).startswith("00000000")
    for bad in (
        None,
        [],
        [good.encode(), good.encode()],
        [good.upper().encode()],
        [b"{" + good.encode() + b"}"],
        [b"urn:uuid:" + good.encode()],
        [good.replace("-", "").encode()],
        [b"\xff"],
    ):
        chosen = choose_request_id(bad)
        assert chosen != good
        assert str(uuid.UUID(chosen)) == chosen


def test_json_dumps() -> None:
    """Compact, raw UTF-8, and NaN refused."""
    assert json_dumps({"a": ["ü", 1]}) == '{"a":["ü",1]}'.encode()
    with pytest.raises(ValueError):
        json_dumps(float("nan"))
    assert json.loads(json_dumps({"k": 1.5})) == {"k": 1.5}
