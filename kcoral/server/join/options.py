# -*- test-case-name: tests.unit.test_join -*-
"""
Where a joined node listens: loopback only.

A node that joins a pool takes its work from NATS; nothing needs to reach
its HTTP server but the node itself (its jobs go to its own C{/execute}
over loopback, L{kcoral.server.join.local}).  L{check_join_endpoints}
refuses, at start, a C{--listen}/C{--host} that other machines could reach;
L{loopback_url} picks the port the node talks to itself on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from twisted.internet.endpoints import _parse

from kcoral.server.http.auth import beyond_loopback

__all__ = ["JoinListenError", "check_join_endpoints", "loopback_url"]

#: Endpoint kinds a joined node may listen on.
_TCP = ("tcp", "tcp6")


class JoinListenError(ValueError):
    """A listening endpoint that a joined node may not have (the message says which)."""


def check_join_endpoints(descriptions: Sequence[str]) -> None:
    """
    Every endpoint is TCP on a loopback interface (or a UNIX socket), and
    at least one is TCP.

    @raise JoinListenError: naming the first endpoint that is not.
    """
    tcp = 0
    for description in descriptions:
        args, kwargs = _parse(description)
        kind = str(args[0]).lower() if args else ""
        if kind == "unix":
            continue
        if kind not in _TCP:
            raise JoinListenError(
                f"a node that joins a pool listens on plain TCP on loopback, not {description!r}"
            )
        interface = kwargs.get("interface")
        if interface is None or beyond_loopback([interface]):
            raise JoinListenError(
                "a node that joins a pool listens on loopback only "
                "(interface=127.0.0.1 or ::1, or --host 127.0.0.1), not "
                f"{description!r}: its jobs come through NATS"
            )
        tcp += 1
    if tcp == 0:
        raise JoinListenError("a node that joins a pool needs one TCP port on loopback")


def loopback_url(ports: Sequence[Any]) -> str:
    """
    The base URL of the first TCP port among C{ports} (listening ports),
    C{http://127.0.0.1:PORT} or C{http://[::1]:PORT}.

    @raise JoinListenError: none is a loopback TCP port.
    """
    for port in ports:
        address = port.getHost()
        host = getattr(address, "host", None)
        number = getattr(address, "port", None)
        if isinstance(host, str) and isinstance(number, int) and not beyond_loopback([host]):
            shown = f"[{host}]" if ":" in host else host
            return f"http://{shown}:{number}"
    raise JoinListenError("no loopback TCP port to send the pool's jobs to")
