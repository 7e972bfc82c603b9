# -*- test-case-name: tests.unit.test_natsbridge -*-
"""
nats-py (asyncio) beside a Twisted reactor, without switching the reactor.

L{NatsBridge} runs one nats-py client on an asyncio event loop.  Under
Twisted's asyncio reactor (C{twisted.internet.asyncioreactor}, which
C{kcoral gateway} installs) that is the reactor's own loop: the client
runs on the reactor thread, and a call, its answer and every message
watched cost no thread hop.  Under any other reactor the bridge runs a
loop in a thread of its own, and answers come back through
C{reactor.callFromThread}.  Either way, reactor code hands it coroutine
functions (C{call}) and gets Deferreds back, fired on the reactor thread;
long-running loops (KV watches, pull subscriptions) run with C{spawn} and
deliver what they see with C{deliver}, which also lands on the reactor
thread.  Cancelling a Deferred cancels its
asyncio task.  Every error of the loop's side arrives as a failure of the
Deferred concerned, or as a logged event: nothing escapes silently.

Used by the gateway (L{kcoral.gateway.service}) and by a node that joins a
pool (L{kcoral.server.join}).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js import JetStreamContext

__all__ = [
    "NatsBridge",
    "NatsCredentials",
    "NotConnected",
    "bounded",
    "ensure_consumer",
    "install_asyncio_reactor",
    "load_credentials",
    "write_now",
]

_T = TypeVar("_T")

#: What C{call} and C{spawn} run: a coroutine function of the client and
#: its JetStream context.
NatsWork = Callable[["Client", "JetStreamContext"], Awaitable[_T]]

#: Seconds between two log lines of the same connection error.
ERROR_LOG_INTERVAL = 60.0

#: Whether tasks can begin at once, in the call that makes them (Python 3.12).
EAGER_TASKS = sys.version_info >= (3, 12)

#: The JWT marker of a NATS C{.creds} file.
CREDS_MARKER = "-----BEGIN NATS USER JWT-----"


class NotConnected(Exception):
    """The bridge has no NATS connection (not started, or stopped)."""


@attrs.frozen(kw_only=True)
class NatsCredentials:
    """
    How to authenticate to nats-server: a user and password (static
    C{accounts} in the server's configuration), or a C{.creds} file
    (decentralised JWT auth), or nothing.
    """

    user: str | None = None
    password: str | None = None
    creds_file: str | None = None

    def connect_options(self) -> dict[str, Any]:
        """The keyword arguments of C{nats.connect} these credentials need."""
        if self.creds_file is not None:
            return {"user_credentials": self.creds_file}
        if self.user is not None:
            return {"user": self.user, "password": self.password or ""}
        return {}


def load_credentials(path: str) -> NatsCredentials:
    """
    Read a credentials file: a NATS C{.creds} file (JWT and nkey seed), or
    a JSON object C{{"user": ..., "password": ...}}.

    @raise ValueError: the file is neither.
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if CREDS_MARKER in text:
        return NatsCredentials(creds_file=path)
    try:
        data = json.loads(text)
    except ValueError:
        raise ValueError(f"{path}: not a NATS .creds file nor a JSON user/password") from None
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("user"), str)
        or not isinstance(data.get("password"), str)
    ):
        raise ValueError(f'{path}: expected {{"user": "...", "password": "..."}}')
    return NatsCredentials(user=data["user"], password=data["password"])


