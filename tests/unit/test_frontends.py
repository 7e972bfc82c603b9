"""
Tests for L{kcoral.server.frontends}: the shared port, the merged health
and the broker's socket place (what each front end gets:
C{tests.unit.test_topology}).
"""

from __future__ import annotations

import os
import socket
from typing import Any

from twisted.internet.protocol import Factory, Protocol
from twisted.trial.unittest import SynchronousTestCase

from kcoral.server.frontends import listen_reusing_port, merge_health


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


def _health(index: int, workers: list[str], ready: int, active: int) -> dict[str, Any]:
    return {
        "status": "ok",
        "load": {
            "request_capacity": len(workers),
            "requests_in_progress": active,
            "requests_waiting": 0,
        },
        "active_requests": active,
        "queue_length": 0,
        "workers": [{"worker_id": w} for w in workers],
        "spares": [],
        "gpus": [{"gpu_id": 0, "lease_depth": 1, "holder": "gpu0/w1", "spares_ready": ready}],
        "front_end": {"index": index, "of": 2},
    }


class MergeHealthTests(SynchronousTestCase):
    def test_the_whole_server(self) -> None:
        own = _health(1, ["gpu0/w1", "gpu0/w3"], ready=1, active=1)
        peers = {0: _health(0, ["gpu0/w0", "gpu0/w2"], ready=2, active=0), 1: {"stale": True}}
        merged = merge_health(own, peers, 1)
        self.assertEqual(
            merged["load"],
            {"request_capacity": 4, "requests_in_progress": 1, "requests_waiting": 0},
        )
        self.assertEqual(
            [(w["worker_id"], w["front_end"]) for w in merged["workers"]],
            [("gpu0/w0", 0), ("gpu0/w2", 0), ("gpu0/w1", 1), ("gpu0/w3", 1)],
        )
        # The lease figures are this process's (the broker's); spares are summed.
        self.assertEqual(merged["gpus"][0]["holder"], "gpu0/w1")
        self.assertEqual(merged["gpus"][0]["spares_ready"], 3)
        self.assertEqual(merged["front_end"], {"index": 1, "of": 2, "reporting": [0, 1]})
        self.assertEqual(own["load"]["request_capacity"], 2)  # not changed in place


class SocketPlaceTests(SynchronousTestCase):
    def test_a_deep_temporary_directory_is_not_used(self) -> None:
        """A Unix socket path has a kernel limit: under a deep TMPDIR the broker uses /tmp."""
        import tempfile

        from kcoral.server import frontends

        self.patch(tempfile, "tempdir", "/tmp/" + "d" * 90)
        self.assertEqual(frontends._socket_parent(), "/tmp")
        self.patch(tempfile, "tempdir", "/var/tmp")
        self.assertEqual(frontends._socket_parent(), "/var/tmp")
