# -*- test-case-name: tests.unit.test_http -*-
"""
Running out of descriptors: L{AcceptGuard} stands in for a listening port's
socket so that C{EMFILE} pauses accepting instead of spinning the accept
loop, L{TroubleLog} keeps a recurring trouble to a log event a while, and
L{raise_fd_limit} lifts the soft open-file limit to the hard one.
"""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING, Any

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

if TYPE_CHECKING:
    from kcoral.server.http.site import KcoralSite

#: A listening port that runs out of descriptors stops accepting for this
#: long (doubling while it goes on, up to the second figure).
ACCEPT_PAUSE_SECONDS = (0.05, 1.0)

#: Connections still waiting for their first head closed to free descriptors
#: when a port runs out of them.
ACCEPT_RELIEF_CONNECTIONS = 16

#: Seconds between two log events about the same kind of trouble (running
#: out of descriptors, closing connections to make room).
TROUBLE_LOG_INTERVAL = 10.0


class TroubleLog:
    """
    Counts a recurring kind of trouble so that it is logged at most once per
    L{TROUBLE_LOG_INTERVAL}, with how many times it happened meanwhile: a
    flood costs a few log lines, not one per connection.
    """

    def __init__(self, interval: float = TROUBLE_LOG_INTERVAL) -> None:
        self.interval = interval
        self.count = 0
        self.total = 0
        self._next_at: float | None = None

    def happened(self, clock: IReactorTime | None) -> tuple[int, int] | None:
        """
        Count one; when it is time to log, C{(count, total)}: how many since
        the last log event and since the start.
        """
        self.count += 1
        self.total += 1
        now = float(clock.seconds()) if clock is not None else 0.0
        if self._next_at is not None and now < self._next_at:
            return None
        self._next_at = now + self.interval
        count, self.count = self.count, 0
        return count, self.total


_http_log = Logger(namespace="kcoral.server.http")


class AcceptGuard:
    """
    Stands in for a listening port's socket (C{port.socket}) so that
    running out of descriptors (C{EMFILE} and friends) neither spins the
    accept loop nor floods the log: the port stops accepting for
    L{ACCEPT_PAUSE_SECONDS} (doubling while it goes on), the oldest
    connections still waiting for their first head are closed to free
    descriptors, and one C{accept_failed} event a L{TROUBLE_LOG_INTERVAL}
    says how often it happened.  Twisted's accept loop then sees
    C{EAGAIN}, as if no one were waiting.
    """

    _EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

    def __init__(self, port: Any, site: KcoralSite, reactor: IReactorTime) -> None:
        self._port = port
        self._socket = port.socket
        self._site = site
        self._reactor = reactor
        self._pause = ACCEPT_PAUSE_SECONDS[0]
        self._resume: IDelayedCall | None = None
        self.failures = TroubleLog()

    @classmethod
    def install(cls, port: Any, site: KcoralSite, reactor: IReactorTime) -> AcceptGuard | None:
        """Guard C{port}'s socket, where it has one (a TCP or UNIX port)."""
        sock = getattr(port, "socket", None)
        if sock is None or not hasattr(sock, "accept") or isinstance(sock, AcceptGuard):
            return None
        guard = cls(port, site, reactor)
        port.socket = guard
        return guard

    def accept(self) -> Any:
        try:
            accepted = self._socket.accept()
        except OSError as e:
            if e.errno not in self._EXHAUSTED:
                raise
            self._exhausted(e.errno)
            raise BlockingIOError(errno.EAGAIN, "accepting paused") from None
        self._pause = ACCEPT_PAUSE_SECONDS[0]
        return accepted

    def _exhausted(self, code: int) -> None:
        for _ in range(ACCEPT_RELIEF_CONNECTIONS):
            if not self._site.waiting() or not self._site.evict(everyone=True):
                break
        due = self.failures.happened(self._reactor)
        if due is not None:
            _http_log.warn(
                "cannot accept connections ({error}): paused {pause_s} s",
                kcoral_event="accept_failed",
                error=errno.errorcode.get(code, str(code)),
                count=due[0],
                total=due[1],
                pause_s=self._pause,
                open_connections=self._site.open_connections,
            )
        if self._resume is None or not self._resume.active():
            self._port.stopReading()
            self._resume = self._reactor.callLater(self._pause, self._resume_accepting)
            self._pause = min(self._pause * 2, ACCEPT_PAUSE_SECONDS[1])

    def _resume_accepting(self) -> None:
        self._resume = None
        if getattr(self._port, "connected", False):
            self._port.startReading()

    def stop(self) -> None:
        """Cancel a pending resumption (the port stops listening)."""
        if self._resume is not None and self._resume.active():
            self._resume.cancel()
        self._resume = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._socket, name)


def raise_fd_limit() -> tuple[int, int] | None:
    """
    Raise the soft limit on open files to the hard limit (systemd's soft
    default of 1,024 is a few hundred idle connections); returns the
    (old, new) soft limits, or C{None} where the platform has no such limit.
    """
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return (soft, soft)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return (soft, soft)
    return (soft, target)
