# -*- test-case-name: tests.unit.test_wire_errors -*-
"""
The two error vocabularies of protocol §9 and the bodies that carry them.

Instruction kinds go inside a 200 C{FAILED} body; request kinds go inside a
non-200 C{ERROR} body.  Keeping both here lets the server and the worker agree
on the exact shapes the 0.1.1 client checks.
"""

from __future__ import annotations

import uuid
from typing import Any

from kcoral.wire.jsontext import json_dumps

__all__ = ["json_dumps"]  # kept importable from here for the server

#: Kinds allowed in a FAILED body's C{error.kind} (protocol §9.1).
INSTRUCTION_KINDS = frozenset(
    {
        "parse",
        "compile",
        "runtime",
        "gpu_access",
        "correctness",
        "serialization",
        "unavailable",
        "engine",
    }
)

#: Request error kinds and their HTTP statuses (protocol §9.2).
REQUEST_KINDS: dict[str, int] = {
    "parse": 400,
    "request_too_large": 413,
    "busy": 503,
    "timeout": 504,
    "engine": 500,
    "response_too_large": 500,
    # The HTTP layer's own refusals (issue 18): the same three-key body, so a
    # client that reads ERROR bodies reads these too.
    "unauthorized": 401,
    "not_found": 404,
    "method_not_allowed": 405,
    "request_timeout": 408,
    "uri_too_long": 414,
    "header_too_large": 431,
}

#: The kind and message of an error status the HTTP layer answers itself
#: (a framework 404, a malformed request line, a slow client).
HTTP_STATUS_ERRORS: dict[int, tuple[str, str]] = {
    400: ("parse", "malformed HTTP request"),
    401: ("unauthorized", "a valid bearer token is required"),
    404: ("not_found", "no such resource"),
    405: ("method_not_allowed", "method not allowed for this resource"),
    408: ("request_timeout", "the request was not received in time"),
    413: ("request_too_large", "request exceeds the configured size limit"),
    414: ("uri_too_long", "request line too long"),
    431: ("header_too_large", "request header fields too large"),
    500: ("engine", "internal server error"),
    503: ("busy", "server saturated"),
}


def status_error(status: int) -> tuple[str, str]:
    """The kind and message of an ERROR body for HTTP C{status}."""
    if status in HTTP_STATUS_ERRORS:
        return HTTP_STATUS_ERRORS[status]
    return ("parse", f"HTTP {status}") if status < 500 else ("engine", f"HTTP {status}")


#: Extra headers a request error carries (C{Retry-After} only with C{busy}).
REQUEST_KIND_HEADERS: dict[str, dict[str, str]] = {
    "busy": {"Retry-After": "1"},
    "unauthorized": {"WWW-Authenticate": 'Bearer realm="kcoral"'},
}

#: Reference messages of the fixed request errors.
REQUEST_TOO_LARGE_MESSAGE = "request exceeds the configured size limit"
BUSY_MESSAGE = "server saturated"
TIMEOUT_MESSAGE = "execution timed out"
RESPONSE_TOO_LARGE_MESSAGE = "results exceed the configured response-size limit"

#: Instruction ops that may appear as C{instruction_op}.
OPS = frozenset({"upload", "get_function", "run", "return"})

#: Traceback tail budget, in characters and in UTF-8 bytes (protocol §9.3).
TRACEBACK_LIMIT = 8192


def http_status(kind: str) -> int:
    """The HTTP status of a request error kind; unknown kinds are 500."""
    return REQUEST_KINDS.get(kind, 500)


def error_body(request_id: str, kind: str, message: str) -> dict[str, Any]:
    """The JSON body of a non-200 response: exactly three keys (§9.2)."""
    return {
        "status": "ERROR",
        "request_id": request_id,
        "error": {"kind": kind, "message": message},
    }


def truncate_traceback(text: str, limit: int = TRACEBACK_LIMIT) -> str:
    """
    Keep the tail of C{text}: at most C{limit} characters and at most
    C{limit} UTF-8 bytes, so both readings of the older docs hold.
    """
    tail = text[-limit:] if limit else ""
    encoded = tail.encode("utf-8", "surrogatepass")
    if len(encoded) <= limit:
        return tail
    cut = encoded[len(encoded) - limit :]
    # Drop continuation bytes of a character split by the cut.
    return cut.decode("utf-8", "ignore")


def instruction_error(
    kind: str,
    message: str,
    index: int,
    op: str,
    id: str | None,
    traceback: str = "",
    **gpu_access: str | None,
) -> dict[str, Any]:
    """
    The C{error} object of a FAILED body (protocol §9.1).

    Unknown kinds are coerced to C{engine}, since the client rejects any
    other.  C{gpu_access} errors take exactly C{cuda_call}, C{location} and
    C{interfered_request_id} as keywords; other kinds take none.
    """
    if kind not in INSTRUCTION_KINDS:
        kind = "engine"
    error: dict[str, Any] = {
        "kind": kind,
        "message": str(message),
        "instruction_index": int(index),
        "instruction_op": op,
        "instruction_id": id,
        "traceback": truncate_traceback(traceback),
    }
    if kind == "gpu_access":
        error["cuda_call"] = str(gpu_access.get("cuda_call") or "")
        error["location"] = str(gpu_access.get("location") or "")
        interfered = gpu_access.get("interfered_request_id")
        error["interfered_request_id"] = None if interfered is None else str(interfered)
    return error


def _canonical_uuid(value: str) -> bool:
    try:
        return str(uuid.UUID(value)) == value
    except ValueError:
        return False


def choose_request_id(header_values: list[bytes] | None) -> str:
    """
    The request id of protocol §2.1: the client's value when exactly one
    canonical lowercase UUID was sent, else a fresh UUID4 (never an error).
    """
    if header_values and len(header_values) == 1:
        try:
            value = header_values[0].decode("ascii")
        except UnicodeDecodeError:
            value = ""
        if _canonical_uuid(value):
            return value
    return str(uuid.uuid4())
