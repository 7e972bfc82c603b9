"""
Tests for L{kcoral.server.service.KCoralService}: the service tree and the
order its children start and stop in, without starting a real child.
"""

from __future__ import annotations

import attrs
from twisted.application import service
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource
from twisted.web.server import Site

from kcoral.config import ServerConfig
from kcoral.server.children import ListeningPortService
from kcoral.server.service import KCoralService, create_app, makeService
from kcoral.testing.fakes import RecordingService, SyncReactor, SyncThreadPool


def _config() -> ServerConfig:
    return ServerConfig(device="cpu", num_workers=1, log_dir=None, disk_cache_dir=None)


class TreeTests(SynchronousTestCase):
    def test_children(self) -> None:
        """The root is a MultiService of named parts, the port last."""
        root = makeService(
            _config(), "tcp:port=0:interface=127.0.0.1", reactor=MemoryReactorClock()
        )
        self.assertIsInstance(root, service.MultiService)
        self.assertEqual(
            [child.name for child in root],
            ["threads", "logs", "caches", "linger", "workers", "http"],
        )
        self.assertFalse(any(child.running for child in root))

    def test_linger_waits_for_open_connections(self) -> None:
        """
        At stop the linger ends when the last connection closes, and at the
        latest after DRAIN_LINGER_SECONDS.
        """
        from types import SimpleNamespace

        from kcoral.server.children import DRAIN_LINGER_SECONDS, LingerService

        clock = Clock()
        site = SimpleNamespace(open_connections=2)
        linger = LingerService(clock, site)
        linger.startService()
        d = linger.stopService()
        clock.advance(0.1)
        self.assertNoResult(d)
        site.open_connections = 0
        clock.advance(0.02)
        self.successResultOf(d)
        site.open_connections = 1
        linger.startService()
        d = linger.stopService()
        clock.advance(DRAIN_LINGER_SECONDS - 0.05)
        self.assertNoResult(d)
        clock.advance(0.1)
        self.successResultOf(d)

    def test_app_has_no_port(self) -> None:
        """C{create_app}'s service serves no port of its own."""
        app = create_app(_config(), reactor=MemoryReactorClock())
        root = app.kcoral_service  # type: ignore[attr-defined]
        self.assertEqual([child.name for child in root], ["threads", "logs", "caches", "workers"])


class CreateSiteTests(SynchronousTestCase):
    """L{kcoral.create_site}: the server's own site for an embedded app."""

    def test_limits_from_config(self) -> None:
        """The site carries the config's request limits and deadlines."""
        from kcoral import create_site
        from kcoral.server.http.site import KcoralSite

        config = attrs.evolve(
            _config(),
            max_request_bytes=12345,
            header_timeout_seconds=7.0,
            body_timeout_seconds=9.0,
            max_connections=11,
            max_bytes_in_flight=1 << 20,
        )
        site = create_site(create_app(config, reactor=MemoryReactorClock()))
        self.assertIsInstance(site, KcoralSite)
        self.assertEqual(
            (
                site.max_request_bytes,
                site.header_timeout,
                site.body_timeout,
                site.max_connections,
                site.max_bytes_in_flight,
            ),
            (12345, 7.0, 9.0, 11, 1 << 20),
        )
        self.assertIsNotNone(site.streamed_body)

    def test_tokens(self) -> None:
        """With C{auth_token_file}, the app is behind the token guard."""
        from kcoral import create_site
        from kcoral.server.http.auth import TokenGuard

        path = self.mktemp()
        with open(path, "w") as f:
            f.write("alice " + "a" * 32 + "\n")
        config = attrs.evolve(_config(), auth_token_file=path)
        site = create_site(create_app(config, reactor=MemoryReactorClock()))
        self.assertIsInstance(site.resource, TokenGuard)
        plain = create_site(create_app(_config(), reactor=MemoryReactorClock()))
        self.assertNotIsInstance(plain.resource, TokenGuard)


