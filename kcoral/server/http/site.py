# -*- test-case-name: tests.unit.test_http -*-
"""
L{KcoralSite}: the HTTP boundary, everything between the listening socket
and the Klein resource.

Its connections are L{kcoral.server.http.channel.KcoralChannel}s (head and
body deadlines, lingering close) and its requests
L{kcoral.server.http.request.LimitedRequest}s (body limits, streamed
multipart bodies, JSON error bodies).  The site caps the number of open
connections, in all (kept below the open-file limit) and per client
address.  At a cap, the oldest connection that has not sent a whole request
head yet (then the oldest idle kept-alive one) is closed to make room, so a
flood of slow connections cannot keep clients that send their requests out;
only when every connection is in a request is a new one answered 503.  It
counts request body bytes as they arrive against C{max_bytes_in_flight},
and against C{max_bytes_per_client} per client address.  Refusals are
logged by L{kcoral.server.http.refusals}.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any
from typing import Protocol as Structural

from twisted.internet.abstract import FileDescriptor
from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IAddress, IListeningPort, IReactorTCP
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.protocols.policies import ProtocolWrapper
from twisted.web.resource import IResource
from twisted.web.server import Site

from kcoral.config import ServerConfig
from kcoral.ipc.uploads import StreamedBody
from kcoral.server.http.accept import TroubleLog
from kcoral.server.http.auth import TokenGuard, Tokens
from kcoral.server.http.channel import (
    DEFAULT_BODY_STALL_TIMEOUT,
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    KcoralChannel,
)
from kcoral.server.http.component import address_host
from kcoral.server.http.refusals import log_refusal, peer_host, raw_error_response
from kcoral.server.http.request import LimitedRequest
from kcoral.wire.errors import choose_request_id

#: Open connections served at once; more are answered 503 and closed.
DEFAULT_MAX_CONNECTIONS = 4096

#: Open connections one client address may have at once.
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 1024

#: Descriptors kept free of connections below the open-file limit, for the
#: workers' pipes, memfds, logs and cache files: at least the first, or
#: the limit divided by the second.
FD_HEADROOM = 256
FD_HEADROOM_DIVISOR = 4

#: Request body bytes one client address may hold at once.
DEFAULT_MAX_BYTES_PER_CLIENT = 512 << 20

_http_log = Logger(namespace="kcoral.server.http")


def send_now(transport: object) -> None:
    """
    Write what a connection holds for its peer now, as the reactor would on
    its next turn once the socket is writable (L{FileDescriptor.doWrite}).

    Twisted only buffers a write; the bytes leave when the loop comes round.
    A request that has written its whole response still has work of its
    own to do in that turn (its access-log line, its cleanup, the callbacks
    waiting on its end), and all of it would run before the client's bytes
    are sent.  Under TLS (a L{ProtocolWrapper}, as any wrapper that writes
    straight through) the bytes are already encrypted into the TCP
    connection below, which is written.  Nothing is done for a connection
    that is closing, whose producer is paused (the write would resume it,
    here, in the middle of the request's end), or that is no socket at all
    (a test's transport); what does not fit, or an error, stays for the
    reactor, which has the connection registered for writing still.
    """
    while isinstance(transport, ProtocolWrapper):
        transport = transport.transport
    if not isinstance(transport, FileDescriptor):
        return
    if (
        not transport.connected
        or transport.disconnecting
        or transport._writeDisconnecting
        or not (transport._tempDataLen or len(transport.dataBuffer) > transport.offset)
    ):
        return
    if transport.producer is not None and (
        not transport.streamingProducer or transport.producerPaused
    ):
        return
    transport.doWrite()


class HeadGuard(Structural):
    """
    What the site asks about each request head before its body is read
    (L{kcoral.server.http.auth.TokenGuard}, the gateway's C{PoolGuard}).
    """

    def refuses(self, path: bytes, authorization: bytes | None) -> bool:
        """Whether a request for C{path} with this C{Authorization} value is refused."""
        ...


class _Refusal(Protocol):
    """Answers 503 and closes: the server already has too many connections."""

    def connectionMade(self) -> None:
        assert self.transport is not None
        request_id = choose_request_id(None)
        self.transport.write(raw_error_response(503, "too many open connections", request_id))
        log_refusal("connection_cap", client=peer_host(self.transport), request_id=request_id)
        self.transport.loseConnection()


class KcoralSite(Site):
    """
    A L{Site} of L{KcoralChannel}s and L{LimitedRequest}s, with form parsing
    disabled and at most C{max_connections} connections at once.
    """

    protocol = KcoralChannel  # type: ignore[assignment]
    requestFactory = LimitedRequest

    def __init__(
        self,
        resource: IResource,
        *,
        max_request_bytes: int,
        header_timeout: float = DEFAULT_HEADER_TIMEOUT,
        body_timeout: float = DEFAULT_BODY_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_connections_per_client: int = 0,
        first_header_timeout: float = 0.0,
        max_bytes_in_flight: int = 0,
        max_bytes_per_client: int = 0,
        body_stall_timeout: float = DEFAULT_BODY_STALL_TIMEOUT,
        stream_bodies: bool = True,
        **kwargs: Any,
    ) -> None:
        try:
            super().__init__(resource, parsePOSTFormSubmission=False, **kwargs)
        except TypeError:  # older Twisted: the request ignores form bodies anyway
            super().__init__(resource, **kwargs)
        self.max_request_bytes = max_request_bytes
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.max_connections = max_connections
        self.max_connections_per_client = max_connections_per_client
        self.first_header_timeout = first_header_timeout
        self.open_connections = 0
        #: Open connections by client address.
        self.client_connections: dict[str, int] = {}
        #: Connections not in a request, oldest first (dicts keep their
        #: order), in all and by client address, in the order they are
        #: closed to make room: new ones that sent part of a head (from
        #: their first byte), new ones that sent nothing yet, and idle
        #: kept-alive ones.
        self._trickling: dict[KcoralChannel, None] = {}
        self._fresh: dict[KcoralChannel, None] = {}
        self._idle: dict[KcoralChannel, None] = {}
        self._trickling_of: dict[str | None, dict[KcoralChannel, None]] = {}
        self._fresh_of: dict[str | None, dict[KcoralChannel, None]] = {}
        self._idle_of: dict[str | None, dict[KcoralChannel, None]] = {}
        #: Connections closed to make room for new ones.
        self.evicted_connections = 0
        self._evictions_logged = TroubleLog()
        #: The server is stopping (L{drain}): every answer closes its connection.
        self.draining = False
        self.refused_connections = 0
        self.max_bytes_in_flight = max_bytes_in_flight
        self.bytes_in_flight = 0
        #: Request body bytes held by each client address (only those
        #: holding some are keys).
        self.max_bytes_per_client = max_bytes_per_client
        self.client_bytes: dict[str, int] = {}
        self.body_stall_timeout = body_stall_timeout
        #: The token guard in front of the resource (L{kcoral.server.http.auth}),
        #: asked about each request head; C{None}: the server has no tokens.
        self.guard: HeadGuard | None = None
        self.displayTracebacks = False
        #: Makes the L{StreamedBody} a multipart request body streams into,
        #: or C{None}: bodies are spooled by Twisted and parsed afterwards.
        self.streamed_body: Callable[[str | None], StreamedBody | None] | None = (
            partial(StreamedBody.for_content_type, max_bytes=max_request_bytes)
            if stream_bodies
            else None
        )

    def log(self, request: Any) -> None:
        """
        Called as a request finishes: its response leaves first
        (L{send_now}), then its access-log line is written
        (L{access_log}).
        """
        send_now(getattr(getattr(request, "channel", None), "transport", None))
        self.access_log(request)

    def access_log(self, request: Any) -> None:
        """Write C{request}'s access-log line (Twisted's)."""
        Site.log(self, request)

    def drain(self) -> None:
        """
        The server stopped listening: from now on every answer, a 503 for a
        program that arrives on a kept-alive connection included, closes its
        connection (C{Connection: close}).  A proxy then opens a new
        connection for its next request, which is refused and goes to
        another node, instead of sending it on a connection the exiting
        process would drop unanswered.
        """
        self.draining = True

    def admits_bytes(
        self, size: int, peer: str | None = None, held: int = 0, peer_held: int = 0
    ) -> bool:
        """
        Whether C{size} more bytes of request body fit, for a request that
        already holds C{held} (C{peer_held} of them counted for its client
        address C{peer}): under C{max_bytes_in_flight} and the address's
        C{max_bytes_per_client}.  A request alone (of the server, or of its
        address) always fits, so no body within the size limit is refused
        forever.
        """
        cap = self.max_bytes_in_flight
        if cap and self.bytes_in_flight + size > cap and self.bytes_in_flight > held:
            return False
        per_client = self.max_bytes_per_client
        if per_client and peer is not None:
            have = self.client_bytes.get(peer, 0)
            if have + size > per_client and have > peer_held:
                return False
        return True

    def reserve_bytes(
        self, size: int, held: int, *, peer: str | None = None, peer_held: int = 0
    ) -> bool:
        """
        Take C{size} more bytes of request body in flight (L{admits_bytes});
        C{False} when they do not fit.
        """
        if not self.admits_bytes(size, peer, held, peer_held):
            return False
        self.bytes_in_flight += size
        if peer is not None:
            self.client_bytes[peer] = self.client_bytes.get(peer, 0) + size
        return True

    def release_bytes(self, size: int, peer: str | None = None, peer_size: int = 0) -> None:
        """Give back C{size} bytes in flight, C{peer_size} of them C{peer}'s."""
        self.bytes_in_flight -= size
        if peer is not None and peer_size:
            left = self.client_bytes.get(peer, 0) - peer_size
            if left > 0:
                self.client_bytes[peer] = left
            else:
                self.client_bytes.pop(peer, None)

    # -- connections ----------------------------------------------------------

    def fit_to_fd_limit(self, limit: int | None) -> int:
        """
        Keep C{max_connections} below the open-file C{limit} (the soft one),
        leaving L{FD_HEADROOM} (or a L{FD_HEADROOM_DIVISOR}th of it) for
        everything else: a flood then meets the connection cap, where the
        server chooses whom to close, rather than C{EMFILE}.  Returns the
        cap (C{0}: none).
        """
        if limit is None or limit <= 0:
            return self.max_connections
        fit = max(1, limit - max(FD_HEADROOM, limit // FD_HEADROOM_DIVISOR))
        if not self.max_connections or self.max_connections > fit:
            self.max_connections = fit
        return self.max_connections

    def connection_opened(self, channel: KcoralChannel) -> None:
        """Count a new connection; it waits for its first head."""
        self.open_connections += 1
        host = channel.client_host
        if host is not None:
            self.client_connections[host] = self.client_connections.get(host, 0) + 1
        self._fresh[channel] = None
        self._fresh_of.setdefault(host, {})[channel] = None

    def connection_trickling(self, channel: KcoralChannel) -> None:
        """New C{channel} sent the first bytes of its head, not all of it."""
        self._forget(channel)
        self._trickling[channel] = None
        self._trickling_of.setdefault(channel.client_host, {})[channel] = None

    def waiting(self) -> int:
        """Connections that have sent no whole request head yet."""
        return len(self._trickling) + len(self._fresh)

    def connection_busy(self, channel: KcoralChannel) -> None:
        """C{channel} has a whole request head: it is in a request."""
        self._forget(channel)

    def connection_idle(self, channel: KcoralChannel) -> None:
        """C{channel} answered its requests and waits for the next, kept alive."""
        self._forget(channel)
        self._idle[channel] = None
        self._idle_of.setdefault(channel.client_host, {})[channel] = None

    def connection_closed(self, channel: KcoralChannel) -> None:
        """Stop counting C{channel} (closed, or being closed to make room)."""
        if not channel._counted:
            return
        channel._counted = False
        self._forget(channel)
        self.open_connections -= 1
        host = channel.client_host
        if host is not None:
            left = self.client_connections.get(host, 0) - 1
            if left > 0:
                self.client_connections[host] = left
            else:
                self.client_connections.pop(host, None)

    def _forget(self, channel: KcoralChannel) -> None:
        host = channel.client_host
        for everyone, of in (
            (self._trickling, self._trickling_of),
            (self._fresh, self._fresh_of),
            (self._idle, self._idle_of),
        ):
            if everyone.pop(channel, 0) is None:
                mine = of.get(host)
                if mine is not None:
                    mine.pop(channel, None)
                    if not mine:
                        del of[host]

    def evict(self, host: str | None = None, *, everyone: bool = False) -> bool:
        """
        Close the connection of client address C{host} (or with
        C{everyone}, of any address) that has waited longest for its first
        request head, one that began sending it first (a trickler: a client
        sends its head at once, and it is read when the connection is
        accepted), else the one idle longest; C{False} when there is none
        to close.
        """
        if everyone:
            pools = (self._trickling, self._fresh, self._idle)
        else:
            pools = (
                self._trickling_of.get(host) or {},
                self._fresh_of.get(host) or {},
                self._idle_of.get(host) or {},
            )
        for pool in pools:
            if pool:
                victim = next(iter(pool))
                self.connection_closed(victim)
                self.evicted_connections += 1
                due = self._evictions_logged.happened(self.reactor)
                if due is not None:
                    _http_log.warn(
                        "closed {count} waiting connection(s) to make room",
                        kcoral_event="connections_evicted",
                        count=due[0],
                        total=due[1],
                        open_connections=self.open_connections,
                    )
                victim.evict()
                return True
        return False

    def buildProtocol(self, addr: IAddress | None) -> Any:
        host = address_host(addr)
        per_client = self.max_connections_per_client
        full = (
            per_client
            and host is not None
            and self.client_connections.get(host, 0) >= per_client
            and not self.evict(host)
        ) or (
            self.max_connections
            and self.open_connections >= self.max_connections
            and not self.evict(everyone=True)
        )
        if full:
            self.refused_connections += 1
            refusal = _Refusal()
            refusal.factory = self
            return refusal
        return super().buildProtocol(addr)


def make_site(
    resource: IResource, config: ServerConfig, tokens: Tokens | None = None, **kwargs: Any
) -> KcoralSite:
    """
    The site serving C{resource} under C{config}'s HTTP limits, behind a
    L{kcoral.server.http.auth.TokenGuard} when C{tokens} is given.
    """
    guard = None
    if tokens is not None:
        resource = guard = TokenGuard(resource, tokens, public_metrics=config.public_metrics)
    site = KcoralSite(
        resource,
        max_request_bytes=config.max_request_bytes,
        header_timeout=config.header_timeout_seconds,
        body_timeout=config.body_timeout_seconds,
        max_connections=config.max_connections,
        max_connections_per_client=config.max_connections_per_client,
        first_header_timeout=config.first_header_timeout_seconds,
        max_bytes_in_flight=config.max_bytes_in_flight,
        max_bytes_per_client=config.max_bytes_per_client,
        body_stall_timeout=config.body_stall_seconds,
        **kwargs,
    )
    site.guard = guard
    return site


async def listen_all(
    reactor: IReactorTCP, descriptions: Sequence[str], site: Site
) -> list[IListeningPort]:
    """
    Listen on every endpoint description; if one fails, stop those already
    listening and raise.  C{reactor} also provides
    L{twisted.internet.interfaces.IReactorUNIX} and C{IReactorSSL} for
    descriptions of those endpoints.
    """
    ports: list[IListeningPort] = []
    try:
        for description in descriptions:
            ports.append(await serverFromString(reactor, description).listen(site))
    except BaseException:
        for port in ports:
            stopped = port.stopListening()
            if stopped is not None:
                await stopped
        raise
    return ports


def port_hosts(ports: Sequence[IListeningPort]) -> list[str]:
    """The IP addresses C{ports} are bound to (UNIX sockets have none)."""
    hosts = []
    for port in ports:
        host = getattr(port.getHost(), "host", None)
        if isinstance(host, str):
            hosts.append(host)
    return hosts
