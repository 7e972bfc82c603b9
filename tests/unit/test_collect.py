"""
L{kcoral.server.sandbox.collect}: a helper process's output is kept within
bounds (the first or the last bytes), its stdin is fed and closed, and it
is killed once its time is up, on a memory reactor and a fake clock.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import CancelledError
from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from kcoral.server.sandbox.collect import (
    BoundedOutputProtocol,
    Finished,
    Sink,
    kill_group,
    kill_process,
    run_bounded,
    start_bounded,
)
from kcoral.testing.fakes import FakeTransport, ProcessReactor


class BoundedOutputProtocolTests(SynchronousTestCase):
    """What L{BoundedOutputProtocol} keeps of each sink."""

    def ended(self, protocol: BoundedOutputProtocol, reason: BaseException) -> Finished:
        protocol.processEnded(Failure(reason))
        return self.successResultOf(protocol.ended)

    def test_head_is_kept(self) -> None:
        """A head sink keeps its first bytes, in arrival order across its descriptors."""
        protocol = BoundedOutputProtocol({"out": Sink((1, 2), 5)})
        protocol.childDataReceived(1, b"abc")
        protocol.childDataReceived(2, b"def")
        protocol.childDataReceived(1, b"ghi")
        finished = self.ended(protocol, ProcessDone(0))
        self.assertEqual(bytes(finished.output["out"]), b"abcde")
        self.assertEqual(finished.overflowed, frozenset({"out"}))

    def test_tail_is_kept(self) -> None:
        """A tail sink keeps its last bytes."""
        protocol = BoundedOutputProtocol({"out": Sink((1,), 4, tail=True)})
        for chunk in (b"abc", b"def", b"gh"):
            protocol.childDataReceived(1, chunk)
        finished = self.ended(protocol, ProcessDone(0))
        self.assertEqual(bytes(finished.output["out"]), b"efgh")
        self.assertEqual(finished.overflowed, frozenset({"out"}))

    def test_within_bounds(self) -> None:
        """Output within the limit is kept whole and overflows nothing."""
        protocol = BoundedOutputProtocol({"out": Sink((1,), 6), "tail": Sink((2,), 6, tail=True)})
        protocol.childDataReceived(1, b"abcdef")
        protocol.childDataReceived(2, b"xyz")
        finished = self.ended(protocol, ProcessDone(0))
        self.assertEqual(
            {name: bytes(kept) for name, kept in finished.output.items()},
            {"out": b"abcdef", "tail": b"xyz"},
        )
        self.assertEqual(finished.overflowed, frozenset())

    def test_sinks_apart(self) -> None:
        """Each sink has its own descriptors and bound; other descriptors are dropped."""
        protocol = BoundedOutputProtocol({"answer": Sink((5,), 3), "err": Sink((1, 2), 100)})
        protocol.childDataReceived(5, b"answer")
        protocol.childDataReceived(2, b"warning")
        protocol.childDataReceived(7, b"ignored")
        finished = self.ended(protocol, ProcessDone(0))
        self.assertEqual(bytes(finished.output["answer"]), b"ans")
        self.assertEqual(bytes(finished.output["err"]), b"warning")
        self.assertEqual(finished.overflowed, frozenset({"answer"}))

    def test_exit_status(self) -> None:
        """An exit code is the status; a signal is its negative, with no exit code."""
        exited = self.ended(BoundedOutputProtocol({}), ProcessTerminated(exitCode=3))
        self.assertEqual((exited.exit_code, exited.signal, exited.status), (3, None, 3))
        killed = self.ended(BoundedOutputProtocol({}), ProcessTerminated(signal=9))
        self.assertEqual((killed.exit_code, killed.signal, killed.status), (None, 9, -9))
        done = self.ended(BoundedOutputProtocol({}), ProcessDone(0))
        self.assertEqual((done.exit_code, done.status, done.timed_out), (0, 0, False))

    def test_stdin(self) -> None:
        """The input is written to the child's stdin, which is then closed."""
        protocol = BoundedOutputProtocol({}, stdin=b"request")
        transport = FakeTransport(pid=1)
        protocol.makeConnection(transport)  # type: ignore[arg-type]
        self.assertEqual(transport.written, {0: b"request"})
        self.assertTrue(transport.stdin_closed)

    def test_no_stdin(self) -> None:
        """Without input nothing is written; stdin is still closed."""
        protocol = BoundedOutputProtocol({})
        transport = FakeTransport(pid=1)
        protocol.makeConnection(transport)  # type: ignore[arg-type]
        self.assertEqual(transport.written, {})
        self.assertTrue(transport.stdin_closed)


