"""
Tests for L{kcoral.server.observe.sdnotify} and the server's use of it: messages
received on a real Unix datagram socket named by C{NOTIFY_SOCKET}, as
systemd binds it for a C{Type=notify} unit.
"""

from __future__ import annotations

import os
import socket
import tempfile

from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase

from kcoral.config import ServerConfig
from kcoral.server.observe.sdnotify import NOTIFY_SOCKET, SystemdNotifier
from kcoral.server.service import KCoralService, makeService
from kcoral.server.topology import FrontEnd
from kcoral.testing.fakes import RecordingService


class _Listener:
    """A bound datagram socket standing in for systemd's notification socket."""

    def __init__(self, case: SynchronousTestCase, abstract: bool = False) -> None:
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        case.addCleanup(self.socket.close)
        if abstract:
            name = f"kcoral-test-notify-{os.getpid()}-{id(self)}"
            self.socket.bind("\0" + name)
            self.variable = "@" + name
        else:
            directory = tempfile.mkdtemp(prefix="kcoral-notify-")
            path = os.path.join(directory, "notify")
            self.socket.bind(path)
            case.addCleanup(os.rmdir, directory)
            case.addCleanup(os.unlink, path)
            self.variable = path
        self.socket.setblocking(False)

    def messages(self) -> list[list[str]]:
        """Every message received so far, each as its lines."""
        received = []
        while True:
            try:
                data = self.socket.recv(4096)
            except BlockingIOError:
                return received
            received.append(data.decode("utf-8").split("\n"))


class NotifierTests(SynchronousTestCase):
    def test_path_socket(self) -> None:
        """
        C{NOTIFY_SOCKET} naming a path: the lines arrive as one datagram, and
        the variable is removed so the server's children cannot use it.
        """
        listener = _Listener(self)
        environ = {NOTIFY_SOCKET: listener.variable, "OTHER": "1"}
        notifier = SystemdNotifier.from_environment(environ)
        assert notifier is not None
        self.assertEqual(environ, {"OTHER": "1"})
        self.assertTrue(notifier.notify("READY=1", "STATUS=serving\nnow"))
        self.assertEqual(listener.messages(), [["READY=1", "STATUS=serving now"]])

    def test_abstract_socket(self) -> None:
        """C{@name} is the abstract socket C{\\0name}."""
        listener = _Listener(self, abstract=True)
        notifier = SystemdNotifier.from_environment({NOTIFY_SOCKET: listener.variable})
        assert notifier is not None
        self.assertTrue(notifier.notify("STOPPING=1"))
        self.assertEqual(listener.messages(), [["STOPPING=1"]])

    def test_unset_or_unsupported(self) -> None:
        """No variable, an empty one, or a vsock address: no notifier."""
        self.assertIsNone(SystemdNotifier.from_environment({}))
        self.assertIsNone(SystemdNotifier.from_environment({NOTIFY_SOCKET: ""}))
        self.assertIsNone(SystemdNotifier.from_environment({NOTIFY_SOCKET: "vsock:2:1234"}))

    def test_nobody_listening(self) -> None:
        """A socket that is gone is logged, not raised: the server goes on."""
        listener = _Listener(self)
        notifier = SystemdNotifier(listener.variable)
        listener.socket.close()
        os.unlink(listener.variable)
        self.addCleanup(open(listener.variable, "w").close)  # for the cleanup's unlink
        self.assertFalse(notifier.notify("READY=1"))


def _config() -> ServerConfig:
    return ServerConfig(device="cpu", num_workers=1, log_dir=None, disk_cache_dir=None)


class ServerNotifiesTests(SynchronousTestCase):
    """The root service says READY=1 once every child is up, STOPPING=1 at stop."""

    def make(
        self,
        listener: _Listener,
        config: ServerConfig | None = None,
        front_end: FrontEnd | None = None,
    ) -> tuple[KCoralService, RecordingService]:
        root = makeService(
            config or _config(), "tcp:port=0", reactor=MemoryReactorClock(), front_end=front_end
        )
        root.exit_status_on_failure = None
        root.freeze_when_ready = False
        root.environ = {NOTIFY_SOCKET: listener.variable}
        for child in list(root):
            child.disownServiceParent()
        workers = RecordingService("workers", [])
        workers.setServiceParent(root)
        return root, workers

    def test_ready_then_stopping(self) -> None:
        """Nothing until the workers are up; then READY=1; STOPPING=1 when the stop begins."""
        listener = _Listener(self)
        root, workers = self.make(listener)
        root.startService()
        self.assertEqual(listener.messages(), [])
        self.assertEqual(root.environ, {})
        workers.started.callback(None)
        self.successResultOf(root.ready)
        [ready] = listener.messages()
        self.assertEqual(ready[0], "READY=1")
        self.assertTrue(ready[1].startswith("STATUS=serving"))
        d = root.stopService()
        self.assertEqual(listener.messages(), [["STOPPING=1", "STATUS=stopping"]])
        workers.stopped.callback(None)
        self.successResultOf(d)

    def test_failed_start_is_not_ready(self) -> None:
        """A start that fails never says READY=1; its status names the cause."""
        listener = _Listener(self)
        root, workers = self.make(listener)
        root.startService()
        workers.started.errback(RuntimeError("bubblewrap cannot run"))
        self.failureResultOf(root.ready, RuntimeError)
        self.assertEqual(
            listener.messages(), [["STATUS=failed to start: RuntimeError: bubblewrap cannot run"]]
        )

    def test_only_the_server_process(self) -> None:
        """
        An embedded service (L{KCoralService} without L{makeService}) and a
        front end other than the first leave C{NOTIFY_SOCKET} alone.
        """
        listener = _Listener(self)
        embedded = KCoralService(_config(), reactor=MemoryReactorClock())
        embedded.environ = {NOTIFY_SOCKET: listener.variable}
        for child in list(embedded):
            child.disownServiceParent()
        embedded.startService()
        self.successResultOf(embedded.ready)
        self.assertEqual(embedded.environ, {NOTIFY_SOCKET: listener.variable})
        other = ServerConfig(
            device="cpu", num_workers=2, log_dir=None, disk_cache_dir=None, front_ends=2
        )
        root, workers = self.make(
            listener, other, FrontEnd(index=1, broker="/nonexistent/broker.sock")
        )
        root.startService()
        workers.started.callback(None)
        self.assertEqual(listener.messages(), [])
