"""
Tests for L{kcoral.server.http.component}: every request adapts to
L{IKcoralRequest}; a plain Twisted request gets an empty component of its
own, a L{LimitedRequest} the one it fills in as its body arrives.
"""

from __future__ import annotations

from typing import Any

from klein import Klein
from twisted.internet.address import IPv4Address, IPv6Address, UNIXAddress
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.http import HTTPChannel
from twisted.web.iweb import IRequest
from twisted.web.resource import Resource
from twisted.web.server import Request, Site
from zope.interface.verify import verifyClass, verifyObject

from kcoral.server.http.component import IKcoralRequest, KcoralRequest, address_host
from kcoral.server.http.request import LimitedRequest
from kcoral.server.http.site import KcoralSite


def plain_request(peer: Any) -> Request:
    """A Twisted request on a channel whose client is C{peer}."""
    channel = HTTPChannel()
    channel.site = Site(Resource())  # what Site.buildProtocol sets
    channel.makeConnection(StringTransport(peerAddress=peer))
    return Request(channel)


class _Seen:
    """Routes that keep the component of the request they served."""

    app = Klein()
    seen: list[IKcoralRequest]
    held: list[Deferred[bytes]]

    def __init__(self) -> None:
        self.seen = []
        self.held = []

    @app.route("/", methods=["POST"])
    def root(self, request: IRequest) -> bytes:
        self.seen.append(IKcoralRequest(request))
        return b"{}"

    @app.route("/hold", methods=["POST"])
    def hold(self, request: IRequest) -> Deferred[bytes]:
        # What the API does while large result parts stream out.
        state = IKcoralRequest(request)
        self.seen.append(state)
        state.hold_bytes(700)
        self.held.append(Deferred())
        return self.held[-1]


class ComponentTests(SynchronousTestCase):
    """The component and its adapter from a plain request."""

    def test_provides_the_interface(self) -> None:
        """L{KcoralRequest} provides every member of L{IKcoralRequest}."""
        self.assertTrue(verifyClass(IKcoralRequest, KcoralRequest))
        self.assertTrue(verifyObject(IKcoralRequest, KcoralRequest()))

    def test_plain_request_adapts(self) -> None:
        """
        A request no kcoral site made adapts to a fresh component carrying
        its client's address and nothing else: no flag set, no body counted,
        nothing measured.
        """
        request = plain_request(IPv4Address("TCP", "10.0.0.5", 4000))
        state = IKcoralRequest(request)
        self.assertIsInstance(state, KcoralRequest)
        self.assertEqual(state.peer, "10.0.0.5")
        self.assertEqual(
            (state.too_large, state.over_capacity, state.unauthorized), (False, False, False)
        )
        self.assertIsNone(state.client_name)
        self.assertIsNone(state.body_parser)
        self.assertIsNone(state.body_bytes)
        self.assertIsNone(state.body_seconds)
        self.assertIsNone(state.since_head())
        state.hold_bytes(1000)  # nothing counts held bytes: no effect

    def test_one_component_per_request(self) -> None:
        """
        The component is cached on its request (what one part of the server
        sets, another reads), and two requests never share one.
        """
        first = plain_request(IPv4Address("TCP", "10.0.0.5", 4000))
        second = plain_request(IPv4Address("TCP", "10.0.0.5", 4001))
        IKcoralRequest(first).client_name = "alice"
        self.assertIs(IKcoralRequest(first), IKcoralRequest(first))
        self.assertEqual(IKcoralRequest(first).client_name, "alice")
        self.assertIsNot(IKcoralRequest(first), IKcoralRequest(second))
        self.assertIsNone(IKcoralRequest(second).client_name)

    def test_addresses(self) -> None:
        """IPv4 and IPv6 clients have a host; a UNIX socket's has none."""
        self.assertEqual(address_host(IPv6Address("TCP", "::1", 4000)), "::1")
        self.assertIsNone(address_host(UNIXAddress(b"/tmp/kcoral.sock")))
        self.assertIsNone(address_host(None))
        self.assertIsNone(IKcoralRequest(plain_request(UNIXAddress(None))).peer)

    def test_since_head(self) -> None:
        """C{since_head} is reactor time since C{head_at}, on C{clock}."""
        clock = Clock()
        clock.advance(5)
        state = KcoralRequest(head_at=2.0, clock=clock)
        self.assertEqual(state.since_head(), 3.0)
        self.assertIsNone(KcoralRequest(head_at=2.0).since_head())

    def test_hold_bytes(self) -> None:
        """C{hold_bytes} passes a non-zero size on to the component's holder."""
        held: list[int] = []
        state = KcoralRequest(hold=held.append)
        state.hold_bytes(0)
        state.hold_bytes(300)
        self.assertEqual(held, [300])


class LimitedRequestComponentTests(SynchronousTestCase):
    """What a kcoral site's request records in its component."""

    def serve(self, data: bytes, host: str = "10.1.2.3") -> tuple[_Seen, KcoralSite, Clock]:
        clock = Clock()
        routes = _Seen()
        site = KcoralSite(routes.app.resource(), max_request_bytes=1024, reactor=clock)
        address = IPv4Address("TCP", host, 40000)
        channel = site.buildProtocol(address)
        channel.makeConnection(StringTransport(peerAddress=address))
        channel.dataReceived(data)
        return routes, site, clock

    def test_component_is_the_requests_own(self) -> None:
        """
        A L{LimitedRequest} registers its own component, C{request.kcoral},
        at construction: adapting returns it, with the client's address and
        a body count that starts at zero.
        """
        site = KcoralSite(_Seen().app.resource(), max_request_bytes=1024, reactor=Clock())
        channel = site.buildProtocol(IPv4Address("TCP", "10.9.9.9", 1))
        channel.makeConnection(StringTransport(peerAddress=IPv4Address("TCP", "10.9.9.9", 1)))
        request = LimitedRequest(channel)
        self.assertIs(IKcoralRequest(request), request.kcoral)
        self.assertEqual(request.kcoral.peer, "10.9.9.9")
        self.assertEqual(request.kcoral.body_bytes, 0)
        self.assertTrue(verifyObject(IKcoralRequest, request.kcoral))

    def test_body_counted_and_timed(self) -> None:
        """The handler sees the body's size and its upload time on the reactor."""
        routes, _, _ = self.serve(
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n0123456789"
        )
        [state] = routes.seen
        self.assertEqual(state.body_bytes, 10)
        self.assertEqual(state.body_seconds, 0.0)
        self.assertEqual(state.since_head(), 0.0)
        self.assertFalse(state.too_large)

    def test_too_large_flagged(self) -> None:
        """A declared body over the limit is flagged, not counted."""
        routes, site, _ = self.serve(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n")
        [state] = routes.seen
        self.assertTrue(state.too_large)
        self.assertEqual(state.body_bytes, 0)
        self.assertEqual(site.bytes_in_flight, 0)

    def test_held_bytes_count_until_finished(self) -> None:
        """
        Bytes held through the component count against the site's bytes in
        flight, for the client's address, until the request finishes.
        """
        routes, site, _ = self.serve(b"POST /hold HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        [state] = routes.seen
        self.assertEqual(state.peer, "10.1.2.3")
        self.assertEqual(site.bytes_in_flight, 700)
        routes.held[0].callback(b"{}")
        self.assertEqual(site.bytes_in_flight, 0)