@attrs.define(eq=False)
class NatsBridge:
    """
    One NATS connection on an asyncio loop in its own thread.

    @ivar servers: the NATS URLs (C{nats://host:port}, C{tls://...}).
    @ivar credentials: how to authenticate.
    @ivar tls: a client TLS context for C{tls://} servers, or C{None}.
    @ivar name: the connection name nats-server shows.
    """

    _reactor: Any
    servers: list[str]
    credentials: NatsCredentials = attrs.field(factory=NatsCredentials)
    tls: ssl.SSLContext | None = None
    name: str = "kcoral"
    #: Seconds between reconnect attempts after the connection is lost.
    reconnect_wait: float = 0.5
    #: Seconds a connect attempt may take.
    connect_timeout: float = 2.0
    #: Called on the reactor thread with C{True} / C{False} as the
    #: connection comes and goes.
    on_connection: Callable[[bool], None] | None = None
    #: The prefix of the connection's reply subjects (nats-py's
    #: C{inbox_prefix}); a node uses its own (L{kcoral.gateway.jobs.node_inbox}),
    #: the only one its NATS user may subscribe to.
    inbox_prefix: str | None = None

    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    #: The loop is the reactor's own (no thread of the bridge's).
    inline: bool = False
    _client: Client | None = None
    _js: JetStreamContext | None = None
    #: Tasks of L{begin} not done yet.
    _tasks: set[asyncio.Future[None]] = attrs.field(factory=set)
    connected: bool = False
    _stopping: bool = False

    log = Logger()

    # -- life ---------------------------------------------------------------

    def start(self) -> Deferred[None]:
        """
        Start the loop's thread and connect; fires once connected (and
        keeps reconnecting in the background after that), or fails when
        the first connect fails.
        """
        if self._thread is not None or self._loop is not None:
            raise RuntimeError("bridge already started")
        shared = reactor_loop(self._reactor)
        if shared is not None:
            self._loop, self.inline = shared, True
            return self._submit(lambda: self._connect())
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(
            target=self._run_loop, args=(loop,), name=f"nats-{self.name}", daemon=True
        )
        self._thread.start()
        return self._submit(lambda: self._connect())

    def _run_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            try:
                pending = asyncio.all_tasks(loop)
                for task in pending:
                    task.cancel()
                if pending:
                    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            finally:
                loop.close()

    async def _connect(self) -> None:
        import nats

        async def disconnected() -> None:
            self._set_connected(False)

        async def reconnected() -> None:
            self._set_connected(True)

        last: dict[str, float] = {}

        async def error(e: Exception) -> None:
            # The same error again (a server down, retried twice a second)
            # is logged once a minute.
            text, now = repr(e), asyncio.get_running_loop().time()
            if now - last.get(text, -ERROR_LOG_INTERVAL) < ERROR_LOG_INTERVAL:
                return
            last[text] = now
            self._from_loop(self.log.warn, "nats {name}: {error}", name=self.name, error=text)

        options: dict[str, Any] = dict(self.credentials.connect_options())
        if self.tls is not None:
            options["tls"] = self.tls
        if self.inbox_prefix is not None:
            options["inbox_prefix"] = self.inbox_prefix
        client = await nats.connect(
            servers=list(self.servers),
            name=self.name,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=self.reconnect_wait,
            connect_timeout=self.connect_timeout,
            disconnected_cb=disconnected,
            reconnected_cb=reconnected,
            error_cb=error,
            **options,
        )
        self._client = client
        self._js = client.jetstream()
        self._set_connected(True)

    def _set_connected(self, connected: bool) -> None:
        def note() -> None:
            was, self.connected = self.connected, connected
            if was != connected:
                self.log.info(
                    "nats {name}: {state}",
                    kcoral_event="nats_connection",
                    name=self.name,
                    state="connected" if connected else "disconnected",
                    connected=connected,
                )
                if self.on_connection is not None:
                    self.on_connection(connected)

        self._from_loop(note)

    def stop(self) -> Deferred[None]:
        """Drain and close the connection, then end the loop's thread."""
        if self._loop is None or self._stopping:
            return Deferred.fromCoroutine(_done())
        self._stopping = True
        loop, thread = self._loop, self._thread

        async def close() -> None:
            client = self._client
            if client is not None and not client.is_closed:
                try:
                    await asyncio.wait_for(client.close(), 2.0)
                except Exception:
                    pass

        d = self._submit(close)

        def end(result: object) -> object:
            if not self.inline:
                loop.call_soon_threadsafe(loop.stop)
            self.connected = False
            return result

        def joined(result: object) -> Deferred[None]:
            from twisted.internet.threads import deferToThread

            if thread is None:
                return Deferred.fromCoroutine(_done())
            return deferToThread(thread.join, 5.0)

        d.addBoth(end)
        d.addCallback(joined)
        return d

    # -- work ---------------------------------------------------------------

    def call(self, work: NatsWork[_T], timeout: float | None = None) -> Deferred[_T]:
        """
        Run C{work(client, jetstream)} on the loop; the Deferred fires
        (on the reactor thread) with its result.  Cancelling the Deferred
        cancels the task.  C{timeout} bounds the whole call.
        """

        return self._submit(lambda: self._run(work, timeout))

    def spawn(self, work: NatsWork[None]) -> Deferred[None]:
        """
        Run a long-lived C{work} (a watch, a pull loop) on the loop; the
        Deferred fires when it ends, fails with its error, and cancelling it
        ends it.  C{work} reports what it sees with L{deliver}.
        """
        return self.call(work)

    async def _run(self, work: NatsWork[_T], timeout: float | None) -> _T:
        client, js = self._require()
        if timeout is None:
            return await work(client, js)
        return await bounded(work(client, js), timeout)

    def deliver(self, f: Callable[..., object], *args: Any, **kwargs: Any) -> None:
        """From the loop: run C{f(*args, **kwargs)} on the reactor thread, errors logged."""

        def guarded() -> None:
            try:
                f(*args, **kwargs)
            except Exception:
                self.log.failure("nats {name}: delivery to {f} failed", name=self.name, f=f)

        self._from_loop(guarded)

    def begin(self, work: Coroutine[Any, Any, _T]) -> Deferred[_T]:
        """
        From the loop: run C{work} as a task of it, begun at once where
        Python can (L{start_task}), and a Deferred that fires on the reactor
        thread with its outcome (work begun inside a call, whose result the
        reactor waits for apart from the call's own, as a claim made as its
        job arrives).  The task fires it as C{work} ends, in the same step:
        on the reactor's own loop a turn sooner than a done callback would.
        A cancelled task (the loop shutting down) fails it with Twisted's
        C{CancelledError}, an C{Exception} as reactor code expects.
        """
        d: Deferred[_T] = Deferred()

        async def told() -> None:
            try:
                result = await work
            except asyncio.CancelledError:
                self._from_loop(_errback, d, CancelledError())
                raise
            except Exception as e:
                self._from_loop(_errback, d, e)
            else:
                self._from_loop(_callback, d, result)

        task = start_task(told())
        # Kept until done: the loop holds its tasks weakly.
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return d

    def _from_loop(self, f: Callable[..., object], *args: Any, **kwargs: Any) -> None:
        if self.inline:
            # The loop is the reactor's: this is the reactor thread already.
            f(*args, **kwargs)
        else:
            self._reactor.callFromThread(f, *args, **kwargs)

    def _require(self) -> tuple[Client, JetStreamContext]:
        client, js = self._client, self._js
        if client is None or js is None or client.is_closed:
            raise NotConnected("no NATS connection")
        return client, js

    def _submit(self, make: Callable[[], Awaitable[_T]]) -> Deferred[_T]:
        loop = self._loop
        if loop is None or loop.is_closed():
            return _failed(NotConnected("NATS bridge not running"))
        if self.inline:
            called = _inline(loop, make)
            if self._client is not None:
                # The call has run up to its first wait: what it published
                # leaves now, not after the rest of this loop turn.
                write_now(self._client)
            return called
        holder: dict[str, asyncio.Future[_T]] = {}

        def cancel(_: Deferred[_T]) -> None:
            future = holder.get("future")
            if future is not None:
                loop.call_soon_threadsafe(future.cancel)

        d: Deferred[_T] = Deferred(cancel)

        def done(future: asyncio.Future[_T]) -> None:
            self._reactor.callFromThread(_settle, d, future)

        def begin() -> None:
            task = asyncio.ensure_future(make())
            holder["future"] = task
            task.add_done_callback(done)

        try:
            loop.call_soon_threadsafe(begin)
        except RuntimeError as e:
            return _failed(NotConnected(str(e)))
        return d


