"""
An in-memory KCoral server for client unit tests: treq's
C{StringStubbingResource} behind a C{RequestTraversalAgent}, answering from
a script of responses and recording what each request carried (parsed with
the server's own multipart parser).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import attrs
from treq.client import HTTPClient
from treq.testing import RequestTraversalAgent, StringStubbingResource
from twisted.internet.task import Clock, Cooperator

from kcoral.client.async_client import AsyncClient
from kcoral.wire.multipart import encode_response, parse_request_body

Reply = tuple[int, dict[str, str], bytes]


@attrs.define
class Seen:
    """One request as the fake server saw it."""

    method: str
    path: str
    headers: dict[str, list[str]]
    program: dict[str, Any] | None = None
    program_bytes: bytes = b""
    blobs: dict[str, bytes] = attrs.Factory(dict)
    body: bytes = b""


def json_reply(body: dict[str, Any], code: int = 200, **headers: str) -> Reply:
    request_id = body.get("request_id", "00000000-0000-0000-0000-000000000000")
    all_headers = {"Content-Type": "application/json", "X-Request-ID": request_id, **headers}
    return code, all_headers, json.dumps(body).encode()


def result_reply(body: dict[str, Any], parts: list[bytes]) -> Reply:
    content_type, chunks = encode_response(body, parts)
    return 200, {"Content-Type": content_type, "X-Request-ID": body["request_id"]}, b"".join(chunks)


def completed(results: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "status": "COMPLETED",
        "request_id": "11111111-1111-4111-8111-111111111111",
        "queue_ms": 1,
        "elapsed_ms": 2.5,
        "lease_wait_ms": 0,
        "lease_held_ms": 0,
        "stdout": "out",
        "stderr": "",
        "stdout_truncated": False,
        "stderr_truncated": False,
        "results": results or {},
    }
    body.update(extra)
    return body


def cache_miss(*digests: str) -> dict[str, Any]:
    return {
        "status": "CACHE_MISS",
        "request_id": "22222222-2222-4222-8222-222222222222",
        "missing_blobs": list(digests),
    }


class FakeServer:
    """Answers each request with the next scripted reply (or C{handler(seen)})."""

    def __init__(self, *replies: Reply | Callable[[Seen], Reply]) -> None:
        self.replies = list(replies)
        self.seen: list[Seen] = []
        self.clock = Clock()
        self.agent = RequestTraversalAgent(StringStubbingResource(self._answer))

    def _answer(
        self, method: bytes, url: str, params: Any, headers: dict[bytes, list[bytes]], data: bytes
    ) -> Reply:
        named = {
            (k.decode() if isinstance(k, bytes) else k).lower(): [
                v.decode() if isinstance(v, bytes) else v for v in vs
            ]
            for k, vs in headers.items()
        }
        seen = Seen(
            method.decode() if isinstance(method, bytes) else method,
            url.split("/", 3)[-1],
            named,
            body=data,
        )
        if seen.method == "POST":
            parsed = parse_request_body(named["content-type"][0], data)
            seen.program_bytes = parsed.program
            seen.program = json.loads(parsed.program)
            seen.blobs = {digest: blob.read() for digest, blob in parsed.blobs.items()}
        self.seen.append(seen)
        reply = self.replies.pop(0)
        return reply(seen) if callable(reply) else reply

    def client(self, **kwargs: Any) -> AsyncClient:
        cooperator = Cooperator(scheduler=lambda work: self.clock.callLater(0, work))
        return AsyncClient(
            "http://kcoral.test/prefix/",
            http_client=HTTPClient(self.agent),
            reactor=self.clock,
            cooperator=cooperator,
            **kwargs,
        )

    def settle(self) -> None:
        """Let body producers and the in-memory connections run to quiescence."""
        for _ in range(50):
            self.clock.advance(0)
            self.agent.flush()
