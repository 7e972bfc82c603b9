# -*- test-case-name: tests.unit.test_join -*-
"""
The node's own server, over loopback HTTP.

A joined node runs a pool job by POSTing it to its own C{/execute} on
loopback, exactly as a client would: the same parsing, blob cache, seat
queue, worker, rendering, request log and metrics, and the response bytes
are the ones the gateway relays to its client unchanged.  (The in-process
alternative would repeat C{/execute}'s rendering and streaming beside the
HTTP layer; docs/gateway.md gives the loopback round trip's cost.)
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from typing import Any

import attrs
from treq.client import HTTPClient
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.web.http_headers import Headers

__all__ = ["LocalResponse", "LocalServer", "missing_blobs"]

#: Request headers a job's options may not set: the loopback request's own.
RESERVED_HEADERS = frozenset(
    {
        "authorization",
        "connection",
        "content-length",
        "content-type",
        "host",
        "keep-alive",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "expect",
        "x-request-id",
    }
)


@attrs.frozen
class LocalResponse:
    """What the node's server answered: the response the gateway relays."""

    status: int
    content_type: str
    body: bytes
    retry_after: str | None = None


def missing_blobs(response: LocalResponse) -> list[str] | None:
    """The C{missing_blobs} of a CACHE_MISS answer, or C{None} for any other."""
    if response.status != 200 or not response.content_type.startswith("application/json"):
        return None
    try:
        value = json.loads(response.body)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("status") != "CACHE_MISS":
        return None
    missing = value.get("missing_blobs")
    if not isinstance(missing, list) or not all(isinstance(m, str) for m in missing):
        return None
    return list(missing)


@attrs.define(eq=False)
class LocalServer:
    """
    The node's C{/health} and C{/execute} at C{base_url} (loopback).

    @ivar token: the bearer token the node's server wants (its token
        file's first), or C{None} when it has none.
    """

    _http: HTTPClient
    base_url: str
    token: str | None = None

    log = Logger()

    def _headers(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        headers = dict(extra or {})
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    async def health(self) -> dict[str, Any]:
        """The server's C{/health} body (any status: a stopping server says so)."""
        response = await self._http.get(self.base_url + "/health", headers=_h(self._headers()))
        body = await response.content()
        value = json.loads(body)
        if not isinstance(value, dict):
            raise ValueError("/health did not answer a JSON object")
        return value

    async def execute(
        self,
        request_id: str,
        program: str,
        blobs: Mapping[str, bytes] | None = None,
        options: Mapping[str, str] | None = None,
    ) -> LocalResponse:
        """
        POST C{program} (and C{blobs}, by digest) to C{/execute} as request
        C{request_id}, with the job's C{options} as headers (reserved ones
        dropped); the whole response.
        """
        headers = {
            name: value
            for name, value in (options or {}).items()
            if name.lower() not in RESERVED_HEADERS
        }
        headers["X-Request-ID"] = request_id
        content_type, body = _body(program, blobs or {})
        headers["Content-Type"] = content_type
        d: Deferred[Any] = self._http.post(
            self.base_url + "/execute", data=body, headers=_h(self._headers(headers))
        )
        response = await d
        data = await response.content()
        return LocalResponse(
            status=response.code,
            content_type=_first(response, b"content-type") or "application/octet-stream",
            body=data,
            retry_after=_first(response, b"retry-after"),
        )


def _body(program: str, blobs: Mapping[str, bytes]) -> tuple[str, bytes]:
    """
    The C{multipart/form-data} body of a program and its blobs by digest
    (protocol §3), with a boundary that occurs in no part.
    """
    parts = [("program", "application/json", program.encode("utf-8"))]
    parts += [
        (f"blob:{digest}", "application/octet-stream", data) for digest, data in blobs.items()
    ]
    while True:
        boundary = secrets.token_hex(16)
        marker = boundary.encode("ascii")
        if not any(marker in data for _, _, data in parts):
            break
    chunks = []
    for name, content_type, data in parts:
        chunks += [
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n'
            f"Content-Type: {content_type}\r\n\r\n".encode("ascii"),
            data,
            b"\r\n",
        ]
    chunks.append(f"--{boundary}--\r\n".encode("ascii"))
    return f"multipart/form-data; boundary={boundary}", b"".join(chunks)


def _first(response: Any, name: bytes) -> str | None:
    values = response.headers.getRawHeaders(name)
    if not values:
        return None
    value = values[0]
    return value.decode("latin-1") if isinstance(value, bytes) else str(value)


def _h(headers: dict[str, str]) -> Headers:
    """Twisted's L{Headers} of a plain mapping."""
    return Headers({name: [value] for name, value in headers.items()})
