"""
Tests for L{kcoral.server.frontends}: the shared port, the merged health
and the broker's socket place (what each front end gets:
C{tests.unit.test_topology}).
"""

from __future__ import annotations

import os
import socket

from twisted.internet.protocol import Factory, Protocol
from twisted.trial.unittest import SynchronousTestCase

from kcoral.server.frontends import listen_reusing_port


class _Reactor:
    """Enough of a reactor for L{listen_reusing_port}: what it adopts."""

    def __init__(self) -> None:
        self.adopted: list[tuple[int, int]] = []

    def adoptStreamPort(self, fd: int, family: int, factory: object) -> object:  # noqa: N802
        # The reactor keeps a duplicate, as Twisted's does.
        self.adopted.append((os.dup(fd), family))
        return object()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class ReusePortTests(SynchronousTestCase):
    def test_every_front_end_binds_the_port(self) -> None:
        reactor = _Reactor()
        port = _free_port()
        factory = Factory.forProtocol(Protocol)
        description = f"tcp:port={port}:interface=127.0.0.1:backlog=64"
        listen_reusing_port(reactor, description, factory, first=True)
        listen_reusing_port(reactor, description, factory, first=False)
        self.assertEqual(len(reactor.adopted), 2)
        for fd, family in reactor.adopted:
            self.assertEqual(family, socket.AF_INET)
            bound = socket.socket(fileno=fd)
            self.assertEqual(bound.getsockname(), ("127.0.0.1", port))
            bound.close()

    def test_the_first_refuses_a_taken_port(self) -> None:
        """A port someone else holds, even with SO_REUSEPORT set, is not shared."""
        port = _free_port()
        other = socket.socket()
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", port))
        other.listen(1)
        self.addCleanup(other.close)
        with self.assertRaises(OSError):
            listen_reusing_port(_Reactor(), f"tcp:port={port}:interface=127.0.0.1", Factory(), True)

    def test_only_tcp(self) -> None:
        with self.assertRaisesRegex(ValueError, "plain TCP"):
            listen_reusing_port(_Reactor(), "ssl:8443:privateKey=k.pem", Factory(), True)


class SocketPlaceTests(SynchronousTestCase):
    def test_a_deep_temporary_directory_is_not_used(self) -> None:
        """A Unix socket path has a kernel limit: under a deep TMPDIR the broker uses /tmp."""
        import tempfile

        from kcoral.server import frontends

        self.patch(tempfile, "tempdir", "/tmp/" + "d" * 90)
        self.assertEqual(frontends._socket_parent(), "/tmp")
        self.patch(tempfile, "tempdir", "/var/tmp")
        self.assertEqual(frontends._socket_parent(), "/var/tmp")
