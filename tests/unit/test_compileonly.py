"""
L{kcoral.server.workers.compileonly}: which programs the server runs itself
(L{is_compile_only}), and that its answer is the worker's: the same
programs run through the worker's engine (its builtin, its remote compile
over a channel, its cache read) and through L{ParentCompiles}, each told
the same thing by one scripted parent compile, end in the same outcome.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from kcoral import compilers
from kcoral.compilers.cache import CompileCache
from kcoral.compilers.call import CudaSource, compile_call
from kcoral.compilers.nvcc import find_nvcc
from kcoral.compilers.tvmffi import TvmFfiBackend, is_host_function
from kcoral.ipc.channel_io import read_message, write_message
from kcoral.server.workers.compileonly import (
    INLINE_ENCODE_BYTES,
    PARENT_COMPILES_ENV,
    ParentCompiles,
    is_compile_only,
    parent_compiles_allowed,
)
from kcoral.server.workers.job import Job, JobResult
from kcoral.testing.fakes import RecordingLease
from kcoral.wire.channel import CompileDone, CompileRequest, Execute, Outcome
from kcoral.wire.program import BUILTIN_NAMES, GetFunction, Program, Upload, parse_program
from kcoral.worker.builtins import cpu_builtins
from kcoral.worker.devices import CpuBackend
from kcoral.worker.engine import Engine
from kcoral.worker.remote_compile import RemoteCompiler

KERNEL = "__global__ void scale(float *p, float a) { p[threadIdx.x] *= a; }\n"
HOST = (
    "__global__ void k(float *x) { x[0] = 1; }\n"
    "void add_one(tvm::ffi::TensorView x, tvm::ffi::TensorView y) { k<<<1, 1>>>(nullptr); }\n"
)


def upload(id: str = "src", source: str = KERNEL, **kw: Any) -> dict[str, Any]:
    return {"op": "upload", "kind": "module", "id": id, "language": "cuda", "source": source, **kw}


def function(id: str = "fn", module: str = "src", name: str = "scale") -> dict[str, Any]:
    return {"op": "get_function", "id": id, "module": {"$ref": module}, "name": name}


def compile_run(id: str = "image", fn: str = "fn", *cfg: Any) -> dict[str, Any]:
    args: list[Any] = [{"$ref": fn}, *cfg]
    return {"op": "run", "id": id, "fn": "builtin.compile_cuda_binary", "args": args}


def ret(key: str = "image", value: str = "image") -> dict[str, Any]:
    return {"op": "return", "key": key, "value": {"$ref": value}}


def program(*instructions: dict[str, Any], **options: Any) -> Program:
    body: dict[str, Any] = {"instructions": list(instructions)}
    if options:
        body["options"] = options
    return parse_program(json.dumps(body).encode(), builtin_names=BUILTIN_NAMES)


ARCH = {"arch": "sm_90a", "extra_cuda_cflags": ["-O3"]}


class RecogniserTests(SynchronousTestCase):
    """L{is_compile_only}: strictly the shapes the server can answer as a worker would."""

    def test_compile_programs(self) -> None:
        """An upload, its function, its compile and the image's return; and variants."""
        for instructions in (
            [upload(), function(), compile_run("image", "fn", ARCH), ret()],
            [upload(), function(), compile_run("image", "fn", ARCH)],
            [upload(), function(), compile_run("image", "fn")],
            [upload(), function(), compile_run("image", "fn", {})],
            [upload(), function(), compile_run("image", "fn", {"arch": 90})],
            [upload(), function(), compile_run("image", "fn", {"arch": "x", "timeout_seconds": 5})],
            [upload(), function(), compile_run("image", "fn", {"extra_cuda_cflags": "-O3"})],
            [upload(), function(name="main"), compile_run("image", "fn", ARCH)],
            [
                upload(),
                upload("other", HOST),
                function(),
                function("host", "other", "add_one"),
                compile_run("a", "fn", ARCH),
                compile_run("b", "host", ARCH),
                ret("one", "a"),
                ret("two", "b"),
                ret("again", "a"),
            ],
            [upload(), {**function(), "cpu_only": True}, compile_run("image", "fn", ARCH), ret()],
        ):
            self.assertTrue(is_compile_only(program(*instructions)), instructions)

    def test_other_programs(self) -> None:
        """Anything else goes to a worker."""
        python = {"op": "upload", "kind": "module", "id": "py", "source": "def f(): pass\n"}
        blob = {"op": "upload", "kind": "bytes", "id": "b", "blob": "0" * 64}
        for instructions, options in (
            # No compile at all.
            ([upload(), function()], {}),
            # A Python module beside it, or a blob.
            ([python, upload(), function(), compile_run("image", "fn", ARCH)], {}),
            ([blob, upload(), function(), compile_run("image", "fn", ARCH)], {}),
            # The source passed as text, a handle that is not a function,
            # extra arguments, a cfg that is not an object.
            (
                [upload(), {**compile_run("image", "fn", ARCH), "args": [KERNEL, ARCH]}],
                {},
            ),
            ([upload(), function(), compile_run("image", "src", ARCH)], {}),
            ([upload(), function(), compile_run("image", "fn", ARCH, ARCH)], {}),
            ([upload(), function(), compile_run("image", "fn", "sm_90a")], {}),
            # A timeout the worker would fail with a Python exception.
            ([upload(), function(), compile_run("image", "fn", {"timeout_seconds": "5"})], {}),
            ([upload(), function(), compile_run("image", "fn", {"timeout_seconds": True})], {}),
            ([upload(), function(), compile_run("image", "fn", {"timeout_seconds": 10**400})], {}),
            # -I: never cached, compiled in the worker.
            (
                [
                    upload(),
                    function(),
                    compile_run("image", "fn", {"arch": "sm_90a", "extra_cuda_cflags": ["-Iinc"]}),
                ],
                {},
            ),
            # Another builtin, a run of the function itself.
            (
                [upload(), function(), {**compile_run("image", "fn", ARCH), "fn": "builtin.zeros"}],
                {},
            ),
            ([upload(), function(), {"op": "run", "id": "r", "fn": {"$ref": "fn"}}], {}),
            # Returns of anything but a compile's image, files.
            ([upload(), function(), compile_run("image", "fn", ARCH), ret("k", "fn")], {}),
            ([upload(), function(), compile_run("image", "fn", ARCH), ret("k", "src")], {}),
            (
                [
                    upload(),
                    function(),
                    compile_run("image", "fn", ARCH),
                    {"op": "return", "key": "f", "kind": "file", "path": "a"},
                ],
                {},
            ),
            # A GPU count.
            ([upload(), function(), compile_run("image", "fn", ARCH), ret()], {"gpu_count": 1}),
        ):
            self.assertFalse(is_compile_only(program(*instructions, **options)), instructions)

    def test_switch(self) -> None:
        """C{KCORAL_PARENT_COMPILES=0} turns it off; anything else leaves it on."""
        self.assertTrue(parent_compiles_allowed({}))
        self.assertTrue(parent_compiles_allowed({PARENT_COMPILES_ENV: "1"}))
        self.assertFalse(parent_compiles_allowed({PARENT_COMPILES_ENV: "0"}))


