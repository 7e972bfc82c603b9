"""
L{kcoral.server.http.site.send_now}: a finished response leaves before its
access-log line, on a real socket (a socket pair; no reactor runs).
"""

from __future__ import annotations

import socket
from typing import Any

import attrs
from twisted.internet import tcp
from twisted.internet.protocol import Protocol
from twisted.internet.testing import MemoryReactor, StringTransport
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource

from kcoral.server.http.site import KcoralSite, send_now

RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


class _Producer:
    def resumeProducing(self) -> None:
        raise AssertionError("resumed in the middle of a request's end")

    def pauseProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


@attrs.define
class _Channel:
    transport: Any


@attrs.define
class _Request:
    channel: _Channel


class SendNowTests(SynchronousTestCase):
    def connection(self) -> tuple[tcp.Connection, socket.socket, MemoryReactor]:
        ours, theirs = socket.socketpair()
        for s in (ours, theirs):
            s.setblocking(False)
            self.addCleanup(s.close)
        reactor = MemoryReactor()
        connection = tcp.Connection(ours, Protocol(), reactor)
        connection.connected = 1
        return connection, theirs, reactor

    def received(self, peer: socket.socket) -> bytes:
        try:
            return peer.recv(1 << 16)
        except BlockingIOError:
            return b""

    def test_buffered_bytes_leave_now(self) -> None:
        """What the connection buffered is on the socket at once, and the reactor is done with it."""
        connection, peer, reactor = self.connection()
        connection.write(RESPONSE)
        self.assertEqual(self.received(peer), b"")
        self.assertIn(connection, reactor.getWriters())
        send_now(connection)
        self.assertEqual(self.received(peer), RESPONSE)
        self.assertNotIn(connection, reactor.getWriters())
        send_now(connection)  # nothing left: nothing done
        self.assertEqual(self.received(peer), b"")

    def test_closing_connection_left_to_the_reactor(self) -> None:
        """A connection being closed keeps its bytes for the reactor, which closes it after."""
        connection, peer, reactor = self.connection()
        connection.write(RESPONSE)
        connection.loseConnection()
        send_now(connection)
        self.assertEqual(self.received(peer), b"")
        self.assertIn(connection, reactor.getWriters())

    def test_paused_producer_left_to_the_reactor(self) -> None:
        """Writing would resume a paused producer here: left to the reactor."""
        connection, peer, reactor = self.connection()
        connection.registerProducer(_Producer(), True)
        connection.producerPaused = True
        connection.write(RESPONSE)
        send_now(connection)
        self.assertEqual(self.received(peer), b"")
        self.assertIn(connection, reactor.getWriters())

    def test_a_wrapper_writes_the_connection_below(self) -> None:
        """
        Under TLS (a protocol wrapper, as Twisted's TLS protocol is) the
        bytes are already in the TCP connection below: it is written.
        """
        connection, peer, _ = self.connection()
        wrapper = ProtocolWrapper(WrappingFactory(None), Protocol())
        wrapper.makeConnection(connection)
        wrapper.write(b"encrypted bytes")
        send_now(wrapper)
        self.assertEqual(self.received(peer), b"encrypted bytes")

    def test_not_a_socket(self) -> None:
        """A test's transport (or none) is left alone."""
        transport = StringTransport()
        transport.write(RESPONSE)
        send_now(transport)
        send_now(None)
        self.assertEqual(transport.value(), RESPONSE)

    def test_site_sends_before_its_access_log_line(self) -> None:
        """The site's access-log line is written once the client has the response."""
        connection, peer, _ = self.connection()
        site = KcoralSite(Resource(), max_request_bytes=1 << 20)
        seen: list[bytes] = []

        class _LogFile:
            def write(self, line: str) -> None:
                seen.append(self_.received(peer))

            def flush(self) -> None:
                pass

        self_ = self
        site._logFile = _LogFile()
        site._logDateTime = "-"
        site._logFormatter = lambda date, request: "line"
        connection.write(RESPONSE)
        site.log(_Request(_Channel(connection)))
        self.assertEqual(seen, [RESPONSE])
