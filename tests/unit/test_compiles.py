"""
L{kcoral.server.workers.compiles}: the server computes the cache key of a worker's
compile from the request it sent, never from the compile's answer (issue
32, item 1), checks the request before a sandbox starts, and answers from
the cache when the entry is there.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer

from kcoral.compilers.cache import CompileCache, cache_key
from kcoral.compilers.interfaces import ICommandLineBackend
from kcoral.compilers.isolated import ANSWER_FD
from kcoral.errors import ExecutionError
from kcoral.server.workers.compiles import IsolatedCompiles, check_request, parse_answer
from kcoral.testing.fakes import FakeCompilerBackend, FakeSandbox, ProcessReactor
from kcoral.wire.channel import CompileDone, CompileRequest

KERNEL = "__global__ void k(float *p) { p[0] = 1.0f; }\n"


def _sync(f: Any, *args: Any, **kw: Any) -> Deferred[Any]:
    return succeed(f(*args, **kw))


def _request(**kw: Any) -> CompileRequest:
    fields: dict[str, Any] = {
        "source": KERNEL,
        "arch": "sm_90a",
        "options": ["-O3"],
        "backend": "fake",
        "timeout": 30.0,
    }
    fields.update(kw)
    return CompileRequest(**fields)


class CheckRequestTests(SynchronousTestCase):
    """L{check_request} refuses what no compile should see."""

    def test_refused(self) -> None:
        """Bad arch, unsafe or unknown flags and C{-I} are C{parse} errors."""
        for request in (
            _request(arch="sm_90a\n"),
            _request(arch="sm_90a; id"),
            _request(options=["-DX=$(id)"], backend="nvcc"),
            _request(options=["-D", "X=`id`"], backend="tvmffi"),
            _request(options=["--options-file", "f"], backend="nvcc"),
            _request(options=["-Iinclude"]),
            _request(options=["--include-path=x"]),
        ):
            with self.assertRaises(ExecutionError) as ctx:
                check_request(request)
            self.assertEqual(ctx.exception.kind, "parse", request)

    def test_allowed(self) -> None:
        """Ordinary flags pass."""
        check_request(_request(options=["-O3", "-DBLOCK=128", "-lineinfo"], backend="nvcc"))


class ParseAnswerTests(SynchronousTestCase):
    """L{parse_answer} takes a line and exactly the image it announces."""

    def test_image(self) -> None:
        """C{{seconds, size}} then C{size} bytes."""
        self.assertEqual(
            parse_answer(b'{"seconds": 0.5, "size": 3}\nabc'),
            ({"seconds": 0.5, "size": 3}, b"abc"),
        )

    def test_error(self) -> None:
        """C{{kind, error}}: no image."""
        fields, image = parse_answer(b'{"kind": "compile", "error": "x"}\n') or ({}, b"?")
        self.assertEqual((fields["kind"], image), ("compile", b""))

    def test_malformed(self) -> None:
        """No newline, not an object, a wrong size or bad seconds: C{None}."""
        for answer in (
            b"",
            b'{"seconds": 1, "size": 0}',
            b"[1]\n",
            b"nonsense\n",
            b'{"seconds": 1, "size": 4}\nabc',
            b'{"seconds": 1, "size": 2}\nabc',
            b'{"seconds": -1, "size": 0}\n',
            b'{"seconds": "1", "size": 0}\n',
        ):
            self.assertIsNone(parse_answer(answer), answer)


class _Seats(FakeSandbox):
    """A L{FakeSandbox} whose seats exist (the server removes them)."""

    def prepare_seat(self, seat_dir: Path) -> Path:
        work = super().prepare_seat(seat_dir)
        work.mkdir(parents=True)
        return work


class IsolatedCompilesTests(SynchronousTestCase):
    """The parent's side of a compile, on a memory reactor."""

    def setUp(self) -> None:
        self.dir = Path(tempfile.mkdtemp())
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.reactor = ProcessReactor()
        self.backend = FakeCompilerBackend()
        self.compiles = IsolatedCompiles(
            self.reactor,
            _Seats(),
            str(self.dir / "cache"),
            self.dir / "scratch",
            _sync,
            lookup_backend=self._lookup,
        )
        (self.dir / "scratch").mkdir()

    def _lookup(self, name: str) -> Any:
        if name != self.backend.name:
            raise ExecutionError("unavailable", f"no backend {name!r}")
        return self.backend

    def _key(self, request: CompileRequest) -> str:
        return cache_key(
            request.source,
            request.arch,
            tuple(request.options),
            self.backend.name,
            self.backend.versions(),
        )

    def _answer(self, data: bytes) -> Deferred[CompileDone]:
        """Start a compile of L{_request}; its answer descriptor says C{data}."""
        d = Deferred.fromCoroutine(self.compiles.compile(_request(), 30.0))
        self.assertNoResult(d)
        spawned = self.reactor.spawned[-1]
        self.assertEqual(
            spawned["childFDs"], {0: "w", 1: "r", 2: "r", ANSWER_FD: "r"}, spawned["childFDs"]
        )
        sent = json.loads(spawned["transport"].written.get(0, b"") or b"{}")
        self.assertEqual(sent["source"], KERNEL)
        protocol = spawned["protocol"]
        protocol.childDataReceived(ANSWER_FD, data)
        protocol.processEnded(Failure(ProcessDone(0)))
        return d

    def test_key_from_the_request(self) -> None:
        """The image is stored under the key of the request the server sent."""
        done = self.successResultOf(self._answer(b'{"seconds": 0.25, "size": 5}\nIMAGE'))
        key = self._key(_request())
        self.assertEqual(
            (done.key, done.seconds, done.cached, done.error), (key, 0.25, False, None)
        )
        self.assertEqual(CompileCache(str(self.dir / "cache")).read(key), (b"IMAGE", 0.25))

    def test_a_forged_key_is_ignored(self) -> None:
        """
        An answer naming another key (the attack of issue 32, item 1)
        stores nothing there: the answer's key is not read.
        """
        victim = "ab" * 32
        forged = json.dumps({"key": victim, "seconds": 0.0, "size": 4}).encode() + b"\nEVIL"
        done = self.successResultOf(self._answer(forged))
        cache = CompileCache(str(self.dir / "cache"))
        self.assertIsNone(cache.read(victim))
        self.assertEqual(done.key, self._key(_request()))
        self.assertEqual(cache.read(done.key), (b"EVIL", 0.0))

    def test_the_old_answer_on_stdout_is_not_an_answer(self) -> None:
        """A key line on stdout (the old answer channel) is no answer at all."""
        d = Deferred.fromCoroutine(self.compiles.compile(_request(), 30.0))
        protocol = self.reactor.spawned[-1]["protocol"]
        protocol.childDataReceived(1, json.dumps({"key": "ab" * 32, "seconds": 0}).encode())
        protocol.processEnded(Failure(ProcessDone(0)))
        done = self.successResultOf(d)
        self.assertEqual(done.kind, "compile")
        self.assertEqual(list((self.dir / "cache").glob("*.bin")), [])

    def test_malformed_answer(self) -> None:
        """A truncated answer (the compile was killed) stores nothing."""
        done = self.successResultOf(self._answer(b'{"seconds": 0.25, "size": 50}\nIMA'))
        self.assertEqual(done.kind, "compile")
        self.assertEqual(list((self.dir / "cache").glob("*.bin")), [])

    def test_compile_error(self) -> None:
        """A C{{kind, error}} answer is passed on."""
        done = self.successResultOf(self._answer(b'{"kind": "compile", "error": "bad"}\n'))
        self.assertEqual((done.kind, done.error, done.key), ("compile", "bad", ""))

    def test_hit_without_a_compile(self) -> None:
        """An entry already stored is answered at once, C{cached}, with no sandbox."""
        key = self._key(_request())
        CompileCache(str(self.dir / "cache")).put(key, b"IMAGE", 1.5)
        done = self.successResultOf(Deferred.fromCoroutine(self.compiles.compile(_request(), 30.0)))
        self.assertEqual((done.key, done.seconds, done.cached), (key, 1.5, True))
        self.assertEqual(self.reactor.spawned, [])

    def test_refused_without_a_sandbox(self) -> None:
        """A refused flag or an unknown backend answers with no sandbox started."""
        for request, kind in (
            (_request(options=["-DX=$(id)"], backend="nvcc"), "parse"),
            (_request(backend="nothing"), "unavailable"),
        ):
            done = self.successResultOf(
                Deferred.fromCoroutine(self.compiles.compile(request, 30.0))
            )
            self.assertEqual(done.kind, kind)
        self.assertEqual(self.reactor.spawned, [])

    def test_killed_after_its_time(self) -> None:
        """A compile past its timeout and grace is killed."""
        d = Deferred.fromCoroutine(self.compiles.compile(_request(), 5.0))
        transport = self.reactor.spawned[-1]["transport"]
        self.reactor.advance(16.0)
        self.assertEqual(transport.signals, ["KILL"])
        self.reactor.spawned[-1]["protocol"].processEnded(Failure(ProcessTerminated(signal=9)))
        self.assertEqual(self.successResultOf(d).kind, "compile")


