# -*- test-case-name: tests.unit.test_client_async -*-
"""
L{AsyncClient}: the KCoral client on treq.

Every method returns a L{Deferred}, so it can be awaited from C{async def}
code running on the reactor or chained with callbacks.  L{execute} applies
the protocol's CACHE_MISS rule (§5.5): attempt 1 sends no blobs, attempt 2
the blobs the server asked for, attempt 3 every blob; request bodies are
streamed from the program's own blob objects.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import attrs
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IReactorTime, IStreamClientEndpoint
from twisted.internet.task import Cooperator
from twisted.logger import Logger
from twisted.web.client import URI
from twisted.web.error import SchemeNotSupported
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgentEndpointFactory
from zope.interface import Interface, implementer

from kcoral.client.body import MultipartProducer, Part
from kcoral.client.download import ResponseReader
from kcoral.client.errors import ProtocolError, ResponseTooLarge, TransportError
from kcoral.client.install import warn_once
from kcoral.client.program import Program, execute_options, program_json
from kcoral.client.results import (
    ProgramResult,
    json_object,
    missing_blobs,
    program_result,
    response_body,
    server_error,
)

_T = TypeVar("_T")

#: The longest router affinity value echoed on a retry (protocol §2.2).
MAX_ROUTE_LENGTH = 512

#: The default cap on one response body: four times the server's default
#: C{--max-response-bytes} (256 MiB), so a server configured for large
#: results still fits, and a hostile one cannot fill the client's memory.
DEFAULT_MAX_RESPONSE_BYTES = 1 << 30


def check_response_cap(value: int | None) -> int | None:
    """C{value} when it is a positive integer or C{None}, else L{ValueError}."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError("max_response_bytes must be a positive integer or None")
    return value


@implementer(IAgentEndpointFactory)
class _Endpoints:
    """
    Twisted's standard HTTP and HTTPS endpoints, except that the TLS layer
    schedules its writes on the client's own reactor: left to its default,
    C{TLSMemoryBIOFactory} takes the global reactor as its clock, and a
    client on any other reactor stalls after the handshake's first flight.
    """

    def __init__(self, reactor: Any, connect_timeout: float | None) -> None:
        from twisted.web.client import BrowserLikePolicyForHTTPS

        self._reactor = reactor
        self._connect_timeout = connect_timeout
        self._policy = BrowserLikePolicyForHTTPS()

    def endpointForURI(self, uri: URI) -> IStreamClientEndpoint:
        from twisted.internet.endpoints import HostnameEndpoint

        if uri.scheme not in (b"http", b"https"):
            raise SchemeNotSupported(f"unsupported scheme: {uri.scheme!r}")
        kwargs: dict[str, Any] = {}
        if self._connect_timeout is not None:
            kwargs["timeout"] = self._connect_timeout
        endpoint = HostnameEndpoint(self._reactor, uri.host, uri.port, **kwargs)
        if uri.scheme == b"http":
            return endpoint
        creator = self._policy.creatorForNetloc(uri.host, uri.port)
        return _TLSEndpoint(endpoint, creator, self._reactor)


def _unwrap(protocol: Any) -> Any:
    return protocol.wrappedProtocol


@implementer(IStreamClientEndpoint)
class _TLSEndpoint:
    """C{wrapClientTLS} with an explicit clock for the TLS layer."""

    def __init__(self, wrapped: IStreamClientEndpoint, creator: Any, clock: Any) -> None:
        self._wrapped = wrapped
        self._creator = creator
        self._clock = clock

    def connect(self, factory: Any) -> Deferred[Any]:
        from twisted.protocols.tls import TLSMemoryBIOFactory

        tls = TLSMemoryBIOFactory(self._creator, True, factory, clock=self._clock)
        connected: Deferred[Any] = self._wrapped.connect(tls)
        return connected.addCallback(_unwrap)


