"""
Tests for L{kcoral.server.workers.template}: the parent's side of a worker
template, driven by its messages (no template process: C{connect} takes a
fake sender, the reactor is a L{MemoryReactorClock}).
"""

from __future__ import annotations

import json
import os
from typing import Any

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from kcoral.server.workers.backoff import Backoff
from kcoral.server.workers.template import (
    LOST_STATUS,
    TemplateError,
    WorkerTemplate,
    WorkerTemplates,
    host_pid,
)


class Recorder(ProcessProtocol):
    """A process protocol that records how its process ended."""

    def __init__(self) -> None:
        self.ended: list[Failure] = []

    def processEnded(self, reason: Failure) -> None:
        self.ended.append(reason)


class Sent:
    """A fake sender: what C{fork_transport} would write on the socket."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.fds: list[list[int]] = []
        self.fail: OSError | None = None

    def __call__(self, data: bytes, fds: list[int]) -> None:
        if self.fail is not None:
            raise self.fail
        self.messages.append(json.loads(data))
        # The kernel would duplicate them into the template: keep copies.
        self.fds.append([os.dup(fd) for fd in fds])


class WorkerTemplateTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.template = WorkerTemplate("gpu0", self.reactor)
        self.sent = Sent()
        self.template.connect(self.sent)
        self.addCleanup(self._close_sent)

    def _close_sent(self) -> None:
        for fds in self.sent.fds:
            for fd in fds:
                os.close(fd)

    def ready(self) -> None:
        self.template.message({"op": "ready", "pid": 7})

    def fork(self, proto: ProcessProtocol | None = None) -> Any:
        return self.template.fork_transport(
            proto or Recorder(),
            {0: "w", 1: "r", 2: "r"},
            argv=["--device", "gpu"],
            env={"A": "1"},
            cwd="/work",
            workspace="gpu0-w0-g1/work",
            capture_bytes=1024,
        )

    def test_ready(self) -> None:
        """The first C{ready} message makes the template ready."""
        self.assertNoResult(self.template.ready)
        self.ready()
        self.successResultOf(self.template.ready)
        self.assertEqual(self.template.state, "ready")

    def test_no_fork_before_ready(self) -> None:
        """A template that is not ready refuses to fork."""
        with self.assertRaises(TemplateError):
            self.fork()
        self.assertEqual(self.sent.messages, [])

    def test_fork_request(self) -> None:
        """A fork sends one request naming the child fds, with one descriptor each."""
        self.ready()
        transport = self.fork()
        [request] = self.sent.messages
        self.assertEqual(request["op"], "fork")
        self.assertEqual(request["fds"], [0, 1, 2])
        self.assertEqual(request["argv"], ["--device", "gpu"])
        self.assertEqual(request["env"], {"A": "1"})
        self.assertEqual(request["workspace"], "gpu0-w0-g1/work")
        self.assertEqual(request["capture_bytes"], 1024)
        self.assertEqual(len(self.sent.fds[0]), 3)
        self.assertEqual(sorted(transport.pipes), [0, 1, 2])
        self.assertIsNone(transport.pid)

    def test_passed_descriptor(self) -> None:
        """An int in child_fds is sent as it is, and stays the caller's."""
        self.ready()
        r, w = os.pipe()
        self.addCleanup(os.close, r)
        self.addCleanup(os.close, w)
        transport = self.template.fork_transport(
            Recorder(), {1: "r", 5: w}, argv=[], env={}, cwd="/"
        )
        self.assertEqual(self.sent.messages[0]["fds"], [1, 5])
        self.assertEqual(sorted(transport.pipes), [1])
        os.fstat(w)  # not closed

    def test_forked_then_exited(self) -> None:
        """The pid arrives with C{forked}; the end with C{exited}'s status."""
        self.ready()
        proto = Recorder()
        transport = self.fork(proto)
        request_id = self.sent.messages[0]["id"]
        self.template.message({"op": "forked", "id": request_id, "pid": 1234})
        self.assertEqual(self.successResultOf(transport.started), 1234)
        self.assertEqual(transport.pid, 1234)
        for pipe in list(transport.pipes.values()):
            pipe.connectionLost(Failure(Exception("closed")))
        self.template.message({"op": "exited", "id": request_id, "status": 3 << 8})
        [reason] = proto.ended
        self.assertEqual(reason.value.exitCode, 3)

    def test_nothing_read_before_pid(self) -> None:
        """The child's output is read only once its pid is known."""
        self.ready()
        transport = self.fork()
        readers = [transport.pipes[1], transport.pipes[2]]
        self.assertFalse(any(r in self.reactor.getReaders() for r in readers))
        self.template.message({"op": "forked", "id": self.sent.messages[0]["id"], "pid": 5})
        self.assertTrue(all(r in self.reactor.getReaders() for r in readers))

    def test_pid_mapped(self) -> None:
        """A template in its own PID namespace has its pids mapped to host pids."""
        self.template.map_pid = lambda pid: pid + 1000
        self.ready()
        transport = self.fork()
        self.template.message({"op": "forked", "id": self.sent.messages[0]["id"], "pid": 4})
        self.assertEqual(self.successResultOf(transport.started), 1004)

    def test_signal_before_pid(self) -> None:
        """A signal sent before the fork is reported waits for the pid."""
        self.ready()
        transport = self.fork()
        sent: list[tuple[int, Any]] = []
        transport.signalProcess("KILL")
        self.patch(os, "kill", lambda pid, sig: sent.append((pid, sig)))
        self.template.message({"op": "forked", "id": self.sent.messages[0]["id"], "pid": 99})
        self.assertEqual([pid for pid, _ in sent], [99])

    def test_failed_fork(self) -> None:
        """A fork the template could not make ends as killed."""
        self.ready()
        proto = Recorder()
        transport = self.fork(proto)
        for pipe in list(transport.pipes.values()):
            pipe.connectionLost(Failure(Exception("closed")))
        self.template.message({"op": "failed", "id": self.sent.messages[0]["id"], "error": "x"})
        [reason] = proto.ended
        self.assertEqual(reason.value.signal, LOST_STATUS)
        self.assertIsNone(self.successResultOf(transport.started))

    def test_send_error(self) -> None:
        """A socket that cannot take the request fails the fork at once, pipes closed."""
        self.ready()
        self.sent.fail = BlockingIOError("full")
        before = len(os.listdir("/proc/self/fd"))
        with self.assertRaises(TemplateError):
            self.fork()
        self.assertEqual(len(os.listdir("/proc/self/fd")), before)

    def test_broken_ends_children(self) -> None:
        """A template that goes away ends its children as killed and forks no more."""
        self.ready()
        proto = Recorder()
        transport = self.fork(proto)
        for pipe in list(transport.pipes.values()):
            pipe.connectionLost(Failure(Exception("closed")))
        self.template.broken("socket closed")
        self.assertEqual(self.template.state, "failed")
        [reason] = proto.ended
        self.assertEqual(reason.value.signal, LOST_STATUS)
        with self.assertRaises(TemplateError):
            self.fork()

    def test_broken_before_ready(self) -> None:
        """A template that fails during start fails C{ready}."""
        self.template.broken("exited")
        self.failureResultOf(self.template.ready, TemplateError)

    def test_message_for_no_request(self) -> None:
        """A message about a request never made breaks the template."""
        self.ready()
        self.template.message({"op": "exited", "id": 42, "status": 0})
        self.assertEqual(self.template.state, "failed")

    def test_fork_without_pid(self) -> None:
        """A C{forked} message without an integer pid breaks the template."""
        self.ready()
        self.fork()
        self.template.message({"op": "forked", "id": self.sent.messages[0]["id"], "pid": "1"})
        self.assertEqual(self.template.state, "failed")


