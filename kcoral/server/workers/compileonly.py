# -*- test-case-name: tests.unit.test_compileonly,tests.integration.test_compile_only_server -*-
"""
Compile-only programs, run by the server itself, without a worker (issue 38).

Under bubblewrap with a compile cache, the server compiles every cacheable
C{builtin.compile_cuda_binary} itself, in a sandbox of its own
(L{kcoral.server.workers.compiles}): the worker only relays the request and
reads the image back.  A program that does nothing else (the compile node's
usual program) therefore needs no worker at all, and skips its fork, its
sandbox and its replacement, which on a small machine compete with nvcc.

L{is_compile_only} recognises such a program from its parsed instructions,
strictly: only C{upload}s of CUDA modules, C{get_function} on them, C{run}s
of C{builtin.compile_cuda_binary} whose arguments are such a function and a
literal C{cfg} (a number, or nothing, as C{timeout_seconds}; no C{-I} flags:
those compiles are never cached, so a worker runs them), and C{return}s of
those runs' values.  Anything else goes to a worker.

L{ParentCompiles} runs one as a worker's engine would, through the code the
worker's path uses: the call's checks (L{kcoral.compilers.call}), the
backend's availability as the worker checks it, and the parent's own
compile (L{IsolatedCompiles.compile_image}: the request's check, key, cache
lookup, sandboxed compile and store).  Nothing uploaded is executed here.
Its L{JobResult} is shaped like a worker's (an L{Outcome} with the same
results, binary parts and errors), so the same renderer answers it.  The
one difference is an error's C{traceback}: no worker frames ran, so it is
the exception's last line (the one the worker's traceback ends with).

When a compile needs what the server's sandbox lacks (its backend answers
C{unavailable} here), the worker's path would compile inside the worker:
L{ParentCompiles.run} then answers C{None} and the program goes to a worker
with what is left of its budget.
"""

from __future__ import annotations

import math
import os
import traceback
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.defer import TimeoutError as WaitTimedOut
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from kcoral.compilers import cacheable
from kcoral.compilers.call import (
    COMPILE_TIMEOUT_SECONDS,
    CudaFunction,
    CudaSource,
    compile_call,
)
from kcoral.errors import KINDS, ExecutionError
from kcoral.server.workers.job import Job, JobResult
from kcoral.server.workers.reactor import Clock, RunBlocking
from kcoral.wire.channel import CompileDone, CompileRequest, Outcome, fit_outcome
from kcoral.wire.errors import instruction_error
from kcoral.wire.program import (
    BuiltinName,
    GetFunction,
    Program,
    Ref,
    Return,
    Run,
    Upload,
)
from kcoral.wire.values import PartCollector, encode_plain

#: The C{route} of a compile-only program's C{request_routed} event.
PARENT_COMPILE = "parent_compile"

#: The one builtin a compile-only program runs.
COMPILE_BUILTIN = "builtin.compile_cuda_binary"

#: Set to C{0} in the server's environment to send compile-only programs
#: to workers as before (a way back, and the tests' way to compare both).
PARENT_COMPILES_ENV = "KCORAL_PARENT_COMPILES"

#: A returned image at least this large is encoded (hashed) in a thread.
INLINE_ENCODE_BYTES = 64 * 1024