class ConfirmedTests(IsolatedCompilesTests):
    """
    A backend without a command line is available to the server's own
    programs only once a sandboxed compile found it so (checking here
    would load it into the server).
    """

    def _image(self, available: bool) -> Deferred[tuple[CompileDone, bytes | None]]:
        return Deferred.fromCoroutine(
            self.compiles.compile_image(_request(), 30.0, available=available)
        )

    def test_unconfirmed_is_unavailable(self) -> None:
        """Not confirmed yet: C{unavailable}, no sandbox, before any other check."""
        done, image = self.successResultOf(
            Deferred.fromCoroutine(
                self.compiles.compile_image(_request(arch="bad"), 30.0, available=True)
            )
        )
        self.assertEqual((done.kind, image), ("unavailable", None))
        self.assertEqual(self.reactor.spawned, [])

    def test_confirmed_by_a_compile(self) -> None:
        """An answer from the sandbox confirms it; an C{unavailable} one withdraws it."""
        self.successResultOf(self._answer(b'{"kind": "compile", "error": "bad"}\n'))
        self.assertEqual(self.compiles.confirmed, {"fake"})
        d = self._image(True)
        protocol = self.reactor.spawned[-1]["protocol"]
        protocol.childDataReceived(ANSWER_FD, b'{"seconds": 0.25, "size": 5}\nIMAGE')
        protocol.processEnded(Failure(ProcessDone(0)))
        done, image = self.successResultOf(d)
        self.assertEqual((done.error, image), (None, b"IMAGE"))
        # The same request again: a hit, with its image.
        done, image = self.successResultOf(self._image(True))
        self.assertEqual((done.cached, image), (True, b"IMAGE"))
        d = Deferred.fromCoroutine(self.compiles.compile(_request(arch="sm_80"), 30.0))
        protocol = self.reactor.spawned[-1]["protocol"]
        protocol.childDataReceived(ANSWER_FD, b'{"kind": "unavailable", "error": "gone"}\n')
        protocol.processEnded(Failure(ProcessDone(0)))
        self.assertEqual(self.successResultOf(d).kind, "unavailable")
        self.assertEqual(self.compiles.confirmed, set())

    def test_cancelled_compile_is_killed(self) -> None:
        """
        Cancelling the wait kills the sandbox at once; its seat goes only
        once the process has ended.
        """
        d = self._image(False)
        spawned = self.reactor.spawned[-1]
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertEqual(spawned["transport"].signals, ["KILL"])
        seat = self.dir / "scratch" / "compile-1"
        self.assertTrue(seat.exists())
        spawned["protocol"].processEnded(Failure(ProcessTerminated(signal=9)))
        self.assertFalse(seat.exists())
        self.assertEqual(list((self.dir / "cache").glob("*.bin")), [])

    def test_cancelled_while_the_seat_is_made(self) -> None:
        """A seat made after its wait was cancelled is removed once made."""
        making: list[tuple[Deferred[Any], Any, tuple[Any, ...]]] = []

        def run_blocking(f: Any, *args: Any) -> Deferred[Any]:
            if f == self.compiles.sandbox.prepare_seat:
                making.append((Deferred(), f, args))
                return making[-1][0]
            return _sync(f, *args)

        self.compiles.run_blocking = run_blocking
        d = self._image(False)
        d.cancel()
        self.failureResultOf(d, CancelledError)
        made, f, args = making[0]
        made.callback(f(*args))
        self.assertEqual(self.reactor.spawned, [])
        self.assertFalse((self.dir / "scratch" / "compile-1").exists())