#: What the scripted parent answers: C{(CompileDone, image)} for a request.
Script = Callable[[CompileRequest], tuple[CompileDone, bytes | None]]


@attrs.define
class ScriptedCompiler:
    """An L{ImageCompiler} answering from a script, recording what it was asked."""

    script: Script
    asked: list[tuple[CompileRequest, float, bool]] = attrs.field(factory=list)
    pending: list[Deferred[tuple[CompileDone, bytes | None]]] | None = None
    #: The requests whose compile was cancelled (killed).
    cancelled: list[CompileRequest] = attrs.field(factory=list)

    async def compile_image(
        self, request: CompileRequest, timeout: float, *, available: bool = False
    ) -> tuple[CompileDone, bytes | None]:
        self.asked.append((request, timeout, available))
        if self.pending is not None:
            d: Deferred[tuple[CompileDone, bytes | None]] = Deferred(
                lambda _: self.cancelled.append(request)
            )
            self.pending.append(d)
            return await d
        return self.script(request)


def _sync(f: Any, *args: Any, **kw: Any) -> Deferred[Any]:
    return succeed(f(*args, **kw))


def _job(p: Program, *, timeout: float = 60.0, max_response_bytes: int = 1 << 20) -> Job:
    return Job(
        request_id="r",
        program_text="",
        program=p,
        blobs={},
        timeout_seconds=timeout,
        output_limit=1024,
        max_response_bytes=max_response_bytes,
    )


