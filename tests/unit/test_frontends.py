"""
Tests for L{kcoral.server.frontends}: what each front end gets, and the
shared port.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from twisted.internet.protocol import Factory, Protocol
from twisted.trial.unittest import SynchronousTestCase

from kcoral.config import ServerConfig
from kcoral.server.frontends import listen_reusing_port, share_of


class ShareTests(SynchronousTestCase):
    def test_caps_logs_and_broker(self) -> None:
        config = ServerConfig(
            device="cpu",
            num_workers=4,
            front_ends=3,
            log_dir=Path("/srv/logs"),
            cache_capacity_bytes=1000,
            max_bytes_in_flight=10,
            max_connections=0,
            max_queued_requests=7,
        )
        first = share_of(config, 0, None)
        third = share_of(config, 2, Path("/run/broker.sock"))
        self.assertEqual(first.log_dir, Path("/srv/logs"))
        self.assertEqual(third.log_dir, Path("/srv/logs/front-end-2"))
        self.assertEqual((third.front_end_index, third.lease_broker), (2, Path("/run/broker.sock")))
        # Caps are split (rounded up); 0 (no cap) stays 0.
        self.assertEqual(
            (
                third.cache_capacity_bytes,
                third.max_bytes_in_flight,
                third.max_connections,
                third.max_queued_requests,
            ),
            (334, 4, 0, 3),
        )
        self.assertEqual(third.worker_ids(), ["cpu/w2"])


class _Reactor:
    """Enough of a reactor for L{listen_reusing_port}: what it adopts."""

    def __init__(self) -> None:
        self.adopted: list[tuple[int, int]] = []

    def adoptStreamPort(self, fd: int, family: int, factory: object) -> object:  # noqa: N802
        # Keep a descriptor as the reactor would, to hold the port open.
        self.adopted.append((os.dup(fd), family))
        return object()


class ReusePortTests(SynchronousTestCase):
    def test_two_processes_worth_of_listeners_on_one_port(self) -> None:
        reactor = _Reactor()
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        factory = Factory.forProtocol(Protocol)
        description = f"tcp:port={port}:interface=127.0.0.1:backlog=64"
        listen_reusing_port(reactor, description, factory)
        listen_reusing_port(reactor, description, factory)
        self.assertEqual(len(reactor.adopted), 2)
        for fd, family in reactor.adopted:
            self.assertEqual(family, socket.AF_INET)
            bound = socket.socket(fileno=fd)
            self.assertEqual(bound.getsockname(), ("127.0.0.1", port))
            bound.close()

    def test_only_tcp(self) -> None:
        with self.assertRaisesRegex(ValueError, "plain TCP"):
            listen_reusing_port(_Reactor(), "ssl:8443:privateKey=k.pem", Factory())