@implementer(ICommandLineBackend)
class _CommandBackend(FakeCompilerBackend):
    """A fake whose compile is one command line (as nvcc's is)."""

    def command(
        self, source_path: str, output_path: str, arch: str, options: tuple[str, ...], tmpdir: str
    ) -> tuple[list[str], dict[str, str]]:
        return ["/opt/cc", f"-arch={arch}", *options, "-o", output_path, source_path], {
            "TMPDIR": tmpdir
        }


class CommandCompileTests(SynchronousTestCase):
    """
    A backend that provides L{ICommandLineBackend} is run directly in the
    sandbox: no Python there and no answer to forge; the server takes the
    exit status and the file the command wrote, under the request's key.
    """

    def setUp(self) -> None:
        self.dir = Path(tempfile.mkdtemp())
        self.addCleanup(shutil.rmtree, self.dir, True)
        (self.dir / "scratch").mkdir()
        self.reactor = ProcessReactor()
        self.backend = _CommandBackend()
        self.compiles = IsolatedCompiles(
            self.reactor,
            _Seats(),
            str(self.dir / "cache"),
            self.dir / "scratch",
            _sync,
            lookup_backend=lambda name: self.backend,
        )

    def _start(self) -> tuple[Deferred[CompileDone], dict[str, Any], Path]:
        d = Deferred.fromCoroutine(self.compiles.compile(_request(), 30.0))
        spawned = self.reactor.spawned[-1]
        work = self.dir / "scratch" / "compile-1" / "work"
        return d, spawned, work

    def _end(self, spawned: dict[str, Any], code: int, output: bytes = b"") -> None:
        protocol = spawned["protocol"]
        if output:
            protocol.childDataReceived(2, output)
        reason = ProcessDone(0) if code == 0 else ProcessTerminated(exitCode=code)
        protocol.processEnded(Failure(reason))

    def test_command_and_key(self) -> None:
        """The backend's own command runs; its image is stored under the request's key."""
        d, spawned, work = self._start()
        self.assertEqual(spawned["executable"], "/opt/cc")
        self.assertIn("-O3", spawned["args"])
        self.assertEqual((work / "kernel.cu").read_text(), KERNEL)
        self.assertEqual(spawned["env"], {"TMPDIR": str(work)})
        (work / "module.bin").write_bytes(b"IMAGE")
        self._end(spawned, 0, b'{"key": "' + b"ab" * 32 + b'"}\n')
        done = self.successResultOf(d)
        key = cache_key(KERNEL, "sm_90a", ("-O3",), "fake", self.backend.versions())
        self.assertEqual((done.key, done.error, done.cached), (key, None, False))
        cache = CompileCache(str(self.dir / "cache"))
        self.assertEqual(cache.read(key)[0], b"IMAGE")  # type: ignore[index]
        self.assertIsNone(cache.read("ab" * 32))
        self.assertFalse((self.dir / "scratch" / "compile-1").exists())

    def test_failure(self) -> None:
        """A non-zero exit is a C{compile} error with the workspace path stripped."""
        d, spawned, work = self._start()
        (work / "module.bin").write_bytes(b"IMAGE")
        self._end(spawned, 2, f"{work}/kernel.cu(1): error: bad\n".encode())
        done = self.successResultOf(d)
        self.assertEqual(done.kind, "compile")
        self.assertIn("exit status 2", done.error or "")
        self.assertIn("kernel.cu(1): error: bad", done.error or "")
        self.assertNotIn(str(work), done.error or "")
        self.assertEqual(list((self.dir / "cache").glob("*.bin")), [])

    def test_output_not_a_regular_file(self) -> None:
        """A link (or FIFO) left as the output is not followed: nothing is stored."""
        secret = self.dir / "secret"
        secret.write_bytes(b"server secret")
        d, spawned, work = self._start()
        os.symlink(secret, work / "module.bin")
        self._end(spawned, 0)
        done = self.successResultOf(d)
        self.assertEqual(done.kind, "compile")
        self.assertEqual(list((self.dir / "cache").glob("*.bin")), [])

    def test_timeout(self) -> None:
        """Past its timeout the command is killed and the compile fails."""
        d, spawned, work = self._start()
        self.reactor.advance(30.0)
        self.assertEqual(spawned["transport"].signals, ["KILL"])
        self._end(spawned, 137)
        self.assertEqual(self.successResultOf(d).error, "nvcc timed out after 30s")

    def test_command_refused_leaves_no_seat(self) -> None:
        """A command the backend refuses (no toolchain here) leaves no seat behind."""

        def refuse(*args: Any) -> Any:
            raise ExecutionError("unavailable", "nvcc not found")

        self.backend.command = refuse  # type: ignore[method-assign]
        done = self.successResultOf(Deferred.fromCoroutine(self.compiles.compile(_request(), 30.0)))
        self.assertEqual((done.kind, done.error), ("unavailable", "nvcc not found"))
        self.assertEqual(self.reactor.spawned, [])
        self.assertEqual(list((self.dir / "scratch").iterdir()), [])

    def test_answer_does_not_wait_for_the_seat(self) -> None:
        """
        The answer goes once the image is stored; the seat is removed in a
        thread after it (a slow filesystem's C{rmdir} holds no compile),
        and a removal that fails is logged.
        """
        removals: list[Deferred[Any]] = []

        def run_blocking(f: Any, *args: Any) -> Deferred[Any]:
            if f.__name__ == "remove_seat":
                removals.append(Deferred())
                return removals[-1]
            return _sync(f, *args)

        self.compiles.run_blocking = run_blocking
        d, spawned, work = self._start()
        (work / "module.bin").write_bytes(b"IMAGE")
        self._end(spawned, 0)
        done = self.successResultOf(d)
        self.assertEqual((done.kind, done.cached), (None, False))
        self.assertEqual(len(removals), 1)
        removals[0].errback(Failure(OSError("busy")))
        self.assertEqual(len(self.flushLoggedErrors(OSError)), 1)


