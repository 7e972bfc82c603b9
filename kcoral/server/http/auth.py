# -*- test-case-name: tests.unit.test_auth -*-
"""
Who may talk to the server: bearer tokens, each with a client name.

The token file (C{--auth-token-file}) holds one client per line,
C{NAME TOKEN}; a file of a single bare token names its client C{default}.
Blank lines and lines starting with C{#} are ignored.  The client name is
logged with each request and is the identity the worker-reuse scope keys
on (C{IKcoralRequest(request).client_name}, L{kcoral.server.http.component}).

L{TokenGuard} sits in front of the Klein resource: C{/health} is always
open (load balancers probe it), C{/metrics} and C{/status} only with
C{--public-metrics}, everything else needs C{Authorization: Bearer TOKEN}.
Tokens are compared in constant time, against every known token.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable
from pathlib import Path

import attrs
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource

from kcoral.server.http.component import IKcoralRequest
from kcoral.wire.errors import REQUEST_KIND_HEADERS, choose_request_id, error_body
from kcoral.wire.jsontext import json_dumps

#: Paths answered without a token.
OPEN_PATHS = frozenset({b"/health"})

#: Paths answered without a token only with C{--public-metrics}.
METRICS_PATHS = frozenset({b"/metrics", b"/status", b"/status.json"})

_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.@")


class TokenFileError(ValueError):
    """The token file is unreadable or malformed (the message says where)."""


@attrs.frozen
class Tokens:
    """The known tokens and their client names."""

    #: (token bytes, client name) pairs, in file order.
    entries: tuple[tuple[bytes, str], ...]

    def client_for(self, authorization: bytes | None) -> str | None:
        """
        The client name of an C{Authorization} header value, or C{None}.

        Every token is compared (in constant time) whatever matched first, so
        the answer's timing does not tell which token came close.
        """
        if not authorization:
            return None
        scheme, _, credential = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        credential = credential.strip()
        found = None
        for token, name in self.entries:
            if hmac.compare_digest(credential, token) and found is None:
                found = name
        return found


def parse_tokens(text: str, source: str = "token file") -> Tokens:
    """Parse the token file's text (see the module docstring)."""
    entries: list[tuple[bytes, str]] = []
    names: set[str] = set()
    lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1)]
    lines = [(n, line) for n, line in lines if line and not line.startswith("#")]
    for number, line in lines:
        fields = line.split()
        if len(fields) == 1 and len(lines) == 1:
            name, token = "default", fields[0]
        elif len(fields) == 2:
            name, token = fields
        else:
            raise TokenFileError(f"{source} line {number}: expected 'NAME TOKEN'")
        if not set(name) <= _NAME_CHARS:
            raise TokenFileError(f"{source} line {number}: client name {name!r} has odd characters")
        if name in names:
            raise TokenFileError(f"{source} line {number}: client name {name!r} repeated")
        if len(token) < 16:
            raise TokenFileError(f"{source} line {number}: token shorter than 16 characters")
        try:
            encoded = token.encode("ascii")
        except UnicodeEncodeError:
            raise TokenFileError(f"{source} line {number}: token is not ASCII") from None
        names.add(name)
        entries.append((encoded, name))
    if not entries:
        raise TokenFileError(f"{source} holds no token")
    return Tokens(tuple(entries))


def load_tokens(path: Path) -> Tokens:
    """Read and parse the token file (blocking: call it from a thread)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TokenFileError(f"cannot read {path}: {e}") from None
    return parse_tokens(text, str(path))


class TokenGuard(Resource):
    """
    A leaf resource that checks the bearer token, records the client name on
    the request, and hands the request to the wrapped (leaf) resource.
    """

    isLeaf = True

    def __init__(self, inner: IResource, tokens: Tokens, *, public_metrics: bool = False) -> None:
        super().__init__()
        self._inner = inner
        self._tokens = tokens
        self._open = OPEN_PATHS | (METRICS_PATHS if public_metrics else frozenset())

    def refuses(self, path: bytes, authorization: bytes | None) -> bool:
        """
        Whether a request for C{path} with this C{Authorization} value is
        refused: the HTTP layer asks as soon as a request head is in, so a
        request without a valid token never has its body read
        (L{kcoral.server.http.request.LimitedRequest}).
        """
        return path not in self._open and self._tokens.client_for(authorization) is None

    def render(self, request: IRequest) -> bytes | int:
        if request.path not in self._open:
            name = self._tokens.client_for(request.getHeader(b"authorization"))
            if name is None:
                return self._unauthorized(request)
            IKcoralRequest(request).client_name = name
        return self._inner.render(request)

    def _unauthorized(self, request: IRequest) -> bytes:
        # The refusal is logged (request_refused, reason "unauthorized") by
        # the request when the 401 is sent (kcoral.server.http.request).
        request_id = choose_request_id(_raw(request, b"x-request-id"))
        request.setResponseCode(401)
        request.setHeader(b"Content-Type", b"application/json")
        request.setHeader(b"X-Request-ID", request_id.encode("ascii"))
        for name, value in REQUEST_KIND_HEADERS["unauthorized"].items():
            request.setHeader(name.encode("ascii"), value.encode("ascii"))
        body = error_body(request_id, "unauthorized", "a valid bearer token is required")
        return json_dumps(body)


def _raw(request: IRequest, name: bytes) -> list[bytes] | None:
    values = request.requestHeaders.getRawHeaders(name)
    return None if values is None else list(values)


def beyond_loopback(hosts: Iterable[str]) -> list[str]:
    """
    The addresses among C{hosts} that other machines can reach: anything but
    127.0.0.0/8 and ::1 (C{0.0.0.0} and C{::} included).  Names that are not
    IP addresses count as reachable.
    """
    reachable = []
    for host in hosts:
        try:
            address = ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            reachable.append(host)
            continue
        mapped = getattr(address, "ipv4_mapped", None)
        if not (address.is_loopback or (mapped is not None and mapped.is_loopback)):
            reachable.append(host)
    return reachable