def _callback(d: Deferred[_T], result: _T) -> None:
    if not d.called:
        d.callback(result)


def _errback(d: Deferred[Any], error: BaseException) -> None:
    if not d.called:
        d.errback(Failure(error))


async def bounded(work: Awaitable[_T], timeout: float) -> _T:
    """
    C{work} within C{timeout} seconds (else C{TimeoutError}), in the
    calling task: C{asyncio.timeout} where there is one (Python 3.11 on),
    not C{asyncio.wait_for}, whose task of its own costs a call two more
    turns of the loop (one to start, one to finish).
    """
    limit = getattr(asyncio, "timeout", None)
    if limit is None:  # Python 3.10
        return await asyncio.wait_for(work, timeout)
    async with limit(timeout):
        return await work


def install_asyncio_reactor() -> bool:
    """
    Install Twisted's asyncio reactor unless a reactor is installed
    already; whether it did.  A bridge started under it runs nats-py on
    the reactor's own loop, with no thread between NATS and the reactor:
    C{kcoral gateway} and C{kcoral server --join} call this first.
    """
    import sys

    if "twisted.internet.reactor" in sys.modules:
        return False
    from twisted.internet import asyncioreactor

    asyncioreactor.install()
    return True


def reactor_loop(reactor: Any) -> asyncio.AbstractEventLoop | None:
    """The asyncio loop C{reactor} runs on (Twisted's asyncio reactor), else C{None}."""
    loop = getattr(reactor, "_asyncioEventloop", None)
    return loop if isinstance(loop, asyncio.AbstractEventLoop) else None


