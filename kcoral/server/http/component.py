# -*- test-case-name: tests.unit.test_http_component -*-
"""
What kcoral knows of a request beyond L{IRequest}, as a typed component.

Twisted's L{Request} is L{Componentized}; as Klein adapts it to
C{IKleinRequest}, kcoral adapts it to L{IKcoralRequest}: the request's
client, the fate of its body and its timing.  Code asks
C{IKcoralRequest(request).too_large} instead of probing the request with
C{getattr}.  A L{kcoral.server.http.request.LimitedRequest} (the server's
own) fills its component in as its body arrives; any other request (a test's
C{StubTreq}, another site) gets a fresh L{KcoralRequest} on first use, with
nothing flagged and nothing counted.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.interfaces import IAddress, IReactorTime
from twisted.python.components import registerAdapter
from twisted.web.iweb import IRequest
from twisted.web.server import Request
from zope.interface import Attribute, Interface, implementer

from kcoral.ipc.uploads import StreamedBody

__all__ = ["IKcoralRequest", "KcoralRequest", "address_host", "client_identity"]


def address_host(address: IAddress | None) -> str | None:
    """The IP address of C{address}; C{None} for a UNIX socket or none."""
    if isinstance(address, (IPv4Address, IPv6Address)):
        return address.host
    return None


class IKcoralRequest(Interface):
    """
    A request as kcoral sees it: who sent it, what became of its body, and
    when its head and body arrived.
    """

    peer: str | None = Attribute(
        "The client's IP address (C{None} for a UNIX socket): the per-address caps' key."
    )
    client_name: str | None = Attribute(
        "The name of the bearer token the request carried (set by"
        " L{kcoral.server.http.auth.TokenGuard}), or C{None} when the server has"
        " no tokens: the client identity that worker reuse is scoped by."
    )
    too_large: bool = Attribute(
        "The body is over C{max_request_bytes}: it was discarded as it arrived;"
        " the API answers 413."
    )
    over_capacity: bool = Attribute(
        "The server already holds C{max_bytes_in_flight} of request bodies (or"
        " the client its C{max_bytes_per_client}): the body was discarded; the"
        " API answers 503."
    )
    unauthorized: bool = Attribute(
        "The site has tokens and the head carried no valid one for its path:"
        " the body is not read; the token guard answers 401."
    )
    body_parser: StreamedBody | None = Attribute(
        "The multipart body parsed as it arrived (L{StreamedBody}), when the"
        " site streams bodies (then C{content} stays empty); else C{None}."
    )
    body_bytes: int | None = Attribute(
        "Body bytes received so far; C{None}: not counted (not a kcoral site's request)."
    )
    body_seconds: float | None = Attribute(
        "Reactor seconds from the end of the request head to the last body byte"
        " (C{None} until the body is complete, or not measured): the upload as"
        " the server sees it."
    )

    def since_head() -> float | None:
        """Reactor seconds since the end of the request head (C{None}: not measured)."""

    def hold_bytes(size: int) -> None:
        """
        Count a response's C{size} bytes of shared result buffers against the
        server's bytes in flight until the request finishes (nothing where
        the site does not count them).
        """


@implementer(IKcoralRequest)
@attrs.define(eq=False)
class KcoralRequest:
    """
    The L{IKcoralRequest} component of one request: plain data, filled in
    by L{kcoral.server.http.request.LimitedRequest} as the request arrives.
    """

    peer: str | None = None
    client_name: str | None = None
    too_large: bool = False
    over_capacity: bool = False
    unauthorized: bool = False
    body_parser: StreamedBody | None = None
    body_bytes: int | None = None
    body_seconds: float | None = None
    #: Reactor seconds at the end of the request head, and the reactor they
    #: were read from (C{None}: not measured).
    head_at: float | None = None
    clock: IReactorTime | None = None
    #: Counts held response bytes against the site's bytes in flight.
    _hold: Callable[[int], None] | None = None

    @classmethod
    def of(cls, request: Request) -> KcoralRequest:
        """The component of a request no kcoral site made: its client's address only."""
        return cls(peer=address_host(request.getClientAddress()))

    def since_head(self) -> float | None:
        if self.head_at is None or self.clock is None:
            return None
        return float(self.clock.seconds()) - self.head_at

    def hold_bytes(self, size: int) -> None:
        if size and self._hold is not None:
            self._hold(size)


registerAdapter(KcoralRequest.of, Request, IKcoralRequest)


def client_identity(request: IRequest) -> str | None:
    """
    Who sent C{request}, for the reuse scope: the client name of its bearer
    token when the server has tokens (L{kcoral.server.http.auth}), else the
    TCP peer's address (C{None} when the transport has none).
    """
    state = IKcoralRequest(request)
    if state.client_name is not None:
        return "client:" + state.client_name
    return state.peer