def _ok(request: CompileRequest) -> tuple[CompileDone, bytes | None]:
    image = b"\x7fELF" + request.backend.encode() + request.source.encode()
    return CompileDone(key=hashlib.sha256(image).hexdigest(), seconds=0.5), image


@attrs.define
class Both:
    """Runs a program through the worker's engine and through L{ParentCompiles}."""

    root: Path
    script: Script
    #: What the worker sent the parent.
    sent: list[Any] = attrs.field(factory=list)

    def worker(self, p: dict[str, Any], max_response_bytes: int) -> Outcome:
        """
        The worker's path: the engine's builtin, its L{RemoteCompiler} over
        an in-memory channel (the parent's answers written first), its read
        of the shared cache.
        """
        parsed = parse_program(json.dumps(p).encode(), builtin_names=BUILTIN_NAMES)
        cache = self.root / "cache"
        inbox = io.BytesIO()
        # Every compile's answer, in order: the engine stops at the first failure.
        for instruction in parsed.instructions:
            args = getattr(instruction, "args", None)
            if not args:
                continue
            try:
                source = _function_of(parsed, args[0].target)
                call = compile_call(source, *args[1:])
            except Exception:
                break
            request = CompileRequest(
                call.source, call.arch, list(call.flags), call.backend, call.timeout
            )
            done, image = self.script(request)
            if image is not None:
                CompileCache(str(cache)).put(done.key, image, done.seconds)
            write_message(inbox, done)
        inbox.seek(0)
        outbox = io.BytesIO()
        compilers._reset_for_tests()
        compilers.configure_cache(str(cache))
        compilers.configure_remote(RemoteCompiler(inbox, outbox))
        try:
            engine = Engine(CpuBackend(), RecordingLease(), cpu_builtins())
            workspace = self.root / f"ws{len(list(self.root.glob('ws*')))}"
            workspace.mkdir()
            outcome = engine.run(
                Execute(json.dumps(p), str(workspace), max_response_bytes=max_response_bytes)
            )
            engine.settle()
        finally:
            compilers._reset_for_tests()
        outbox.seek(0)
        while (message := read_message(outbox)) is not None:
            self.sent.append(message)
        return outcome

    def parent(
        self, p: dict[str, Any], max_response_bytes: int
    ) -> tuple[Deferred[JobResult | None], ScriptedCompiler]:
        """L{ParentCompiles}'s path, with the same script as the parent."""
        parsed = parse_program(json.dumps(p).encode(), builtin_names=BUILTIN_NAMES)
        assert is_compile_only(parsed), p
        compiler = ScriptedCompiler(self.script)
        parent = ParentCompiles(compiler, Clock(), _sync)
        job = _job(parsed, max_response_bytes=max_response_bytes)
        return Deferred.fromCoroutine(parent.run(job)), compiler


def _function_of(p: Program, target: str) -> Any:
    by_id = {i.id: i for i in p.instructions if getattr(i, "id", None)}
    get = by_id[target]
    assert isinstance(get, GetFunction)
    source = by_id[get.module.target]
    assert isinstance(source, Upload)
    return CudaSource(source.source or "").get_function(get.name)


def _comparable(outcome: Outcome) -> dict[str, Any]:
    """An outcome without what only a worker's path has (the traceback's frames)."""
    error = dict(outcome.error) if outcome.error else None
    if error is not None:
        error["traceback"] = error["traceback"].splitlines()[-1:]
    return {
        "status": outcome.status,
        "results": outcome.results,
        "error": error,
        "stdout": outcome.stdout,
        "stderr": outcome.stderr,
        "oversize": outcome.oversize,
        "parts": [bytes(part) for part in outcome.parts],  # type: ignore[arg-type]
    }


needs_nvcc = pytest.mark.skipif(
    find_nvcc()[0] is None, reason="the worker's builtin checks that nvcc is there"
)

