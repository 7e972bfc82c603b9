# -*- test-case-name: tests.unit.test_worker_engine -*-
"""
The engine: interprets one program inside a worker process.

L{Engine.run} takes an L{Execute} message with the blobs sent before it and
returns an L{Outcome} message (both from L{kcoral.wire.channel}).  It
follows protocol §6: instructions run in order in the request's workspace,
each handle binds the value its instruction produced, the first failure stops
the program, and completed returns survive a later failure.  Around every
instruction it places the GPU lease as spec/server.md §4.3 says, narrowed
to GPU work (docs/worker.md, "Lease placement"), and it
announces each instruction to the parent before running it so that a crash
can be attributed.  Workspace file I/O is in L{kcoral.worker.files}, the
checks of a reused worker in L{kcoral.worker.reuse}.

Nothing here imports Twisted: the worker has no reactor.
"""

from __future__ import annotations

import builtins as _python_builtins
import contextlib
import gc
import hashlib
import linecache
import os
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from kcoral.errors import KINDS, ExecutionError, GPUAccessViolation
from kcoral.ipc.shared import PARTS, SharedBuffer
from kcoral.wire.channel import (
    RETIRE_POISONED,
    RETIRE_REQUEST_LIMIT,
    ChannelMessage,
    Execute,
    Instruction,
    Outcome,
    Returned,
    fit_outcome,
    header_cost,
)
from kcoral.wire.errors import instruction_error, truncate_traceback
from kcoral.wire.jsontext import json_dumps
from kcoral.wire.program import (
    BUILTIN_NAMES,
    BuiltinName,
    GetFunction,
    Program,
    Ref,
    Return,
    Run,
    Upload,
    normalize_path,
    parse_program,
)
from kcoral.wire.values import (
    PartCollector,
    SerializationError,
    encode_plain,
    numpy_tensor_parts,
)
from kcoral.worker import files, reuse, runtime
from kcoral.worker.builtins import CudaSource
from kcoral.worker.capture import Captured, OutputCapture
from kcoral.worker.files import Budget, collect_file, collect_folder, materialize_file
from kcoral.worker.inert import import_is_inert
from kcoral.worker.reuse import ProcessState, terminate

# ---------------------------------------------------------------------------
# Error objects


#: The interpreter's own modules: their frames are left out of tracebacks.
_OWN_FILES = frozenset({__file__, files.__file__, reuse.__file__})


#: Set to C{0} in the server's environment to take the lease before every
#: module upload, as spec/server.md §4.3 says, instead of at its first device
#: call (a way back should the driver watch misbehave somewhere).
LAZY_MODULE_LEASE_ENV = "KCORAL_LAZY_MODULE_LEASE"

#: The same for a C{run} of a function from an uploaded Python module:
#: C{0} takes the lease before the run, not at its first device call.
LAZY_RUN_LEASE_ENV = "KCORAL_LAZY_RUN_LEASE"


#: How many uploaded functions L{Engine.device_functions} remembers.
DEVICE_FUNCTIONS_KEPT = 4096


def code_key(fn: Any) -> tuple[str, int, str] | None:
    """
    An uploaded function's identity across programs: its file (named by the
    module source's digest), first line and name; C{None} for anything else.
    """
    code = getattr(fn, "__code__", None)
    if code is None or not code.co_filename.startswith("<uploaded:"):
        return None
    return (code.co_filename, code.co_firstlineno, code.co_name)


def _format_traceback(exc: BaseException) -> str:
    """The traceback of C{exc} without this module's frames."""
    frames = traceback.extract_tb(exc.__traceback__)
    kept = traceback.StackSummary.from_list([f for f in frames if f.filename not in _OWN_FILES])
    lines = ["Traceback (most recent call last):\n"] if kept else []
    lines += kept.format()
    lines += traceback.format_exception_only(type(exc), exc)
    return truncate_traceback("".join(lines))


