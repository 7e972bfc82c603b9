# -*- test-case-name: tests.unit.test_client_blocking -*-
"""
L{Client}: the blocking client of the 0.1.1 API, built on L{AsyncClient}.

crochet runs a reactor in a background thread (started by the first client
that needs it); each call hands its work to that thread and waits for the
result, so a client can be used repeatedly, from several threads at once,
and from a notebook.  An interrupted wait (Ctrl-C) cancels the request.

Which reactor (L{_choose_reactor}, decided once, at the first call):

 - No global reactor installed yet (a script, a notebook, the C{kcoral}
   CLI): the client installs the platform's default reactor as Twisted's
   global reactor and crochet runs it in its thread.  Every Twisted default
   that reaches for C{twisted.internet.reactor} (the TLS layer's write
   clock, the default cooperator, a C{TimeoutMixin}) then finds the one
   running reactor: nothing can schedule work on a reactor that never runs.
 - The global reactor is installed and running (a Twisted application that
   runs it in another thread): calls are handed to it; nothing else starts.
   A blocking call on the reactor's own thread raises C{RuntimeError} (use
   L{AsyncClient} there).
 - The global reactor is installed but not running (a process that will run
   it itself later, or a trial suite between tests): the client runs a
   private reactor in crochet's thread and leaves the global one alone.
   L{AsyncClient} hands that reactor to everything it builds, TLS's clock
   included, so the client does not depend on the idle global reactor.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from twisted.internet.defer import Deferred

from kcoral.client.async_client import (
    DEFAULT_MAX_RESPONSE_BYTES,
    AsyncClient,
    Attempt,
    IProgress,
    check_response_cap,
)
from kcoral.client.program import Program
from kcoral.client.results import ProgramResult

if TYPE_CHECKING:
    from kcoral.client.remote import RemoteFunction

_P = ParamSpec("_P")
_R = TypeVar("_R")

_setup_lock = threading.Lock()
_in_reactor: Callable[..., Any] | None = None
#: The reactor the blocking clients run on (None until the first call).
_loop_reactor: Any = None
#: Whether that reactor is Twisted's global one (not a private reactor).
_loop_is_global = True


def _private_reactor() -> Any:
    """A new reactor of the platform's default kind, not installed globally."""
    try:
        from twisted.internet.epollreactor import EPollReactor
    except ImportError:  # pragma: no cover - not Linux
        from twisted.internet.selectreactor import SelectReactor

        return SelectReactor()
    return EPollReactor()


def _choose_reactor() -> tuple[Any, bool, bool]:
    """
    C{(reactor, run_it, is_global)}: the reactor the blocking clients use,
    whether they must run it themselves, and whether it is Twisted's global
    reactor (see the module docstring).
    """
    if "twisted.internet.reactor" not in sys.modules:
        from twisted.internet import default
        from twisted.internet.error import ReactorAlreadyInstalledError

        try:
            default.install()
        except ReactorAlreadyInstalledError:
            pass  # another thread installed one meanwhile: judged below
        else:
            from twisted.internet import reactor as installed

            return installed, True, True
    from twisted.internet import reactor as existing

    if existing.running:
        return existing, False, True
    return _private_reactor(), True, False


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
    """crochet's C{run_in_reactor} wrapper, starting the reactor on first use."""
    global _in_reactor, _loop_reactor, _loop_is_global
    with _setup_lock:
        if _in_reactor is None:
            import atexit

            from crochet import EventLoop  # type: ignore[attr-defined]  # public, not in __all__

            reactor, run_it, is_global = _choose_reactor()

            def stop() -> None:
                if reactor.running:
                    reactor.callFromThread(reactor.stop)

            reap: Callable[[], None] = lambda: None  # noqa: E731
            if is_global:
                # Processes spawned on the global reactor are reaped as
                # crochet reaps them (the thread has no SIGCHLD handler).
                from twisted.internet.process import reapAllProcesses

                reap = reapAllProcesses
            loop = EventLoop(
                lambda: reactor,
                atexit.register,
                watchdog_thread=_stop_when_main_thread_ends(stop),
                reapAllProcesses=reap,
            )
            if run_it:
                loop.setup()
            else:
                loop.no_setup()
            _loop_reactor, _loop_is_global = reactor, is_global

            def call(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
                return function(*args, **kwargs)

            _in_reactor = loop.run_in_reactor(call)
        return _in_reactor


def _forget_stopped_io_thread() -> None:
    """
    With a private reactor, clear the mark that a global reactor which ran in
    this thread and stopped (C{react()} earlier in a script, a trial test)
    left on it: crochet refuses to wait in the thread Twisted calls the I/O
    thread, and the only reactor running now is the client's own.
    """
    from twisted.python import threadable

    if not _loop_is_global and threadable.isInIOThread():
        threadable.ioThread = None


def client_reactor() -> Any:
    """
    The reactor the blocking clients run on, started if needed: a clock for
    anything that must tick beside them (the CLI's progress line).
    """
    _runner()
    return _loop_reactor


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
    @param max_response_bytes: the largest response body accepted (see
        L{AsyncClient}); C{None} for no cap.
    """

    def __init__(
        self,
        base_url: str,
        *,
        headers: dict[str, str] | None = None,
        token: str | None = None,
        connect_timeout_seconds: float = 10.0,
        progress: IProgress | None = None,
        max_response_bytes: int | None = DEFAULT_MAX_RESPONSE_BYTES,
    ) -> None:
        self._base_url = base_url
        self._max_response_bytes = check_response_cap(max_response_bytes)
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
                max_response_bytes=self._max_response_bytes,
            )
            self._client.attempt_observers = self.attempt_observers
        return self._client

    def _wait(self, call: Callable[[AsyncClient], Deferred[_R]]) -> _R:
        eventual = _runner()(lambda: call(self._async()))
        _forget_stopped_io_thread()
        try:
            return eventual.wait(None)  # type: ignore[no-any-return]
        except KeyboardInterrupt:
            eventual.cancel()
            try:
                # Collect the cancellation, so crochet has no unhandled error to log.
                eventual.wait(5.0)
            except BaseException:
                pass
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