#: Whether the worker's builtin finds the C{tvmffi} backend available.
TVM_FFI = TvmFfiBackend().available()[0]


@needs_nvcc
class EquivalenceTests(SynchronousTestCase):
    """
    The worker's engine and L{ParentCompiles}, told the same by the parent,
    end in the same outcome (the traceback's last line included).
    """

    def setUp(self) -> None:
        self.root = Path(tempfile.mkdtemp())
        self.addCleanup(shutil.rmtree, self.root, True)

    def check(
        self, p: dict[str, Any], script: Script = _ok, max_response_bytes: int = 1 << 20
    ) -> Outcome:
        both = Both(self.root, script)
        worker = both.worker(p, max_response_bytes)
        d, compiler = both.parent(p, max_response_bytes)
        result = self.successResultOf(d)
        assert result is not None and result.outcome is not None
        self.assertEqual(_comparable(result.outcome), _comparable(worker))
        # The parent was asked exactly what the worker would have asked it.
        self.assertEqual([asked[0] for asked in compiler.asked], both.sent)
        return result.outcome

    def test_images(self) -> None:
        """Two compiles, one returned twice: the same values and parts."""
        outcome = self.check(
            {
                "instructions": [
                    upload(),
                    function(),
                    function("again", "src", "scale"),
                    compile_run("a", "fn", ARCH),
                    compile_run("b", "again", {"arch": "sm_80", "timeout_seconds": 12}),
                    ret("one", "a"),
                    ret("two", "b"),
                    ret("three", "a"),
                ]
            }
        )
        self.assertEqual(outcome.status, "COMPLETED")
        self.assertEqual(len(outcome.parts), 3)

    @pytest.mark.skipif(
        not TVM_FFI, reason="no apache-tvm-ffi: the worker finds tvmffi unavailable"
    )
    def test_host_function(self) -> None:
        """A TVM-FFI host function is built by the C{tvmffi} backend, alike."""
        self.assertTrue(is_host_function(HOST, "add_one"))
        outcome = self.check(
            {
                "instructions": [
                    upload("other", HOST),
                    function("host", "other", "add_one"),
                    compile_run("b", "host", ARCH),
                    ret("two", "b"),
                ]
            }
        )
        part = outcome.parts[0]
        assert isinstance(part, bytes)
        self.assertTrue(part.startswith(b"\x7fELFtvmffi"))

    def test_call_errors(self) -> None:
        """The builtin's own checks, and get_function's, fail alike."""
        for instructions in (
            [upload(), function(), compile_run("image", "fn"), ret()],
            [upload(), function(), compile_run("image", "fn", {"arch": 90}), ret()],
            [
                upload(),
                function(),
                compile_run("image", "fn", {"arch": "sm_90a", "extra_cuda_cflags": "-O3"}),
            ],
            [upload(), function(name="main"), compile_run("image", "fn", ARCH), ret()],
            [upload(), function(name="1k"), compile_run("image", "fn", ARCH), ret()],
        ):
            outcome = self.check({"instructions": instructions})
            self.assertEqual(outcome.status, "FAILED")
            assert outcome.error is not None
            self.assertEqual(outcome.error["kind"], "parse")

    def test_parent_errors(self) -> None:
        """What the parent's compile answers (bad arch, bad flag, nvcc, timeout) fails alike."""
        for done in (
            CompileDone(kind="parse", error="invalid arch 'sm_xx'"),
            CompileDone(kind="parse", error="compiler flag not allowed: '--bogus'"),
            CompileDone(kind="compile", error="nvcc failed for sm_90a (exit status 1):\nbad"),
            CompileDone(kind="compile", error="nvcc timed out after 5s"),
            CompileDone(kind="engine", error="the compiled image could not be stored"),
            CompileDone(kind="weird", error="a kind no worker knows"),
            CompileDone(kind="compile"),
        ):
            outcome = self.check(
                {
                    "instructions": [
                        upload(),
                        function(),
                        compile_run("first", "fn", {"arch": "sm_80"}),
                        ret("kept", "first"),
                        compile_run("image", "fn", ARCH),
                        ret(),
                    ]
                },
                lambda request, done=done: (
                    _ok(request) if request.arch == "sm_80" else (done, None)
                ),
            )
            self.assertEqual(outcome.status, "FAILED")
            self.assertEqual(list(outcome.results), ["kept"])

    def test_over_the_response_limit(self) -> None:
        """Results over the response limit are left out alike (C{oversize})."""
        outcome = self.check(
            {"instructions": [upload(), function(), compile_run("image", "fn", ARCH), ret()]},
            max_response_bytes=16,
        )
        self.assertIsNotNone(outcome.oversize)


