"""
L{kcoral.testing.live_server.free_port_run}: the node ports of a gateway's
front ends, picked where no outgoing connection's local port can land.
"""

from __future__ import annotations

import socket

from twisted.trial.unittest import SynchronousTestCase

from kcoral.testing.live_server import _ephemeral_ports, free_port_run


class FreePortRunTests(SynchronousTestCase):
    def test_run_is_free_and_below_the_ephemeral_range(self) -> None:
        """Every port of the run binds, and the run ends before the ephemeral range."""
        first = free_port_run(3)
        low, _ = _ephemeral_ports()
        self.assertLess(first + 2, low)
        for port in range(first, first + 3):
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))

    def test_a_taken_port_is_skipped(self) -> None:
        """A run never includes a port something is bound to."""
        first = free_port_run(1)
        with socket.socket() as held:
            held.bind(("127.0.0.1", first))
            for _ in range(50):
                start = free_port_run(2)
                self.assertNotIn(first, (start, start + 1))
