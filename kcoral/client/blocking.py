# -*- test-case-name: tests.unit.test_client_blocking -*-
"""
L{Client}: the blocking client of the 0.1.1 API, built on L{AsyncClient}.

crochet runs a reactor in a background thread (started by the first client
that needs it); each call hands its work to that thread and waits for the
result, so a client can be used repeatedly, from several threads at once,
and from a notebook.  An interrupted wait (Ctrl-C) cancels the request.

The reactor is a private instance, never the global one: a process that runs
the global reactor itself (a Twisted application, a trial test suite) can use
the blocking client too, and the client never starts or stops that reactor.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from twisted.internet.defer import Deferred

from kcoral.client.async_client import AsyncClient, Attempt, IProgress
from kcoral.client.program import Program
from kcoral.client.results import ProgramResult

if TYPE_CHECKING:
    from kcoral.client.remote import RemoteFunction

_P = ParamSpec("_P")
_R = TypeVar("_R")

_setup_lock = threading.Lock()
_in_reactor: Callable[..., Any] | None = None
#: The private reactor L{_runner} started (None until the first call).
_loop_reactor: Any = None


def _private_reactor() -> Any:
    """A new reactor of the platform's default kind, not installed globally."""
    try:
        from twisted.internet.epollreactor import EPollReactor
    except ImportError:  # pragma: no cover - not Linux
        from twisted.internet.selectreactor import SelectReactor

        return SelectReactor()
    return EPollReactor()


def _stop_when_main_thread_ends(stop: Callable[[], None]) -> threading.Thread:
    """
    A daemon thread that calls C{stop} once the main thread has finished, so
    the (non-daemon) reactor thread never keeps the interpreter alive.
    """

    def watch() -> None:
        threading.main_thread().join()
        stop()

    return threading.Thread(target=watch, name="kcoral-client-watchdog", daemon=True)


def _runner() -> Callable[..., Any]:
    """crochet's C{run_in_reactor} wrapper, starting the private reactor on first use."""
    global _in_reactor, _loop_reactor
    with _setup_lock:
        if _in_reactor is None:
            import atexit

            from crochet import EventLoop  # type: ignore[attr-defined]  # public, not in __all__

            reactor = _private_reactor()

            def stop() -> None:
                if reactor.running:
                    reactor.callFromThread(reactor.stop)

            loop = EventLoop(
                lambda: reactor,
                atexit.register,
                watchdog_thread=_stop_when_main_thread_ends(stop),
                # This reactor spawns no processes, so it has none to reap.
                reapAllProcesses=lambda: None,
            )
            loop.setup()
            _loop_reactor = reactor

            def call(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
                return function(*args, **kwargs)

            _in_reactor = loop.run_in_reactor(call)
        return _in_reactor


class Client:
    """
    A blocking client for one KCoral server (the 0.1.1 C{Client} API).

    Construction contacts nothing.  Use it as a context manager, or call
    L{close}, to release its connections.

    @param base_url: the server address, such as C{http://127.0.0.1:8000}.
    @param headers: extra HTTP headers for every request.
    @param token: a bearer token, sent as C{Authorization: Bearer TOKEN}
        with every request (servers started with C{--auth-token-file}).
    @param connect_timeout_seconds: the connection timeout; a response may
        take as long as the program runs.
    @param progress: an L{IProgress} (called in the reactor thread).
    """

    def __init__(
        self,
        base_url: str,
        *,
        headers: dict[str, str] | None = None,
        token: str | None = None,
        connect_timeout_seconds: float = 10.0,
        progress: IProgress | None = None,
    ) -> None:
        self._base_url = base_url
        self._headers = dict(headers or {})
        if token is not None:
            self._headers["Authorization"] = f"Bearer {token}"
        self._connect_timeout = connect_timeout_seconds
        self._progress = progress
        self._client: AsyncClient | None = None
        self.attempt_observers: list[Callable[[Attempt], object]] = []

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *args: Any) -> None:
        self.close()

    def _async(self) -> AsyncClient:
        # Runs in the reactor thread, so the pool is built there.
        if self._client is None:
            self._client = AsyncClient(
                self._base_url,
                headers=self._headers,
                connect_timeout_seconds=self._connect_timeout,
                progress=self._progress,
                reactor=_loop_reactor,
            )
            self._client.attempt_observers = self.attempt_observers
        return self._client

    def _wait(self, call: Callable[[AsyncClient], Deferred[_R]]) -> _R:
        eventual = _runner()(lambda: call(self._async()))
        try:
            return eventual.wait(None)  # type: ignore[no-any-return]
        except KeyboardInterrupt:
            eventual.cancel()
            raise

    def health(self) -> dict[str, Any]:
        """The server's C{/health} object (see L{AsyncClient.health})."""
        return self._wait(lambda c: c.health())

    def target(self) -> dict[str, str]:
        """The GPU compilation target; a CPU server has none (L{ProtocolError})."""
        return self._wait(lambda c: c.target())

    def execute(
        self,
        program: Program,
        *,
        timeout_seconds: float | None = None,
        gpu_count: int | None = None,
        output_limit_bytes: int | None = None,
    ) -> ProgramResult:
        """
        Run C{program} and return its L{ProgramResult}; see
        L{AsyncClient.execute} for the retry rule and the exceptions.
        """
        if not isinstance(program, Program):
            raise TypeError("execute expects a Program")
        return self._wait(
            lambda c: c.execute(
                program,
                timeout_seconds=timeout_seconds,
                gpu_count=gpu_count,
                output_limit_bytes=output_limit_bytes,
            )
        )

    def function(
        self,
        *,
        timeout: float | None = None,
        output_limit_bytes: int | None = None,
        cpu_only: bool = False,
    ) -> Callable[[Callable[_P, _R]], RemoteFunction[_P, _R]]:
        """
        Decorate a self-contained function so that C{.remote(...)} runs it on
        the server (see L{kcoral.client.remote.RemoteFunction}).
        """
        from kcoral.client.remote import RemoteFunction

        def decorate(fn: Callable[_P, _R]) -> RemoteFunction[_P, _R]:
            return RemoteFunction(
                fn,
                client=self,
                timeout=timeout,
                output_limit_bytes=output_limit_bytes,
                cpu_only=cpu_only,
            )

        return decorate

    def close(self) -> None:
        """Close idle connections; the client can still be used afterwards."""
        if self._client is not None:
            self._wait(lambda c: c.close())


__all__ = ["Client"]