class CommandImageTests(CommandCompileTests):
    """L{IsolatedCompiles.compile_image} with a command-line backend."""

    def test_image_and_availability(self) -> None:
        """The image comes back with the answer; C{available} asks the backend first."""
        d = Deferred.fromCoroutine(self.compiles.compile_image(_request(), 30.0, available=True))
        spawned = self.reactor.spawned[-1]
        work = self.dir / "scratch" / "compile-1" / "work"
        (work / "module.bin").write_bytes(b"IMAGE")
        self._end(spawned, 0)
        done, image = self.successResultOf(d)
        self.assertEqual((done.error, done.cached, image), (None, False, b"IMAGE"))
        self.backend.available = lambda: (False, "nvcc is not on PATH")  # type: ignore[method-assign]
        done, image = self.successResultOf(
            Deferred.fromCoroutine(self.compiles.compile_image(_request(), 30.0, available=True))
        )
        self.assertEqual(
            (done.kind, done.error, image),
            ("unavailable", "compiler backend 'fake' is unavailable: nvcc is not on PATH", None),
        )
        # Without C{available} (a worker's request: it checked), the entry is answered.
        done, image = self.successResultOf(
            Deferred.fromCoroutine(self.compiles.compile_image(_request(), 30.0))
        )
        self.assertEqual((done.cached, image), (True, b"IMAGE"))

    def test_cancelled_during_the_store(self) -> None:
        """Cancelled while its image is stored: the seat goes once the store is done."""
        stores: list[tuple[Deferred[Any], Any, tuple[Any, ...]]] = []

        def run_blocking(f: Any, *args: Any) -> Deferred[Any]:
            if f.__name__ == "_store_output":
                stores.append((Deferred(), f, args))
                return stores[-1][0]
            return _sync(f, *args)

        self.compiles.run_blocking = run_blocking
        d, spawned, work = self._start()
        (work / "module.bin").write_bytes(b"IMAGE")
        self._end(spawned, 0)
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertTrue(work.exists())
        stored, f, args = stores[0]
        stored.callback(f(*args))
        self.assertFalse(work.exists())