def parent_compiles_allowed(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the server may run compile-only programs itself (L{PARENT_COMPILES_ENV})."""
    return environ.get(PARENT_COMPILES_ENV) != "0"


def is_compile_only(program: Program) -> bool:
    """
    Whether the server can run C{program} itself (L{ParentCompiles}): at
    least one compile, and nothing but the instructions the module
    docstring lists, each in the shape a worker would answer the same way.
    """
    if program.options.gpu_count is not None:
        return False
    sources: set[str] = set()
    functions: set[str] = set()
    runs: set[str] = set()
    for instruction in program.instructions:
        if isinstance(instruction, Upload):
            if instruction.kind != "module" or instruction.language != "cuda":
                return False
            if instruction.id is None:
                return False
            sources.add(instruction.id)
        elif isinstance(instruction, GetFunction):
            if instruction.module.target not in sources:
                return False
            functions.add(instruction.id)
        elif isinstance(instruction, Run):
            if not _is_compile_run(instruction, functions):
                return False
            runs.add(instruction.id)
        elif isinstance(instruction, Return):
            if instruction.kind is not None or instruction.value is None:
                return False
            if instruction.value.target not in runs:
                return False
        else:  # pragma: no cover - the parser admits nothing else
            return False
    return bool(runs)


def _is_compile_run(run: Run, functions: set[str]) -> bool:
    """
    Whether C{run} is C{compile_cuda_binary(function, cfg?)} on one of
    C{functions} with a literal C{cfg} whose timeout is a finite number
    (the worker would fail other timeouts with a Python exception's
    message) and whose flags, when they are strings, do not keep it out of
    the cache (C{-I}).
    """
    if run.fn != BuiltinName(COMPILE_BUILTIN):
        return False
    args = run.args
    if not 1 <= len(args) <= 2:
        return False
    function = args[0]
    if not isinstance(function, Ref) or function.target not in functions:
        return False
    if len(args) == 1:
        return True
    cfg = args[1]
    if not isinstance(cfg, dict):
        return False
    timeout = cfg.get("timeout_seconds", COMPILE_TIMEOUT_SECONDS)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        return False
    try:
        if not math.isfinite(float(timeout)):
            return False
    except OverflowError:
        return False
    flags = cfg.get("extra_cuda_cflags", [])
    if isinstance(flags, list) and all(isinstance(flag, str) for flag in flags):
        return cacheable(tuple(flags))
    return True


class ImageCompiler(Protocol):
    """What L{ParentCompiles} uses of L{kcoral.server.workers.compiles.IsolatedCompiles}."""

    async def compile_image(
        self, request: CompileRequest, timeout: float, *, available: bool = False
    ) -> tuple[CompileDone, bytes | None]: ...


class _ToWorker(Exception):
    """A compile needs a worker (its backend is unavailable to the server)."""


@attrs.define(eq=False)
class ParentCompiles:
    """Runs compile-only programs (L{is_compile_only}) in the server."""

    compiler: ImageCompiler
    clock: Clock
    run_blocking: RunBlocking

    log = Logger()

    async def run(self, job: Job) -> JobResult | None:
        """
        Run C{job}'s program within its budget, as a worker would.

        @return: how it ended (C{outcome}, or C{timeout} when the budget ran
            out: the compile running then is killed), or C{None} when one
            of its compiles needs a worker: run it there.
        @raise CancelledError: the wait was cancelled (the client left);
            the compile running then is killed.
        """
        deadline = self.clock.seconds() + job.timeout_seconds
        running = Deferred.fromCoroutine(self._run(job, deadline))
        # Cancelled at the deadline, which then reads as a TimeoutError; a
        # cancel from outside (the client left) stays a CancelledError.
        running.addTimeout(job.timeout_seconds, cast(IReactorTime, self.clock))
        try:
            return await running
        except WaitTimedOut:
            return JobResult("timeout", ended_at=self.clock.seconds())

    async def _run(self, job: Job, deadline: float) -> JobResult | None:
        values: dict[str, Any] = {}
        parts = PartCollector()
        results: dict[str, Any] = {}
        error = None
        for instruction in job.program.instructions:
            try:
                if isinstance(instruction, Upload):
                    assert instruction.id is not None
                    values[instruction.id] = CudaSource(instruction.source or "")
                elif isinstance(instruction, GetFunction):
                    module = values[instruction.module.target]
                    values[instruction.id] = module.get_function(instruction.name)
                elif isinstance(instruction, Run):
                    args = [values[a.target] if isinstance(a, Ref) else a for a in instruction.args]
                    values[instruction.id] = await self._compile(args, deadline)
                else:
                    assert isinstance(instruction, Return) and instruction.value is not None
                    results[instruction.key] = await self._encode(
                        values[instruction.value.target], parts
                    )
            except _ToWorker:
                return None
            except ExecutionError as e:
                error = instruction_error(
                    e.kind,
                    e.message,
                    instruction.index,
                    instruction.op,
                    instruction.id,
                    "".join(traceback.format_exception_only(type(e), e)),
                )
                break
        outcome = Outcome(
            status="FAILED" if error is not None else "COMPLETED",
            results=results,
            error=error,
            parts=tuple(parts.parts),
        )
        return JobResult(
            "outcome",
            outcome=fit_outcome(outcome, job.max_response_bytes),
            ended_at=self.clock.seconds(),
        )

    async def _compile(self, args: Sequence[Any], deadline: float) -> bytes:
        """
        One C{compile_cuda_binary(*args)}: the image, as the worker's
        builtin would return it.

        @raise ExecutionError: the error the worker's builtin would raise.
        @raise _ToWorker: only a worker can compile it.
        """
        function, *rest = args
        assert isinstance(function, CudaFunction)
        call = compile_call(function, *rest)
        if not cacheable(call.flags):
            raise _ToWorker()
        # What RunningJob gives a worker's request: its own timeout within
        # what is left of the program's budget, and at least a second.
        timeout = max(1.0, min(call.timeout, deadline - self.clock.seconds()))
        request = CompileRequest(
            call.source, call.arch, list(call.flags), call.backend, call.timeout
        )
        done, image = await self.compiler.compile_image(request, timeout, available=True)
        if done.error is not None or not done.key:
            # As the worker's RemoteCompiler reads the answer.
            kind = done.kind if done.kind in KINDS else "compile"
            if kind == "unavailable":
                raise _ToWorker()
            raise ExecutionError(kind, done.error or "compile failed")
        if image is None:
            raise ExecutionError("engine", "the compiled image is missing from the compile cache")
        return image

    async def _encode(self, value: bytes, parts: PartCollector) -> Any:
        """A returned image's value node (its part hashed in a thread when large)."""
        if len(value) < INLINE_ENCODE_BYTES:
            return encode_plain(value, parts)
        node: Any = await self.run_blocking(encode_plain, value, parts)
        return node
