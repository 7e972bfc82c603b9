# -*- test-case-name: tests.unit.test_http -*-
"""
Refusals and error bodies of the HTTP room.

Every refusal, wherever it is made (by the channel, the request, the site,
the token guard, or by the API when a body is too large or no worker can be
had), is logged once as a C{request_refused} event by L{log_refusal}, with
one of the L{REFUSALS} reasons: C{/metrics} counts them by status and reason
and C{/status} shows the last ones.  L{raw_error_response} is the whole
response written before a request object can answer (a broken head, a slow
client, a full server); L{error_json} the protocol's ERROR body.
"""

from __future__ import annotations

from twisted.logger import Logger, LogLevel

from kcoral.wire.errors import REQUEST_KIND_HEADERS, choose_request_id, error_body, status_error
from kcoral.wire.jsontext import json_dumps

#: Why a request was refused (the C{reason} of C{request_refused}), with the
#: HTTP status it was answered with.
REFUSALS: dict[str, int] = {
    "malformed": 400,
    "unauthorized": 401,
    "head_timeout": 408,
    "body_timeout": 408,
    "body_stalled": 408,
    "body_too_large": 413,
    "uri_too_long": 414,
    "header_too_large": 431,
    "too_many_headers": 431,
    "connection_cap": 503,
    "bytes_in_flight": 503,
    "busy": 503,
}

#: The longest C{path} a refusal event carries.
REFUSAL_PATH_LIMIT = 200

_refusal_log = Logger(namespace="kcoral.server.refusals")


def log_refusal(
    reason: str, *, client: str | None, request_id: str | None, path: bytes | None = None
) -> None:
    """
    Log the C{request_refused} event of a refusal: C{status} and C{reason}
    (one of L{REFUSALS}), the C{client}'s address, the C{request_id} of the
    answer (its C{X-Request-ID}) and the C{path} asked for when it was read.
    A server refusing service (503) or a request without a valid token (401)
    is a warning; a client's own fault is information.
    """
    status = REFUSALS[reason]
    _refusal_log.emit(
        LogLevel.warn if status in (401, 503) else LogLevel.info,
        "refused a request from {client}: {status} {reason}",
        kcoral_event="request_refused",
        status=status,
        reason=reason,
        client=client,
        request_id=request_id,
        path=None if path is None else path[:REFUSAL_PATH_LIMIT].decode("latin-1"),
    )


def peer_host(transport: object) -> str | None:
    """The client's IP address on C{transport} (C{None} for a UNIX socket)."""
    peer = getattr(transport, "getPeer", None)
    host = getattr(peer(), "host", None) if peer is not None else None
    return host if isinstance(host, str) else None


_REASONS = {
    400: b"Bad Request",
    401: b"Unauthorized",
    404: b"Not Found",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    413: b"Content Too Large",
    414: b"URI Too Long",
    431: b"Request Header Fields Too Large",
    500: b"Internal Server Error",
    503: b"Service Unavailable",
}


def error_json(status: int, request_id: str, message: str | None = None) -> tuple[str, bytes]:
    """The kind and the encoded ERROR body (protocol §9.2) for C{status}."""
    kind, default = status_error(status)
    return kind, json_dumps(error_body(request_id, kind, message or default))


def raw_error_response(status: int, message: str | None = None, request_id: str = "") -> bytes:
    """
    A complete HTTP/1.1 error response with a JSON ERROR body, for the
    moments before a L{Request} can answer (the request head is broken, the
    client is too slow, the server is full).  The connection always closes.
    """
    request_id = request_id or choose_request_id(None)
    kind, body = error_json(status, request_id, message)
    lines = [
        b"HTTP/1.1 %d %s" % (status, _REASONS.get(status, b"Error")),
        b"Content-Type: application/json",
        b"Content-Length: %d" % (len(body),),
        b"X-Request-ID: " + request_id.encode("ascii"),
        b"Connection: close",
    ]
    for name, value in REQUEST_KIND_HEADERS.get(kind, {}).items():
        lines.append(name.encode("ascii") + b": " + value.encode("ascii"))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body