class ParentCompilesTests(SynchronousTestCase):
    """L{ParentCompiles} on a L{Clock}: budget, cancellation, what needs a worker."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.pending: list[Deferred[tuple[CompileDone, bytes | None]]] = []
        self.compiler = ScriptedCompiler(_ok, pending=self.pending)
        self.parent = ParentCompiles(self.compiler, self.clock, _sync)
        self.program = program(
            upload(), function(), compile_run("image", "fn", {**ARCH, "timeout_seconds": 30}), ret()
        )

    def test_compile_timeout_within_the_budget(self) -> None:
        """A compile gets its own timeout within what is left of the budget, at least 1 s."""
        d = Deferred.fromCoroutine(self.parent.run(_job(self.program, timeout=50.0)))
        self.assertEqual(self.compiler.asked[0][1:], (30.0, True))
        self.pending[0].callback(_ok(self.compiler.asked[0][0]))
        self.successResultOf(d)
        self.clock.advance(0)
        d = Deferred.fromCoroutine(self.parent.run(_job(self.program, timeout=10.0)))
        self.assertEqual(self.compiler.asked[1][1], 10.0)
        self.pending[1].callback(_ok(self.compiler.asked[1][0]))
        self.successResultOf(d)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_budget_spent(self) -> None:
        """When the budget runs out the compile is cancelled and the job ends C{timeout}."""
        d = Deferred.fromCoroutine(self.parent.run(_job(self.program, timeout=5.0)))
        self.clock.advance(5.0)
        result = self.successResultOf(d)
        self.assertEqual(result.ending, "timeout")
        self.assertEqual(self.compiler.cancelled, [self.compiler.asked[0][0]])

    def test_cancelled(self) -> None:
        """A cancelled run (the client left) cancels its compile and stops its timer."""
        d = Deferred.fromCoroutine(self.parent.run(_job(self.program)))
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertEqual(self.compiler.cancelled, [self.compiler.asked[0][0]])
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_unavailable_needs_a_worker(self) -> None:
        """A backend the server cannot run: no answer here (C{None}), the worker runs it."""
        d = Deferred.fromCoroutine(self.parent.run(_job(self.program)))
        self.pending[0].callback((CompileDone(kind="unavailable", error="no nvcc"), None))
        self.assertIsNone(self.successResultOf(d))

    def test_missing_image(self) -> None:
        """A compile that answers a key but no image fails as the worker's cache read would."""
        d = Deferred.fromCoroutine(self.parent.run(_job(self.program)))
        self.pending[0].callback((CompileDone(key="ab" * 32, seconds=1.0), None))
        outcome = self.successResultOf(d).outcome
        assert outcome is not None and outcome.error is not None
        self.assertEqual(
            (outcome.error["kind"], outcome.error["message"]),
            ("engine", "the compiled image is missing from the compile cache"),
        )

    def test_large_image_encoded_in_a_thread(self) -> None:
        """An image of L{INLINE_ENCODE_BYTES} or more is hashed off the reactor."""
        threaded: list[Any] = []

        def run_blocking(f: Any, *args: Any) -> Deferred[Any]:
            threaded.append(f)
            return succeed(f(*args))

        self.parent.run_blocking = run_blocking
        d = Deferred.fromCoroutine(self.parent.run(_job(self.program)))
        self.pending[0].callback((CompileDone(key="ab" * 32), b"x" * INLINE_ENCODE_BYTES))
        outcome = self.successResultOf(d).outcome
        assert outcome is not None
        self.assertEqual(outcome.results["image"]["type"], "bytes")
        self.assertEqual(len(threaded), 1)