class OrderTests(SynchronousTestCase):
    def make(self) -> tuple[KCoralService, list[RecordingService], list[str]]:
        root = KCoralService(_config(), reactor=MemoryReactorClock())
        for child in list(root):
            child.disownServiceParent()
        calls: list[str] = []
        children = [RecordingService(name, calls) for name in ("a", "b", "c")]
        for child in children:
            child.setServiceParent(root)
        return root, children, calls

    def test_start_in_sequence(self) -> None:
        """Each child starts once the one before it has; then C{ready} fires."""
        root, (a, b, c), calls = self.make()
        root.startService()
        self.assertEqual(calls, ["start a"])
        a.started.callback(None)
        self.assertEqual(calls, ["start a", "start b"])
        b.started.callback(None)
        self.assertNoResult(root.ready)
        c.started.callback(None)
        self.assertIsNone(self.successResultOf(root.ready))

    def test_freeze_when_ready(self) -> None:
        """
        A server that owns its process (L{makeService}) freezes what it made
        while starting once it is ready; an embedded one (L{create_app})
        leaves its host's collector alone.
        """
        import gc

        owned = makeService(_config(), "tcp:port=0", reactor=MemoryReactorClock())
        self.assertTrue(owned.freeze_when_ready)
        embedded = create_app(_config(), reactor=MemoryReactorClock())
        self.assertFalse(embedded.kcoral_service.freeze_when_ready)  # type: ignore[attr-defined]

        root, (a, b, c), _ = self.make()
        root.freeze_when_ready = True
        self.addCleanup(gc.unfreeze)
        before = gc.get_freeze_count()
        root.startService()
        a.started.callback(None)
        b.started.callback(None)
        self.assertEqual(gc.get_freeze_count(), before)
        c.started.callback(None)
        self.successResultOf(root.ready)
        self.assertGreater(gc.get_freeze_count(), before)

    def test_failed_start(self) -> None:
        """A child that fails stops the start: C{ready} fails, the rest never start."""
        root, (a, b, c), calls = self.make()
        root.startService()
        a.started.errback(RuntimeError("no port"))
        self.failureResultOf(root.ready, RuntimeError)
        self.assertEqual(root.start_failure, "RuntimeError: no port")
        self.assertEqual(calls, ["start a"])
        self.assertEqual(len(self.flushLoggedErrors()), 0)
        # Stopping then stops only what started.
        a.stopped.callback(None)
        self.successResultOf(root.stopService())
        self.assertEqual(calls, ["start a", "stop a"])

    def test_stop_in_reverse_sequence(self) -> None:
        """
        Children stop last to first, each once the one after it has, and
        C{stopService} fires only when the first child has stopped.
        """
        root, (a, b, c), calls = self.make()
        for child in (a, b, c):
            child.started.callback(None)
        root.startService()
        del calls[:]
        d = root.stopService()
        self.assertEqual(calls, ["stop c"])
        c.stopped.callback(None)
        self.assertEqual(calls, ["stop c", "stop b"])
        b.stopped.callback(None)
        self.assertNoResult(d)
        a.stopped.callback(None)
        self.successResultOf(d)
        self.assertEqual(calls, ["stop c", "stop b", "stop a"])


