"""
What the worker side of the server uses of the reactor, as one type: the
clock (L{IReactorTime}), process spawning (L{IReactorProcess}) and the
adoption of a template's socket (L{IReactorSocket}).  The global reactor
and L{kcoral.testing.fakes.ProcessReactor} provide all three.  Also
L{RunBlocking}, how the server's parts run blocking calls in its thread pool,
and L{shielded}, a wait on such a call (or a program) that may be given up
without stopping what it waits for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from socket import AddressFamily
from typing import Any, ParamSpec, Protocol, TypeVar

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import (
    IDelayedCall,
    IProcessProtocol,
    IProcessTransport,
    IProtocolFactory,
)
from twisted.python.failure import Failure

_P = ParamSpec("_P")
_T = TypeVar("_T")


class RunBlocking(Protocol):
    """
    Runs a blocking callable in the server's I/O thread pool
    (C{deferToThreadPool}; at once in tests): the Deferred fires with its
    result or fails with its exception.
    """

    def __call__(
        self, f: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs
    ) -> Deferred[_T]: ...


def shielded(d: Deferred[_T], orphaned: Callable[[Failure], None] | None = None) -> Deferred[_T]:
    """
    A copy of C{d} whose cancellation does not reach C{d}: the wait is
    given up, the work goes on.  Until the copy is cancelled it takes
    C{d}'s result; after that C{d} keeps its result, for whoever cleans up
    after the work, and a failure goes to C{orphaned} when there is one.
    """
    copy: Deferred[_T] = Deferred()

    def forward(result: _T | Failure) -> _T | Failure | None:
        if copy.called:
            return result
        if isinstance(result, Failure):
            copy.errback(result)
        else:
            copy.callback(result)
        return None

    d.addBoth(forward)
    if orphaned is not None:
        d.addErrback(orphaned)
    return copy


class Clock(Protocol):
    """The part of L{IReactorTime} the pool's timers use (a L{task.Clock} in tests)."""

    def seconds(self) -> float: ...

    def callLater(
        self, delay: float, callable: Callable[..., object], *args: object, **kwargs: object
    ) -> IDelayedCall: ...


class WorkerReactor(Clock, Protocol):
    """L{IReactorTime}, L{IReactorProcess} and L{IReactorSocket} in one."""

    def spawnProcess(
        self,
        processProtocol: IProcessProtocol,
        executable: bytes | str,
        args: Sequence[bytes | str],
        env: Mapping[Any, Any] | None = None,
        path: bytes | str | None = None,
        uid: int | None = None,
        gid: int | None = None,
        usePTY: bool = False,
        childFDs: Mapping[int, int | str] | None = None,
    ) -> IProcessTransport: ...

    def adoptStreamConnection(
        self, fileDescriptor: int, addressFamily: AddressFamily, factory: IProtocolFactory
    ) -> None: ...