class RunBoundedTests(SynchronousTestCase):
    """L{run_bounded} spawns, waits for the end, and kills on the reactor's clock."""

    def setUp(self) -> None:
        self.reactor = ProcessReactor()

    def run_one(self, **kwargs: Any) -> Any:
        kwargs.setdefault("sinks", {"out": Sink((1, 2), 10)})
        kwargs.setdefault("timeout", 5.0)
        return run_bounded(self.reactor, "/bin/true", ["/bin/true", "x"], env={"A": "1"}, **kwargs)

    def test_spawn(self) -> None:
        """The command, its environment and the descriptors of its sinks are spawned."""
        self.run_one(sinks={"answer": Sink((5,), 10), "err": Sink((1, 2), 10)})
        [spawned] = self.reactor.spawned
        self.assertEqual(spawned["executable"], "/bin/true")
        self.assertEqual(spawned["args"], ["/bin/true", "x"])
        self.assertEqual(spawned["env"], {"A": "1"})
        self.assertEqual(spawned["childFDs"], {0: "w", 1: "r", 2: "r", 5: "r"})

    def test_ends_before_its_time(self) -> None:
        """A process that ends in time fires the result, its timer cancelled."""
        d = self.run_one()
        self.assertNoResult(d)
        protocol = self.reactor.spawned[0]["protocol"]
        protocol.childDataReceived(1, b"hello")
        protocol.processEnded(Failure(ProcessDone(0)))
        finished = self.successResultOf(d)
        self.assertEqual((finished.status, finished.timed_out), (0, False))
        self.assertEqual(bytes(finished.output["out"]), b"hello")
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_killed_on_time(self) -> None:
        """Past its timeout the process is SIGKILLed; the result waits for its end."""
        d = self.run_one(timeout=5.0)
        transport = self.reactor.spawned[0]["transport"]
        self.reactor.advance(4.9)
        self.assertEqual(transport.signals, [])
        self.reactor.advance(0.2)
        self.assertEqual(transport.signals, ["KILL"])
        self.assertNoResult(d)
        self.reactor.spawned[0]["protocol"].processEnded(Failure(ProcessTerminated(signal=9)))
        finished = self.successResultOf(d)
        self.assertEqual((finished.timed_out, finished.status), (True, -9))

    def test_custom_kill(self) -> None:
        """The C{kill} given is what ends a process past its time."""
        killed: list[Any] = []
        self.run_one(kill=killed.append)
        self.reactor.advance(5.0)
        self.assertEqual(killed, [self.reactor.spawned[0]["transport"]])


class StartBoundedTests(SynchronousTestCase):
    """L{start_bounded}: the running process, whose cancelled wait kills it."""

    def setUp(self) -> None:
        self.reactor = ProcessReactor()
        self.run = start_bounded(
            self.reactor, "/bin/true", ["/bin/true"], env={}, sinks={}, timeout=5.0
        )
        self.spawned = self.reactor.spawned[0]

    def end(self) -> None:
        self.spawned["protocol"].processEnded(Failure(ProcessTerminated(signal=9)))

    def test_cancelled_wait_kills(self) -> None:
        """
        Cancelling L{BoundedRun.wait} kills the process at once; the wait
        fails then, and L{BoundedRun.finished} fires once it has ended.
        """
        wait = self.run.wait()
        wait.cancel()
        self.failureResultOf(wait, CancelledError)
        self.assertEqual(self.spawned["transport"].signals, ["KILL"])
        self.assertNoResult(self.run.finished)
        self.end()
        finished = self.successResultOf(self.run.finished)
        self.assertEqual((finished.status, finished.timed_out), (-9, False))
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_waits_after_the_end(self) -> None:
        """A wait begun after the end fires at once."""
        self.end()
        self.assertEqual(self.successResultOf(self.run.wait()).status, -9)
        self.assertEqual(self.successResultOf(self.run.finished).status, -9)


class KillTests(SynchronousTestCase):
    """The two ways a helper process is killed."""

    def test_kill_process(self) -> None:
        """L{kill_process} signals the process; one already gone is no error."""
        transport = FakeTransport(pid=1)
        kill_process(transport)  # type: ignore[arg-type]
        self.assertEqual(transport.signals, ["KILL"])

        class Gone(FakeTransport):
            def signalProcess(self, signal: str) -> None:
                from twisted.internet.error import ProcessExitedAlready

                raise ProcessExitedAlready()

        kill_process(Gone(pid=1))  # type: ignore[arg-type]

    def test_kill_group_without_a_group(self) -> None:
        """
        L{kill_group} falls back to the process itself where no group of its
        pid exists (above Linux's largest pid, so none can).
        """
        transport = FakeTransport(pid=2**22 + 7)
        kill_group(transport)  # type: ignore[arg-type]
        self.assertEqual(transport.signals, ["KILL"])

    def test_kill_group_without_a_pid(self) -> None:
        """A process already reaped (no pid) is left alone."""
        transport = FakeTransport(pid=1)
        transport.pid = None  # type: ignore[assignment]
        kill_group(transport)  # type: ignore[arg-type]
        self.assertEqual(transport.signals, [])