class FilterDescriptorTests(CommandCompileTests):
    """The compile filter reaches bwrap on a descriptor of its own, mapped by the spawn."""

    def test_filter_mapped_and_closed(self) -> None:
        """Each compile opens the filter afresh, maps it to SECCOMP_FD, and closes its copy."""
        from kcoral.server.sandbox.bubblewrap import SECCOMP_FD

        filter_path = self.dir / "compile.bpf"
        filter_path.write_bytes(b"filter")
        self.compiles.sandbox.compile_filter = str(filter_path)  # type: ignore[misc]
        asked: list[bool] = []
        compile_command = self.compiles.sandbox.compile_command

        def recording(*args: Any, filter_fd: bool = False) -> Any:
            asked.append(filter_fd)
            return compile_command(*args)

        self.compiles.sandbox.compile_command = recording  # type: ignore[method-assign]
        d, spawned, work = self._start()
        fd = spawned["childFDs"][SECCOMP_FD]
        self.assertIsInstance(fd, int)
        self.assertEqual(asked, [True])
        with self.assertRaises(OSError):
            os.fstat(fd)
        (work / "module.bin").write_bytes(b"IMAGE")
        self._end(spawned, 0)
        self.assertEqual(self.successResultOf(d).error, None)

    def test_no_filter_no_descriptor(self) -> None:
        """Without a compile filter nothing is mapped (the sandbox's own command line)."""
        from kcoral.server.sandbox.bubblewrap import SECCOMP_FD

        d, spawned, work = self._start()
        self.assertNotIn(SECCOMP_FD, spawned["childFDs"])
        self._end(spawned, 1)
        self.successResultOf(d)


class CompileSeatTests(SynchronousTestCase):
    """An nvcc compile's seat under bubblewrap holds only what nvcc writes to."""

    def test_only_tmp(self) -> None:
        """The workspace and C{.kcoral/tmp}, private; nothing else of the worker layout."""
        from kcoral.server.sandbox.bubblewrap import BubblewrapSandbox

        base = Path(tempfile.mkdtemp())
        self.addCleanup(shutil.rmtree, base, True)
        work = BubblewrapSandbox([]).prepare_compile_seat(base / "seat")
        self.assertEqual(work, (base / "seat" / "work").resolve())
        self.assertEqual(
            sorted(str(p.relative_to(work)) for p in work.rglob("*")),
            [".kcoral", ".kcoral/tmp"],
        )
        self.assertEqual(os.stat(work / ".kcoral" / "tmp").st_mode & 0o777, 0o700)