def start_task(
    coroutine: Coroutine[Any, Any, _T], loop: asyncio.AbstractEventLoop | None = None
) -> asyncio.Future[_T]:
    """
    C{coroutine} as a task of C{loop} (the running loop by default), begun
    at once where Python can (3.12's eager tasks): a publish is then in
    nats-py's buffer before this returns, and its flusher writes it on the
    loop's next turn, not the one after.  Called on the loop's thread.
    """
    if EAGER_TASKS:
        running = loop if loop is not None else asyncio.get_running_loop()
        return asyncio.Task(coroutine, loop=running, eager_start=True)  # type: ignore[call-arg]
    return asyncio.ensure_future(coroutine, loop=loop)


def write_now(client: Client) -> None:
    """
    Hand what nats-py holds for nats-server to the socket now.  nats-py
    writes from a flusher task, which runs only when the loop comes round
    again: on the reactor's own loop that is after everything else this
    turn does (the rest of an HTTP request's handling, a log line), about
    0.1 ms on the pool's path per publish.  This is what nats-py itself does
    when its flusher is gone: the commands are written in order, and the
    flusher, finding nothing pending, writes nothing.  Nothing happens while
    the client is not connected (a reconnect sends what is pending).
    Called on the loop's thread.
    """
    if not client.is_connected or client.pending_data_size <= 0:
        return
    transport = getattr(client, "_transport", None)
    pending = getattr(client, "_pending", None)
    if transport is None or not isinstance(pending, list):
        return  # not the nats-py this was written for: its flusher writes
    transport.writelines(pending[:])
    client._pending = []
    client._pending_data_size = 0


def _inline(loop: asyncio.AbstractEventLoop, make: Callable[[], Awaitable[_T]]) -> Deferred[_T]:
    """
    C{make()} as a task of the reactor's own loop (begun at once where
    Python can, L{start_task}), its Deferred fired directly by the task's
    end (no thread hop); cancelling the Deferred cancels the task.
    """
    work = make()
    task: asyncio.Future[_T] = (
        start_task(work, loop)
        if asyncio.iscoroutine(work)
        else asyncio.ensure_future(work, loop=loop)
    )

    def cancel(_: Deferred[_T]) -> None:
        task.cancel()

    d: Deferred[_T] = Deferred(cancel)

    task.add_done_callback(lambda future: _settle(d, future))
    return d


def _settle(d: Deferred[_T], future: asyncio.Future[_T]) -> None:
    """
    Fire C{d} with C{future}'s outcome (on the reactor's thread); a
    cancelled C{future} fails it with asyncio's C{CancelledError}.
    """
    if d.called:
        if not future.cancelled():
            future.exception()  # retrieved: the Deferred was cancelled first
        return
    if future.cancelled():
        d.errback(Failure(asyncio.CancelledError()))
        return
    error = future.exception()
    if error is not None:
        d.errback(Failure(error))
    else:
        d.callback(future.result())


async def ensure_consumer(
    js: JetStreamContext, compat: str, gpus: int, ack_wait: float = 30.0
) -> str:
    """
    Create the durable pull consumer of C{(compat, gpus)} if it does not
    exist yet (idempotent: the same configuration every time); its name.
    """
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    from kcoral.gateway.jobs import STREAM, consumer_name, job_subject

    name = consumer_name(compat, gpus)
    await js.add_consumer(
        STREAM,
        ConsumerConfig(
            durable_name=name,
            filter_subject=job_subject(compat, gpus),
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=ack_wait,
            max_ack_pending=-1,
        ),
    )
    return name


async def _done() -> None:
    return None


def _failed(error: Exception) -> Deferred[Any]:
    d: Deferred[Any] = Deferred()
    d.errback(Failure(error))
    return d
