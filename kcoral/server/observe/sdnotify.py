# -*- test-case-name: tests.unit.test_sdnotify -*-
"""
systemd's readiness protocol (C{sd_notify(3)}), for C{Type=notify} units.

systemd starts a C{Type=notify} service with C{$NOTIFY_SOCKET} naming a
Unix datagram socket; the service sends newline-separated C{KEY=VALUE}
lines to it: C{READY=1} once it serves, C{STOPPING=1} when it begins to
stop, C{STATUS=...} as a one-line status for C{systemctl status}.  Each
message is one non-blocking C{sendto} (it never waits on the reactor).

L{SystemdNotifier.from_environment} reads the variable and, as
C{sd_notify}'s C{unset_environment} does, removes it, so the server's
children (workers, compilers, other front ends) cannot speak for it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import MutableMapping

import attrs
from twisted.logger import Logger

__all__ = ["NOTIFY_SOCKET", "SystemdNotifier"]

#: The environment variable systemd sets for a C{Type=notify} service.
NOTIFY_SOCKET = "NOTIFY_SOCKET"


@attrs.frozen
class SystemdNotifier:
    """
    Sends state lines to systemd's notification socket.

    @ivar address: the socket's path, or an abstract address (its name
        after a NUL byte) when C{$NOTIFY_SOCKET} starts with C{@}.
    """

    address: str

    log = Logger()

    @classmethod
    def from_environment(
        cls, environ: MutableMapping[str, str] | None = None
    ) -> SystemdNotifier | None:
        """
        The notifier C{$NOTIFY_SOCKET} names, which is removed from
        C{environ} (L{os.environ} by default); C{None} when it is unset or
        not a Unix socket (systemd's C{vsock:} addresses are not supported:
        a warning says so).
        """
        env = os.environ if environ is None else environ
        value = env.pop(NOTIFY_SOCKET, "")
        if not value:
            return None
        if value.startswith("@"):
            return cls("\0" + value[1:])
        if value.startswith("/"):
            return cls(value)
        cls.log.warn(
            "NOTIFY_SOCKET {address} is not a Unix socket path: systemd is not told "
            "when the server is ready",
            address=value,
        )
        return None

    def notify(self, *lines: str) -> bool:
        """
        Send C{lines} (C{"READY=1"}, C{"STATUS=..."}) as one message.

        @return: whether it was sent; a failure is logged, never raised.
        """
        message = "\n".join(line.replace("\n", " ") for line in lines).encode("utf-8")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.setblocking(False)
                s.sendto(message, self.address)
        except OSError as e:
            self.log.warn(
                "could not notify systemd ({lines}): {error}", lines=list(lines), error=str(e)
            )
            return False
        return True