class LameDuckTests(SynchronousTestCase):
    """
    C{lame_duck_seconds}: at stop, /health says C{stopping} for that long
    before any child stops; every request is still served meanwhile.
    """

    def make(
        self, seconds: float = 5.0, port: bool = True
    ) -> tuple[KCoralService, MemoryReactorClock, list[RecordingService], list[str]]:
        reactor = MemoryReactorClock()
        config = attrs.evolve(_config(), lame_duck_seconds=seconds)
        root = KCoralService(config, reactor=reactor)
        for child in list(root):
            child.disownServiceParent()
        calls: list[str] = []
        names = ("workers", "http") if port else ("workers",)
        children = [RecordingService(name, calls) for name in names]
        for child in children:
            child.setServiceParent(root)
            child.started.callback(None)
        root.startService()
        self.successResultOf(root.ready)
        del calls[:]
        return root, reactor, children, calls

    def test_children_stop_after_the_lame_duck(self) -> None:
        """/health answers 503 at once; the port closes only when the lame duck ends."""
        root, reactor, (workers, http), calls = self.make(5.0)
        d = root.stopService()
        self.assertTrue(root.api.stopping)
        self.assertEqual(root.api.health()["status"], "stopping")
        self.assertEqual(calls, [])
        reactor.advance(4.9)
        self.assertEqual(calls, [])
        reactor.advance(0.1)
        self.assertEqual(calls, ["stop http"])
        http.stopped.callback(None)
        workers.stopped.callback(None)
        self.successResultOf(d)
        self.assertEqual(reactor.getDelayedCalls(), [])

    def test_second_signal_ends_it(self) -> None:
        """A second stop signal (L{KCoralService.stop_now}) cuts the lame duck short."""
        root, reactor, (workers, http), calls = self.make(30.0)
        d = root.stopService()
        root.stop_now()
        self.assertEqual(calls, ["stop http"])
        http.stopped.callback(None)
        workers.stopped.callback(None)
        self.successResultOf(d)
        self.assertEqual(reactor.getDelayedCalls(), [])

    def test_none_by_default(self) -> None:
        """Without C{lame_duck_seconds}, or without a port, the stop begins at once."""
        for seconds, port in ((0.0, True), (5.0, False)):
            root, _reactor, children, calls = self.make(seconds, port)
            root.stopService()
            self.assertFalse(root.api.stopping)
            self.assertEqual(calls, [f"stop {children[-1].name}"])

    def test_none_after_a_failed_start(self) -> None:
        """A server that never came up stops at once: nothing routed to it."""
        reactor = MemoryReactorClock()
        root = KCoralService(attrs.evolve(_config(), lame_duck_seconds=5.0), reactor=reactor)
        for child in list(root):
            child.disownServiceParent()
        calls: list[str] = []
        http = RecordingService("http", calls)
        http.setServiceParent(root)
        root.startService()
        http.started.errback(RuntimeError("no port"))
        self.failureResultOf(root.ready, RuntimeError)
        http.stopped.callback(None)
        self.successResultOf(root.stopService())
        self.assertFalse(root.api.stopping)
        self.assertEqual(calls, ["start http", "stop http"])


class ChildTests(SynchronousTestCase):
    def test_port_listens_and_stops(self) -> None:
        """The http child listens when it starts and stops listening when it stops."""
        reactor = MemoryReactorClock()
        port = ListeningPortService(reactor, "tcp:port=8123:interface=127.0.0.1", Site(Resource()))
        self.successResultOf(port.startService())
        self.assertEqual([(p, i) for p, _, _, i in reactor.tcpServers], [(8123, "127.0.0.1")])
        self.assertIsNotNone(port.port)
        self.successResultOf(port.stopService())
        self.assertIsNone(port.port)
        self.assertFalse(port.running)

    def test_workers_stop_waits_for_requests(self) -> None:
        """
        The workers child refuses queued requests and closes the leases at
        once, but stops the pool only when no request is in flight.
        """
        root = KCoralService(_config(), reactor=SyncReactor())
        root.threadpool = SyncThreadPool()
        workers = root.getServiceNamed("workers")
        workers.running = True
        root.api.in_flight = 1
        d = workers.stopService()
        self.assertTrue(root.pool.closing)
        self.assertTrue(root.leases.closed)
        self.assertNoResult(d)

    def test_workers_stop(self) -> None:
        """With nothing in flight the workers child stops the pool at once."""
        root = KCoralService(_config(), reactor=SyncReactor())
        root.threadpool = SyncThreadPool()
        workers = root.getServiceNamed("workers")
        workers.running = True
        self.successResultOf(workers.stopService())
        self.assertEqual(root.pool.capacity, 0)
        self.assertFalse(workers.running)
