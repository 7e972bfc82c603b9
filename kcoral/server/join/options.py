# -*- test-case-name: tests.unit.test_join -*-
"""
Where a joined node listens: loopback only.

A node that joins a pool takes its work from NATS and runs it in process
(L{kcoral.server.join.runner}); nothing needs to reach its HTTP server but
local tools (C{/health}, C{/metrics}, a direct C{/execute} on the same
machine).  L{check_join_endpoints} refuses, at start, a C{--listen}/C{--host}
that other machines could reach.
"""

from __future__ import annotations

from collections.abc import Sequence

from twisted.internet.endpoints import _parse

from kcoral.server.http.auth import beyond_loopback

__all__ = ["JoinListenError", "check_join_endpoints"]

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