class HostPidTests(SynchronousTestCase):
    def test_gone(self) -> None:
        """No such root: no host pid."""
        self.assertIsNone(host_pid(2**22 + 12345, 2))

    def test_not_below(self) -> None:
        """A pid no process below the root has: C{None}."""
        self.assertIsNone(host_pid(os.getpid(), 2**22 + 1))


class WorkerTemplatesTests(SynchronousTestCase):
    """L{WorkerTemplates}: start, restart after a back-off, stop."""

    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.launched: list[tuple[WorkerTemplate, int | None]] = []
        self.fail_keys: set[int | None] = set()

    def launch(self, template: WorkerTemplate, key: int | None) -> Deferred[None]:
        self.launched.append((template, key))
        if key in self.fail_keys:
            template.broken("cannot start")
            self.failureResultOf(template.ready, TemplateError)
            return fail(TemplateError("cannot start"))
        template.connect(lambda data, fds: None)
        template.message({"op": "ready", "pid": len(self.launched)})
        return succeed(None)

    def make(self) -> WorkerTemplates:
        return WorkerTemplates(self.reactor, self.launch, backoff=Backoff(1.0, 4.0))

    def test_start(self) -> None:
        """One template per key, each named for its device; all ready: fork."""
        templates = self.make()
        self.successResultOf(Deferred.fromCoroutine(templates.start([None, 0, 1, 0])))
        self.assertEqual([t.name for t in templates.values()], ["cpu", "gpu0", "gpu1"])
        self.assertEqual(templates.worker_start, "fork")
        self.assertIs(templates.ready_for((1,), isolated=True), templates[1])
        self.assertIs(templates.ready_for((0, 1), isolated=False), templates[0])
        self.assertIsNone(templates.ready_for((0, 1), isolated=True))

    def test_failed_start_spawns(self) -> None:
        """A template that does not start leaves its workers to be spawned."""
        self.fail_keys = {1}
        templates = self.make()
        self.successResultOf(Deferred.fromCoroutine(templates.start([0, 1])))
        self.assertEqual(templates.worker_start, "spawn")
        self.assertIsNone(templates.ready_for((1,), isolated=True))
        self.assertIs(templates.ready_for((0,), isolated=True), templates[0])
        self.assertEqual(len(templates), 2)

    def test_restart_backs_off(self) -> None:
        """A template lost while serving is restarted after a doubling wait."""
        templates = self.make()
        self.successResultOf(Deferred.fromCoroutine(templates.start([None])))
        first = templates[None]
        self.fail_keys = {None}
        first.broken("socket closed")
        self.assertEqual(templates.worker_start, "spawn")
        self.reactor.advance(1.0)
        self.assertEqual(len(self.launched), 2)
        self.reactor.advance(1.9)
        self.assertEqual(len(self.launched), 2)  # the wait doubled
        self.fail_keys = set()
        self.reactor.advance(0.1)
        self.assertEqual(len(self.launched), 3)
        self.assertIs(templates[None], self.launched[-1][0])
        self.assertEqual(templates.worker_start, "fork")
        # Restarted: the count starts over.
        templates[None].broken("socket closed")
        [restart] = self.reactor.getDelayedCalls()
        self.assertEqual(restart.getTime() - self.reactor.seconds(), 1.0)

    def test_closed_restarts_nothing(self) -> None:
        templates = self.make()
        self.successResultOf(Deferred.fromCoroutine(templates.start([None])))
        templates[None].broken("socket closed")
        templates.close()
        self.reactor.advance(10)
        self.assertEqual(len(self.launched), 1)

    def test_stop(self) -> None:
        """Stopping cancels a pending restart and forgets every template."""
        templates = self.make()
        self.successResultOf(Deferred.fromCoroutine(templates.start([None, 0])))
        templates[0].broken("socket closed")
        self.assertEqual(len(self.reactor.getDelayedCalls()), 1)
        self.successResultOf(Deferred.fromCoroutine(templates.stop()))
        self.assertEqual(self.reactor.getDelayedCalls(), [])
        self.assertEqual(len(templates), 0)
        self.reactor.advance(10)
        self.assertEqual(len(self.launched), 2)