class IProgress(Interface):
    """Follows one HTTP attempt: sending the body, waiting, receiving."""

    def sending(sent: int, total: int) -> None:
        """C{sent} of C{total} request bytes are written."""

    def waiting() -> None:
        """The request is sent; the server has not answered yet."""

    def receiving(received: int, total: int | None) -> None:
        """C{received} response bytes (of C{total}, when known) have arrived."""

    def done() -> None:
        """The attempt is over (whatever its outcome)."""


@implementer(IProgress)
class NoProgress:
    """Reports nothing."""

    def sending(self, sent: int, total: int) -> None:
        pass

    def waiting(self) -> None:
        pass

    def receiving(self, received: int, total: int | None) -> None:
        pass

    def done(self) -> None:
        pass


@attrs.frozen
class Attempt:
    """
    What one HTTP attempt of an execution sent and got: the number of blob
    parts, the HTTP code, a JSON body's C{status} (C{None} for multipart),
    the response's media type, its C{X-Request-ID} header and, for a
    CACHE_MISS, the digests the server reported missing.
    """

    number: int
    blobs: int
    code: int
    status: str | None
    media_type: str
    request_id: str | None
    missing_blobs: tuple[str, ...] = ()


def _deferred(coroutine: Coroutine[Any, Any, _T]) -> Deferred[_T]:
    return Deferred.fromCoroutine(coroutine)


async def _transport(action: Callable[[], Deferred[_T]]) -> _T:
    """Await a treq call, reporting any failure to get a response as L{TransportError}."""
    try:
        return await action()
    except CancelledError:
        raise
    except Exception as e:
        raise TransportError(f"{type(e).__name__}: {e}") from e


def _summary(media: str, data: bytes) -> tuple[str | None, tuple[str, ...]]:
    """A JSON body's C{status} and C{missing_blobs}, for observers."""
    if media != "application/json":
        return None, ()
    try:
        body = json_object(data)
    except ProtocolError:
        return None, ()
    status, missing = body.get("status"), body.get("missing_blobs")
    if not isinstance(missing, list) or not all(isinstance(d, str) for d in missing):
        missing = []
    return (status if isinstance(status, str) else None), tuple(missing)


def _header(response: Any, name: bytes) -> str | None:
    values = response.headers.getRawHeaders(name)
    return values[0].decode("latin-1") if values else None