class _Failure(Exception):
    """An instruction failed with C{kind}/C{message}; C{cause} gives the traceback."""

    def __init__(self, kind: str, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.cause = cause


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _user_failure(exc: Exception) -> _Failure:
    """Map an exception escaping user code to a failure (protocol §6.2, §10.1)."""
    if isinstance(exc, ExecutionError):
        if exc.kind in KINDS:
            return _Failure(exc.kind, str(exc.message), exc)
        return _Failure("engine", f"{type(exc).__name__}: {exc.message}", exc)
    return _Failure("engine", _describe(exc), exc)


def _library_call(call: Callable[[], Any], message: Callable[[Exception], str]) -> Any:
    """
    Run an operation on an uploaded library: an L{ExecutionError} keeps its
    kind, any other exception is a C{compile} failure with C{message(e)}.
    """
    try:
        return call()
    except ExecutionError as e:
        raise _user_failure(e) from None
    except Exception as e:
        raise _Failure("compile", message(e), e) from None


# ---------------------------------------------------------------------------
# Value encoding (protocol §7)


#: Values that live in host memory whatever they hold.
_HOST_SCALARS = (type(None), bool, int, float, str, bytes, bytearray, memoryview)


def _is_host_value(value: Any, budget: int = 10_000) -> bool:
    """
    Whether encoding C{value} cannot touch the GPU: plain values, NumPy
    arrays and scalars, and lists, tuples and dicts of them.  Anything else
    (a torch or PyCUDA tensor, an unknown object) may live on the device, and
    so may a value too large to look through within C{budget} nodes (the
    answer is then the careful one: the return takes the lease).
    """
    stack = [value]
    while stack:
        budget -= 1
        if budget < 0:
            return False
        item = stack.pop()
        if isinstance(item, _HOST_SCALARS):
            continue
        if isinstance(item, list | tuple):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        else:
            module = type(item).__module__
            if module != "numpy" and not module.startswith("numpy."):
                return False
    return True


class _Copies:
    """Host copies of a value's device tensors, by the identity of each tensor."""

    def __init__(self) -> None:
        self._by_id: dict[int, Any] = {}

    def get(self, candidate: Any) -> Any:
        found = self._by_id.get(id(candidate))
        if isinstance(found, BaseException):
            raise found
        return found


def _host_copies(value: Any, tensor_parts: Callable[[Any], Any]) -> _Copies | None:
    """
    Export every tensor in C{value} now (device tensors are copied to the
    host), walking it as the encoder will; C{None} when it cannot be walked
    (nested too deeply: the encoder then reports it, under the lease).
    """
    copies = _Copies()

    def walk(item: Any) -> None:
        if isinstance(item, _HOST_SCALARS):
            return
        if isinstance(item, list | tuple):
            for child in item:
                walk(child)
        elif isinstance(item, dict):
            for child in item.values():
                walk(child)
        else:
            try:
                copies._by_id[id(item)] = tensor_parts(item)
            except Exception as e:
                copies._by_id[id(item)] = e

    try:
        walk(value)
    except RecursionError:
        return None
    return copies


def encode_value(
    value: Any,
    parts: PartCollector,
    tensor_parts: Callable[[Any], tuple[str, Sequence[int], bytes] | None],
) -> dict[str, Any]:
    """
    Encode C{value} as a value tree node (protocol §7.1): the wire encoder,
    with the backend's tensors first and NumPy arrays as tensors too.

    @raise SerializationError: the value cannot be returned.
    """

    def any_tensor(candidate: Any) -> Any:
        found = tensor_parts(candidate)
        return found if found is not None else numpy_tensor_parts(candidate)

    return encode_plain(value, parts, any_tensor)


# ---------------------------------------------------------------------------
# Program parsing


def _parse(text: str, builtin_names: frozenset[str]) -> Program:
    return parse_program(text.encode("utf-8"), builtin_names=builtin_names)


# ---------------------------------------------------------------------------
# The engine


@attrs.define
class _Handles:
    """Handle values by id, plus how each was produced."""

    values: dict[str, Any] = attrs.field(factory=dict)
    python_modules: set[str] = attrs.field(factory=set)
    libraries: set[str] = attrs.field(factory=set)
    cpu_only: set[str] = attrs.field(factory=set)
    #: Functions selected from uploaded Python modules (plain callables).
    python_functions: set[str] = attrs.field(factory=set)


def _noop_send(message: ChannelMessage) -> None:
    pass


@attrs.define
class Engine:
    """
    Interprets programs against a device backend and a lease client.

    @ivar backend: an L{IDeviceBackend}.
    @ivar lease: an L{ILeaseClient}.
    @ivar builtins: the builtin table, C{name -> (callable, cpu_only)}.
    @ivar send: called with each message the engine emits while running
        (the L{Instruction} announcements).
    """

    backend: Any
    lease: Any
    builtins: dict[str, tuple[Callable[..., Any], bool]]
    send: Callable[[ChannelMessage], None] = _noop_send
    #: Send each finished return at once (a L{Returned} message), so the
    #: parent keeps it if the worker crashes later; the outcome then carries
    #: only the parts not sent yet.
    stream_returns: bool = False
    #: Make large binary parts sealed shared buffers (L{kcoral.ipc.shared}),
    #: whose descriptors cross to the parent instead of their bytes.
    share_parts: bool = False
    #: Freeze what survives the first settle's collection (L{gc.freeze}):
    #: what libraries set up lazily during the first program lives as long
    #: as the worker, and every later collection would walk it again (12,700
    #: objects, 1.4 ms a collection, in a GPU worker with torch).  A worker
    #: process sets it; an engine embedded elsewhere leaves its host's
    #: collector alone.
    freeze_after_first_settle: bool = False
    #: Posts the index of each instruction about to run on the progress
    #: board (L{kcoral.ipc.board}) instead of announcing it with an
    #: L{Instruction} message, unless the program's L{Execute} asks for
    #: announcements; C{None}: always announce.
    progress: Callable[[int], None] | None = None
    #: The process state before the first program, which every later one
    #: is put back to (L{settle} makes it so again).
    _baseline: ProcessState | None = attrs.field(default=None, init=False)
    #: Uploaded functions (by L{code_key}) whose lazily leased run took the
    #: lease: their later runs take it up front, because switching the
    #: driver watch off inside the hold lengthens it (at most
    #: L{DEVICE_FUNCTIONS_KEPT}; the set starts again when full).
    device_functions: set[tuple[str, int, str]] = attrs.field(factory=set, init=False)
    #: The last program's workspace, while its host state is not put back.
    _unsettled: str | None = attrs.field(default=None, init=False)
    _settled_once: bool = attrs.field(default=False, init=False)

    def __attrs_post_init__(self) -> None:
        runtime.install(self.backend, self.lease, self.builtins)

    def settle(self) -> None:
        """
        Put the host state back after a program that kept the worker
        (environment, C{sys.path}, uploaded modules) and collect what it
        left.  The worker calls this once the outcome is sent, so the answer
        does not wait for it; L{run} calls it first if nobody did.
        """
        workspace, self._unsettled = self._unsettled, None
        if workspace is not None and self._baseline is not None:
            self._baseline.restore(workspace)
            gc.collect()
            if self.freeze_after_first_settle and not self._settled_once:
                gc.freeze()
            self._settled_once = True

    def run(
        self,
        request: Execute,
        blobs: Mapping[str, bytes | SharedBuffer] | None = None,
        *,
        retiring: bool = False,
    ) -> Outcome:
        """
        Run one program and return its outcome.

        @param blobs: the blobs sent before C{request}, by digest.
        @param retiring: the worker will exit after this program (its request
            limit is reached), so it keeps the lease and skips the reuse checks.
        """
        self.settle()
        if self._baseline is None:
            self._baseline = ProcessState.snapshot()
        state = self._baseline
        runtime.set_budget(request.timeout_seconds)
        program = _parse(request.program, frozenset(self.builtins) | BUILTIN_NAMES)
        run = _ProgramRun(self, request, dict(blobs or {}), program, retiring=retiring)
        cwd = os.getcwd()
        capture = OutputCapture(request.workspace, request.output_limit)
        capture.start()
        try:
            os.chdir(request.workspace)
            try:
                run.execute()
            finally:
                os.chdir(cwd)
        finally:
            captured = capture.stop()
        retire = run.cleanup()
        leftover_pids = state.new_children()
        if leftover_pids:
            # Background work must finish before a program returns: stop it,
            # and fail a program that otherwise completed (spec §6.3).
            terminate(leftover_pids)
            retire = retire or RETIRE_REQUEST_LIMIT
            if run.error is None and run.last is not None:
                run.error = run._error(
                    run.last,
                    _Failure(
                        "runtime", "program left background processes running; they were terminated"
                    ),
                )
        outcome = fit_outcome(
            run.outcome(captured), request.max_response_bytes, request.max_decode_bytes
        )
        del run
        if retire is None and retiring:
            retire = RETIRE_REQUEST_LIMIT
        # A retiring worker keeps whatever lease it holds and takes none:
        # its context is destroyed later under the maintenance lease the
        # parent takes for it (WorkerProcess.retire, "teardown"), so the
        # answer never waits for the GPU on its account.
        if retire is None:
            # The device is clean (cleanup drained it, or it was drained when
            # the lease was given back): give the GPU to the next worker now
            # and restore host state off the lease.
            self.lease.release()
            leftovers = state.leftovers(request.workspace, children=leftover_pids)
            if leftovers:
                print(
                    "kcoral worker: retiring, the program left " + "; ".join(leftovers),
                    file=sys.stderr,
                    flush=True,
                )
                retire = RETIRE_REQUEST_LIMIT
            else:
                # The rest (restore, collection) once the answer is out.
                self._unsettled = request.workspace
        return attrs.evolve(outcome, retire=retire)


#: Bytes of a L{Returned} frame beyond its key, value and parts (an upper bound).
RETURNED_OVERHEAD = 256


def _encoded_size(result: Any) -> tuple[int, int]:
    """
    The size of an encoded return in the response's JSON, and what
    decoding it takes the parent (L{header_cost}).

    @raise _Failure: C{serialization}, when the value has no JSON text (a
        lone surrogate such as C{'\\ud800'}, an integer past Python's digit
        limit such as C{10**5000}): that return fails, the ones before it stay.
    """
    try:
        text = json_dumps(result)
        return len(text), header_cost(text)
    except (ValueError, TypeError, RecursionError) as e:
        message = f"cannot encode the returned value: {_describe(e)}"
        raise _Failure("serialization", message, e) from None


class _ProgramRun:
    """The state of one program while it runs."""

    def __init__(
        self,
        engine: Engine,
        request: Execute,
        blobs: dict[str, bytes | SharedBuffer],
        program: Program,
        *,
        retiring: bool = False,
    ) -> None:
        self.engine = engine
        self.retiring = retiring
        self.blobs = blobs
        # Tensor blobs mapped now, before any lease: populating the mapping
        # of a large buffer takes milliseconds that need not hold the GPU.
        self.mapped: dict[str, memoryview] = {}
        for instruction in program.instructions:
            if isinstance(instruction, Upload) and instruction.kind == "tensor":
                buffer = blobs.get(instruction.blob or "")
                if isinstance(buffer, SharedBuffer) and instruction.blob not in self.mapped:
                    self.mapped[instruction.blob or ""] = buffer.map()
        self.backend = engine.backend
        self.lease = engine.lease
        self.request = request
        self.program = program
        self.handles = _Handles()
        self.parts = PartCollector(PARTS if engine.share_parts else None)
        #: Parts already sent with L{Returned} messages.
        self.streamed = 0
        self.streamed_bytes = 0
        #: What decoding the returns sent ahead takes the parent (L{header_cost}).
        self.streamed_cost = 0
        self.streaming = True
        self.results: dict[str, Any] = {}
        self.error: dict[str, Any] | None = None
        self.last: Any = None
        self.position = 0
        self.lazy_module_lease = False
        self.module_ids: set[str] = set()
        self.static_cpu_only: set[str] = set()
        self.later_needs: list[bool] = [False]

    # -- driving --------------------------------------------------------

    def execute(self) -> None:
        instructions = self.program.instructions
        self.lazy_module_lease = self._lazy_lease() is not None
        # What the program's text alone says about its handles.
        self.module_ids = {
            i.id
            for i in instructions
            if isinstance(i, Upload) and i.kind == "module" and i.language != "cuda" and i.id
        }
        self.static_cpu_only = {
            i.id for i in instructions if isinstance(i, GetFunction) and i.cpu_only
        }
        # From the end: whether an instruction at or after each index
        # certainly needs the lease (see _surely_leased).
        self.later_needs = [False] * (len(instructions) + 1)
        for i in range(len(instructions) - 1, -1, -1):
            self.later_needs[i] = self.later_needs[i + 1] or self._surely_leased(instructions[i])
        for position, instruction in enumerate(instructions):
            self.last = instruction
            self.position = position
            self._announce(instruction)
            try:
                around = self._place(instruction)
                with around if around is not None else contextlib.nullcontext():
                    self._dispatch(instruction)
                if around is not None and isinstance(instruction, Run) and self.lease.held:
                    self._remember_device_function(instruction)
            except _Failure as failure:
                self.error = self._error(instruction, failure)
                return
            except Exception as e:
                self.error = self._error(instruction, _Failure("engine", _describe(e), e))
                return

    def _error(self, instruction: Any, failure: _Failure) -> dict[str, Any]:
        cause = failure.cause
        tb = _format_traceback(cause) if cause is not None else ""
        if isinstance(cause, GPUAccessViolation) and cause.call_stack:
            tb = truncate_traceback(cause.call_stack)
        extra = {}
        if failure.kind == "gpu_access":
            extra = {
                "cuda_call": str(getattr(cause, "cuda_call", "")),
                "location": str(getattr(cause, "location", "")),
                "interfered_request_id": None,
            }
        error = instruction_error(
            failure.kind,
            failure.message,
            instruction.index,
            instruction.op,
            instruction.id,
            tb,
            **extra,
        )
        return error

    def cleanup(self) -> str | None:
        """
        End-of-program cleanup; return a retire reason or C{None}.

        It runs under the lease when the program still holds it (its last
        instructions used the GPU, or it failed in one).  Otherwise the
        device was drained when the lease was given back and nothing has
        touched it since (a C{cpu_only} run that did is reported as
        C{gpu_access}), so dropping the handles and resetting (which frees
        memory, like a garbage collection in a C{cpu_only} run) needs no
        second hold.
        """
        retire = None
        try:
            pending = self.backend.cleanup()
            self.handles = _Handles()
            self.backend.reset()
        except Exception as e:
            retire = RETIRE_POISONED
            if self.error is None and self.last is not None:
                self.error = self._error(self.last, _Failure("runtime", _describe(e), e))
        else:
            if pending and self.last is not None:
                if self.error is not None and self.error["kind"] == "gpu_access":
                    self.error["message"] += f"; {pending}"
                else:
                    self.error = self._error(self.last, _Failure("runtime", pending))
        return retire

    def outcome(self, captured: Captured) -> Outcome:
        return Outcome(
            status="FAILED" if self.error is not None else "COMPLETED",
            results=self.results,
            error=self.error,
            stdout=captured.stdout,
            stderr=captured.stderr,
            stdout_truncated=captured.stdout_truncated,
            stderr_truncated=captured.stderr_truncated,
            parts=tuple(self.parts.parts[self.streamed :]),
            streamed_parts=self.streamed,
        )

    def _announce(self, instruction: Any) -> None:
        """
        Tell the parent which instruction is about to run: on the board, or
        with a message where the parent asked for them, or where it needs
        the start time (a C{cpu_only} run: a C{gpu_access} failure names
        the request that held the GPU meanwhile).
        """
        progress = self.engine.progress
        if (
            progress is None
            or self.request.announce
            or (isinstance(instruction, Run) and self._is_cpu_only_run(instruction))
        ):
            self.engine.send(Instruction(instruction.index))
        else:
            progress(instruction.index)

    # -- lease placement (spec/server.md §4.3) --------------------------

    def _is_cpu_only_run(self, instruction: Run) -> bool:
        fn = instruction.fn
        if isinstance(fn, BuiltinName):
            entry = self.engine.builtins.get(fn.name)
            return bool(entry and entry[1])
        return fn.target in self.handles.cpu_only

    def _release(self) -> None:
        if self.lease.held:
            self.backend.drain()
        self.lease.release()

    def _is_python_module(self, ref: Ref) -> bool:
        """Whether C{ref} names an uploaded Python module (a namespace, no device)."""
        return ref.target in self.handles.python_modules or ref.target in self.module_ids

    def _surely_leased(self, instruction: Any) -> bool:
        """
        Whether C{instruction} takes the lease whatever the values it meets
        (value returns depend on their value, so they never count here).
        """
        if isinstance(instruction, Upload):
            if instruction.kind == "module" and (
                self.lazy_module_lease
                or (instruction.language != "cuda" and import_is_inert(instruction.source or ""))
            ):
                return False
            return instruction.kind in ("module", "tensor", "library")
        if isinstance(instruction, GetFunction):
            return not self._is_python_module(instruction.module)
        if isinstance(instruction, Run):
            fn = instruction.fn
            if isinstance(fn, BuiltinName):
                entry = self.engine.builtins.get(fn.name)
                return not (entry and entry[1])
            return fn.target not in self.static_cpu_only
        return False

    def _needs_lease(self, instruction: Any) -> bool | None:
        """
        The lease an instruction needs (spec/server.md §4.3, narrowed to GPU
        work): C{True} it must hold it, C{False} it must not (the device is
        drained first), C{None} either will do.
        """
        if isinstance(instruction, Upload):
            if instruction.kind == "bytes":
                return None
            if instruction.kind == "file":
                return False
            # Module top-level code may touch CUDA; tensors and libraries do.
            return True
        if isinstance(instruction, Return):
            if instruction.kind is not None:
                return False
            assert instruction.value is not None
            # Host values are encoded off the lease; device tensors are
            # copied to the host under it (see _return).
            return (
                None if _is_host_value(self.handles.values.get(instruction.value.target)) else True
            )
        if isinstance(instruction, GetFunction):
            # Selecting a name from an uploaded module's namespace is a
            # dictionary lookup; a library's function is a driver call.
            return None if self._is_python_module(instruction.module) else True
        if isinstance(instruction, Run) and self._is_cpu_only_run(instruction):
            return False
        return True

    def _lazy_lease(self, switch: str = LAZY_MODULE_LEASE_ENV) -> Any:
        """
        The backend's L{lazy_lease} context for this lease, or C{None}
        (also when C{switch} is C{0} in the environment).

        A worker that exits after this program does not set up the driver
        watch for it: subscribing costs a fresh process more time (60-90 ms
        measured on an H200) than an import can hold the lease, and the
        subscription would serve no later program.  One that exists already
        (made by an earlier C{cpu_only} run) is used.
        """
        make = getattr(self.backend, "lazy_lease", None)
        if make is None or os.environ.get(switch) == "0":
            return None
        return make(self.lease.acquire, subscribe=not self.retiring)

    def _place(self, instruction: Any) -> Any:
        """
        Place the lease for C{instruction}; return a context manager to run
        it in, or C{None}.
        """
        if (
            isinstance(instruction, Upload)
            and instruction.kind == "module"
            and instruction.language != "cuda"
            and not self.lease.held
        ):
            if import_is_inert(instruction.source or ""):
                # Definitions and loaded imports only: nothing of its own
                # runs, so neither the lease nor the driver watch is needed.
                return None
            # Module top-level code may touch CUDA: where the driver can be
            # watched, the import runs off the lease and its first device
            # call takes it; elsewhere the lease is taken now.
            around = self._lazy_lease()
            if around is not None:
                return around
        if (
            isinstance(instruction, Run)
            and not self.lease.held
            and not isinstance(instruction.fn, BuiltinName)
            and instruction.fn.target in self.handles.python_functions
            and not self._is_cpu_only_run(instruction)
            and code_key(self.handles.values[instruction.fn.target])
            not in self.engine.device_functions
        ):
            # A Python function may or may not use the GPU: where the driver
            # can be watched it starts off the lease, and its first device
            # call takes it (a function that never touches the device, such
            # as a null program's, holds nothing).  One seen to touch it
            # before takes the lease now.
            around = self._lazy_lease(LAZY_RUN_LEASE_ENV)
            if around is not None:
                return around
        need = self._needs_lease(instruction)
        if need is None and self.lease.held and not self.later_needs[self.position + 1]:
            # Nothing after this needs the GPU for sure: the last GPU
            # instruction's synchronize ends the hold now, and the rest of
            # the program (host returns, file returns, cleanup) runs off it.
            need = False
        if need is True:
            self.lease.acquire()
        elif need is False:
            self._release()
        return None

    def _remember_device_function(self, instruction: Run) -> None:
        """A lazily leased run took the lease: its function's later runs take it up front."""
        assert not isinstance(instruction.fn, BuiltinName)
        key = code_key(self.handles.values[instruction.fn.target])
        if key is None:
            return
        known = self.engine.device_functions
        if len(known) >= DEVICE_FUNCTIONS_KEPT:
            known.clear()
        known.add(key)

    # -- instructions ---------------------------------------------------

    def _dispatch(self, instruction: Any) -> None:
        if isinstance(instruction, Upload):
            value = getattr(self, f"_upload_{instruction.kind}")(instruction)
            if instruction.id is not None:
                self.handles.values[instruction.id] = value
        elif isinstance(instruction, GetFunction):
            self.handles.values[instruction.id] = self._get_function(instruction)
            if instruction.cpu_only:
                self.handles.cpu_only.add(instruction.id)
            if instruction.module.target in self.handles.python_modules:
                self.handles.python_functions.add(instruction.id)
        elif isinstance(instruction, Run):
            self.handles.values[instruction.id] = self._run(instruction)
        elif isinstance(instruction, Return):
            mark = self.parts.mark()
            try:
                result = self._return(instruction)
                encoded, cost = _encoded_size(result)
            except BaseException:
                self.parts.rewind(mark)
                raise
            self.results[instruction.key] = result
            if self.engine.stream_returns and self.streaming:
                new_parts = tuple(self.parts.parts[self.streamed :])
                # What this return adds to the frames sent ahead: the parent
                # accepts no more than max_response_bytes of them in all.
                size = encoded + 6 * len(instruction.key) + RETURNED_OVERHEAD
                size += sum(len(p) + 24 for p in new_parts)
                limit = self.request.max_response_bytes
                max_decode = self.request.max_decode_bytes
                if (
                    self.parts.total_bytes > limit
                    or self.streamed_bytes + size > limit
                    or (max_decode is not None and self.streamed_cost + cost > max_decode)
                ):
                    # Over the response limit, or too costly for the parent
                    # to decode: the outcome reports it (oversize); nothing
                    # more is sent ahead.
                    self.streaming = False
                    return
                self.streamed_bytes += size
                self.streamed_cost += cost
                self.engine.send(
                    Returned(instruction.key, self.results[instruction.key], new_parts)
                )
                self.streamed = len(self.parts.parts)
        else:  # pragma: no cover - the parser admits nothing else
            raise _Failure("engine", f"unknown instruction {instruction!r}")

    def _blob(self, digest: str | None) -> bytes | memoryview:
        """
        A blob's bytes: a shared buffer is mapped read-only, not copied
        (its seals keep every byte as the parent hashed it).
        """
        mapped = self.mapped.get(digest or "")
        if mapped is not None:
            return mapped
        try:
            data = self.blobs[digest or ""]
        except KeyError:
            raise _Failure("engine", f"blob {digest} was not sent to the worker") from None
        return data.map() if isinstance(data, SharedBuffer) else data

    def _upload_module(self, instruction: Upload) -> Any:
        source = instruction.source or ""
        if instruction.language == "cuda":
            return CudaSource(source)
        digest = hashlib.sha1(source.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        filename = f"<uploaded:{digest}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        try:
            code = compile(source, filename, "exec", dont_inherit=True)
        except (SyntaxError, ValueError) as e:
            raise _Failure("parse", f"syntax error: {e}", e) from None
        namespace: dict[str, Any] = {
            "__name__": f"kcoral_uploaded_{digest}",
            "__file__": filename,
            "__builtins__": _python_builtins,
        }
        try:
            exec(code, namespace, namespace)
        except Exception as e:
            raise _Failure("parse", _describe(e), e) from None
        if instruction.id is not None:
            self.handles.python_modules.add(instruction.id)
        return namespace

    def _upload_tensor(self, instruction: Upload) -> Any:
        data = self._blob(instruction.blob)
        try:
            return self.backend.upload_tensor(
                data, instruction.dtype, tuple(instruction.shape or ())
            )
        except Exception as e:
            raise _user_failure(e) from None

    def _upload_bytes(self, instruction: Upload) -> bytes:
        buffer = self.blobs.get(instruction.blob or "")
        if isinstance(buffer, SharedBuffer):
            # One read into the program's bytes: no mapping to populate.
            return buffer.tobytes()
        data = self._blob(instruction.blob)
        return data if isinstance(data, bytes) else data.tobytes()

    def _upload_library(self, instruction: Upload) -> Any:
        data = bytes(self._blob(instruction.blob))
        library = _library_call(
            lambda: self.backend.load_library(data),
            lambda e: f"cannot load the uploaded library: {_describe(e)}",
        )
        if instruction.id is not None:
            self.handles.libraries.add(instruction.id)
        return library

    def _upload_file(self, instruction: Upload) -> str:
        path = instruction.path or ""
        reserved = self.request.reserved
        if reserved and path.split("/", 1)[0] == reserved:
            raise _Failure("runtime", f"{reserved!r} is reserved for sandbox runtime files")
        data = self._blob(instruction.blob)
        try:
            materialize_file(self.request.workspace, path, data)
        except OSError as e:
            raise _Failure(
                "runtime", f"cannot materialize file {path!r}: {_describe(e)}", e
            ) from None
        return path

    def _get_function(self, instruction: GetFunction) -> Any:
        target = instruction.module.target
        module = self.handles.values[target]
        name = instruction.name
        if target in self.handles.python_modules:
            try:
                return module[name]
            except KeyError:
                raise _Failure(
                    "parse", f"the uploaded Python module defines no name {name!r}"
                ) from None
        if isinstance(module, CudaSource):
            try:
                return module.get_function(name)
            except ExecutionError as e:
                raise _user_failure(e) from None
        if target in self.handles.libraries:
            return _library_call(
                lambda: module.get_function(name),
                lambda e: f"the uploaded library exports no function {name!r}",
            )
        if self.backend.name == "cpu":
            raise _Failure("unavailable", "get_function expects an uploaded Python module")
        raise _Failure("runtime", "get_function expects an uploaded module or library handle")

    def _run(self, instruction: Run) -> Any:
        fn_ref = instruction.fn
        if isinstance(fn_ref, BuiltinName):
            entry = self.engine.builtins.get(fn_ref.name)
            if entry is None:
                raise _Failure("runtime", f"unknown function: {fn_ref.name!r}")
            fn = entry[0]
        else:
            fn = self.handles.values[fn_ref.target]
            if not callable(fn):
                raise _Failure("runtime", f"handle {fn_ref.target!r} is not callable")
        args = [
            self.handles.values[a.target] if isinstance(a, Ref) else a for a in instruction.args
        ]
        watch = None
        # cpu_only builtins (the compilers) manage the lease themselves; the
        # CUDA watch guards uploaded cpu_only functions.
        if self._is_cpu_only_run(instruction) and not isinstance(fn_ref, BuiltinName):
            make_watch = getattr(self.backend, "cpu_only_watch", None)
            if make_watch is not None:
                try:
                    watch = make_watch()
                except ExecutionError as e:
                    raise _user_failure(e) from None
                except Exception as e:
                    raise _Failure("unavailable", _describe(e), e) from None
        try:
            with watch if watch is not None else contextlib.nullcontext():
                return fn(*args)
        except Exception as e:
            raise _user_failure(e) from None

    def _return(self, instruction: Return) -> Any:
        if instruction.kind is None:
            assert instruction.value is not None
            value = self.handles.values[instruction.value.target]
            tensor_parts = self.backend.tensor_parts
            if self.lease.held and not self.later_needs[self.position + 1]:
                # The last GPU work of the program: copy its tensors to the
                # host under the lease, end the hold, then hash and encode.
                copies = _host_copies(value, tensor_parts)
                if copies is not None:
                    self._release()
                    tensor_parts = copies.get
            try:
                return encode_value(value, self.parts, tensor_parts)
            except SerializationError as e:
                raise _Failure("serialization", str(e), e) from None
            finally:
                # The parts are made: host memory the backend lent for them
                # (a GPU worker's staging buffer) may be reused.
                returned = getattr(self.backend, "returned", None)
                if returned is not None:
                    returned()
        kind = instruction.kind
        try:
            path = instruction.path
            if isinstance(path, Ref):
                path = self.handles.values[path.target]
                if not isinstance(path, str):
                    raise SerializationError(
                        f"the path handle holds {type(path).__name__}, not a string"
                    )
            path = normalize_path(path)  # type: ignore[arg-type]
            budget = Budget(self.request.max_response_bytes - self.parts.total_bytes)
            collect = collect_file if kind == "file" else collect_folder
            return collect(self.request.workspace, path, self.parts, budget)
        except (SerializationError, OSError, ValueError) as e:
            raise _Failure("serialization", f"cannot return {kind}: {_describe(e)}", e) from None