class AsyncClient:
    """
    A client for one KCoral server, for code that runs on a Twisted reactor.

    @param base_url: the server address, such as C{http://127.0.0.1:8000}
        (a path prefix is kept: requests go to C{<base_url>/execute}).
    @param headers: extra HTTP headers for every request.
    @param token: a bearer token, sent as C{Authorization: Bearer TOKEN}
        with every request (servers started with C{--auth-token-file}).
    @param http_client: a treq C{HTTPClient}; by default one with its own
        persistent connection pool on C{reactor}.
    @param reactor: the reactor (the global one by default).
    @param connect_timeout_seconds: the connection timeout; responses
        themselves have no client-side timeout.
    @param progress: an L{IProgress} that follows each attempt.
    @param max_response_bytes: the largest response body accepted: a larger
        declared C{Content-Length} fails at once, and a body that grows past
        it is dropped when it does, both with L{ResponseTooLarge}; C{None}
        for no cap.  A body is held about twice while it is decoded, so this
        bounds the client's memory per response.
    @ivar attempt_observers: callables given each L{Attempt} as it ends; one
        that returns a L{Deferred} holds the execution (the next attempt, or
        the result) until it fires.
    """

    log = Logger()

    def __init__(
        self,
        base_url: str,
        *,
        headers: dict[str, str] | None = None,
        token: str | None = None,
        http_client: Any = None,
        reactor: Any = None,
        connect_timeout_seconds: float = 10.0,
        cooperator: Cooperator | None = None,
        progress: IProgress | None = None,
        max_response_bytes: int | None = DEFAULT_MAX_RESPONSE_BYTES,
    ) -> None:
        self._max_response_bytes = check_response_cap(max_response_bytes)
        if reactor is None:
            from twisted.internet import reactor as global_reactor

            reactor = global_reactor
        self._reactor: IReactorTime = reactor
        self._base_url = base_url.rstrip("/")
        self._headers = dict(headers or {})
        if token is not None:
            self._headers["Authorization"] = f"Bearer {token}"
        self._pool = None
        if http_client is None:
            from treq.client import HTTPClient
            from twisted.web.client import Agent, HTTPConnectionPool

            self._pool = HTTPConnectionPool(reactor, persistent=True)
            endpoints = _Endpoints(reactor, connect_timeout_seconds)
            agent = Agent.usingEndpointFactory(reactor, endpoints, pool=self._pool)
            http_client = HTTPClient(agent)
        self._http = http_client
        if cooperator is None:
            cooperator = Cooperator(scheduler=lambda work: reactor.callLater(0, work))
        self._cooperator = cooperator
        self.progress: IProgress = progress if progress is not None else NoProgress()
        self.attempt_observers: list[Callable[[Attempt], object]] = []

    @property
    def base_url(self) -> str:
        return self._base_url

    def _request_headers(self, extra: dict[str, str]) -> Headers:
        merged = {**self._headers, **extra}
        return Headers({name: [value] for name, value in merged.items()})

    async def _read(self, response: Any, sink: Callable[[bytes], None] | None = None) -> bytes:
        """
        Read the body: into C{sink} chunk by chunk when given (returning
        nothing), else whole.
        """
        total = response.length if isinstance(response.length, int) else None
        chunks: list[bytes] = []
        received = 0
        cap = self._max_response_bytes

        def collect(data: bytes) -> None:
            nonlocal received
            if cap is not None and (
                received + len(data) > cap or (total is not None and total > cap)
            ):
                # Raising here makes treq drop the connection: nothing more is read.
                raise ResponseTooLarge(cap, received + len(data), total)
            if sink is None:
                chunks.append(data)
            else:
                sink(data)
            received += len(data)
            self.progress.receiving(received, total)

        from treq import collect as treq_collect

        try:
            await treq_collect(response, collect)
        except (CancelledError, ProtocolError):
            raise
        except Exception as e:
            raise TransportError(f"{type(e).__name__}: {e}") from e
        return b"".join(chunks)

    def health(self) -> Deferred[dict[str, Any]]:
        """
        The server's C{/health} object, whose C{status} must be C{"ok"}.

        @raise KCoralError: on an HTTP status other than 200.
        @raise ProtocolError: on a malformed body or a status other than ok.
        @raise TransportError: when no response came back.
        """
        return _deferred(self._health())

    async def _health(self) -> dict[str, Any]:
        url = self._base_url + "/health"
        response = await _transport(
            lambda: self._http.request("GET", url, headers=self._request_headers({}))
        )
        data = await self._read(response)
        if response.code != 200:
            raise server_error(response.code, data)
        body = json_object(data)
        if body.get("status") != "ok":
            raise ProtocolError("health status is not ok")
        return body

    def target(self) -> Deferred[dict[str, str]]:
        """The GPU compilation target (C{{"arch": "sm_90a"}}); a CPU server has none."""
        return _deferred(self._target())

    async def _target(self) -> dict[str, str]:
        target = (await self._health()).get("target")
        if not isinstance(target, dict) or "arch" not in target:
            raise ProtocolError("the server reported no compilation target")
        return target

    def execute(
        self,
        program: Program,
        *,
        timeout_seconds: float | None = None,
        gpu_count: int | None = None,
        output_limit_bytes: int | None = None,
    ) -> Deferred[ProgramResult]:
        """
        Run C{program}; fire with its L{ProgramResult} (C{COMPLETED} or
        C{FAILED}: an instruction failure is data, not an exception).

        @raise KCoralError: on an HTTP status other than 200 (no retry).
        @raise ProtocolError: on a malformed response, or a CACHE_MISS after
            every blob was sent.
        @raise TransportError: when no response came back.
        """
        if not isinstance(program, Program):
            raise TypeError("execute expects a Program")
        options = execute_options(timeout_seconds, gpu_count, output_limit_bytes)
        return _deferred(self._execute(program, options))

    async def _execute(self, program: Program, options: dict[str, Any]) -> ProgramResult:
        program_part = Part("program", "application/json", program_json(program, options))
        blobs = program.blobs
        body, parts, route = await self._attempt(1, program_part, blobs, [], None)
        if body.get("status") == "CACHE_MISS":
            if parts:
                raise ProtocolError("CACHE_MISS response must not contain binary parts")
            wanted = missing_blobs(body, blobs)
            body, parts, route = await self._attempt(2, program_part, blobs, wanted, route)
            if body.get("status") == "CACHE_MISS":
                body, parts, route = await self._attempt(3, program_part, blobs, list(blobs), route)
            if body.get("status") == "CACHE_MISS":
                raise ProtocolError("server still reports CACHE_MISS after a complete blob resend")
        return program_result(body, parts)

    async def _attempt(
        self,
        number: int,
        program_part: Part,
        blobs: dict[str, bytes],
        include: list[str],
        route: str | None,
    ) -> tuple[dict[str, Any], dict[str, bytes], str | None]:
        wanted = set(include)
        parts = [program_part] + [
            Part(f"blob:{digest}", "application/octet-stream", data)
            for digest, data in blobs.items()
            if digest in wanted
        ]
        progress = self.progress

        def sent(count: int, total: int) -> None:
            progress.sending(count, total)
            if count == total:
                progress.waiting()

        producer = MultipartProducer(parts, cooperator=self._cooperator, on_progress=sent)
        extra = {"Content-Type": producer.content_type}
        if route:
            extra["X-KCoral-Node"] = route
        url = self._base_url + "/execute"
        try:
            response = await _transport(
                lambda: self._http.request(
                    "POST", url, headers=self._request_headers(extra), data=producer
                )
            )
            content_type = _header(response, b"content-type")
            media = (content_type or "").split(";", 1)[0].strip().lower()
            if response.code == 200 and media == "multipart/form-data":
                # Results with binary parts: decoded as they arrive.
                reader = ResponseReader(content_type)
                data = await self._read(response, reader.feed)
            else:
                reader = None
                data = await self._read(response)
        finally:
            self.progress.done()
        status, missing = _summary(media, data)
        attempt = Attempt(
            number,
            len(parts) - 1,
            response.code,
            status,
            media,
            _header(response, b"x-request-id"),
            missing,
        )
        await self._observe(attempt)
        if response.code != 200:
            raise server_error(response.code, data)
        if reader is not None:
            body, binary = reader.finish()
        else:
            body, binary = response_body(content_type, data)
        next_route = _header(response, b"x-kcoral-node")
        if next_route is not None and not 0 < len(next_route) <= MAX_ROUTE_LENGTH:
            next_route = None
        return body, binary, next_route

    async def _observe(self, attempt: Attempt) -> None:
        self.log.debug(
            "execute attempt {number}: {blobs} blobs, HTTP {code}, {status}",
            number=attempt.number,
            blobs=attempt.blobs,
            code=attempt.code,
            status=attempt.status,
            request_id=attempt.request_id,
        )
        for observer in list(self.attempt_observers):
            held = observer(attempt)
            if isinstance(held, Deferred):
                await held

    def function(
        self,
        *,
        timeout: float | None = None,
        output_limit_bytes: int | None = None,
        cpu_only: bool = False,
    ) -> Callable[[Callable[..., Any]], Any]:
        """
        Decorate a self-contained function; its C{.remote(...)} returns a
        Deferred of the value (see L{kcoral.client.remote.RemoteFunction}).
        """
        from kcoral.client.remote import RemoteFunction

        def decorate(fn: Callable[..., Any]) -> Any:
            return RemoteFunction(
                fn,
                client=self,
                timeout=timeout,
                output_limit_bytes=output_limit_bytes,
                cpu_only=cpu_only,
            )

        return decorate

    def close(self) -> Deferred[None]:
        """Close the idle persistent connections of the client's own pool."""
        if self._pool is None:
            return Deferred.fromCoroutine(_nothing())
        return self._pool.closeCachedConnections()


async def _nothing() -> None:
    return None


warn_once()


__all__ = ["AsyncClient", "Attempt", "IProgress", "NoProgress"]
