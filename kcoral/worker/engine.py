# -*- test-case-name: tests.unit.test_worker_engine -*-
"""
The engine: interprets one program inside a worker process.

L{Engine.run} takes an L{Execute} message with the blobs sent before it and
returns an L{Outcome} message (both from L{kcoral.wire.channel}).  It
follows protocol §6: instructions run in order in the request's workspace,
each handle binds the value its instruction produced, the first failure stops
the program, and completed returns survive a later failure.  Around every
instruction it places the GPU lease as spec/server.md §4.3 says, and it
announces each instruction to the parent before running it so that a crash
can be attributed.

Nothing here imports Twisted: the worker has no reactor.
"""

from __future__ import annotations

import builtins as _python_builtins
import contextlib
import gc
import hashlib
import importlib
import linecache
import os
import signal
import stat
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from kcoral.errors import KINDS, ExecutionError, GPUAccessViolation
from kcoral.wire.channel import (
    RETIRE_POISONED,
    RETIRE_REQUEST_LIMIT,
    ChannelMessage,
    Execute,
    Instruction,
    Outcome,
)
from kcoral.wire.errors import instruction_error, truncate_traceback
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
    file_node,
    numpy_tensor_parts,
)
from kcoral.worker import runtime
from kcoral.worker.builtins import CudaSource
from kcoral.worker.capture import Captured, OutputCapture

# ---------------------------------------------------------------------------
# Error objects


def _format_traceback(exc: BaseException) -> str:
    """The traceback of C{exc} without this module's frames."""
    frames = traceback.extract_tb(exc.__traceback__)
    kept = traceback.StackSummary.from_list([f for f in frames if f.filename != __file__])
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


# ---------------------------------------------------------------------------
# Value encoding (protocol §7)


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
# Paths, file uploads and file/folder returns


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@contextlib.contextmanager
def _open_parent(workspace: str, components: list[str], create: bool) -> Iterator[int]:
    """
    Yield a directory fd for C{components} below C{workspace}, opening each
    component without following symbolic links (and creating missing ones
    with mode 0700 when C{create}).
    """
    fd = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for component in components:
            if create:
                try:
                    os.mkdir(component, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass
            child = os.open(component, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def materialize_file(workspace: str, path: str, data: bytes) -> None:
    """Create C{path} (normalized) below C{workspace} exclusively, mode 0600."""
    *parents, name = path.split("/")
    with _open_parent(workspace, parents, create=True) as parent:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(name, flags, 0o600, dir_fd=parent)
        try:
            os.fchmod(fd, 0o600)
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
        finally:
            os.close(fd)


class _Budget:
    """Bytes that file and folder returns may still add to the response."""

    def __init__(self, remaining: int) -> None:
        self.remaining = remaining

    def take(self, count: int) -> None:
        if count > self.remaining:
            raise SerializationError("file return exceeds max_response_bytes binary budget")
        self.remaining -= count


def _read_regular(dir_fd: int, name: str, budget: _Budget) -> bytes:
    before = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if stat.S_ISLNK(before.st_mode):
        raise SerializationError(f"{name!r} is a symbolic link")
    if not stat.S_ISREG(before.st_mode):
        raise SerializationError(f"{name!r} is not a regular file")
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (before.st_dev, before.st_ino):
            raise SerializationError(f"{name!r} changed while it was read")
        budget.take(opened.st_size)
        chunks = []
        remaining = opened.st_size + 1
        while remaining > 0:
            chunk = os.read(fd, min(remaining, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
        data = b"".join(chunks)
        after = os.fstat(fd)
    finally:
        os.close(fd)
    if len(data) != opened.st_size or (after.st_size, after.st_mtime_ns) != (
        opened.st_size,
        opened.st_mtime_ns,
    ):
        raise SerializationError(f"{name!r} changed while it was read")
    return data


def _file_node(data: bytes, parts: PartCollector) -> dict[str, Any]:
    name, sha = parts.add(data)
    return file_node(name, sha, len(data))


def collect_file(
    workspace: str, path: str, parts: PartCollector, budget: _Budget
) -> dict[str, Any]:
    """Capture the regular file at C{path} (protocol §7.3)."""
    *parents, name = path.split("/")
    with _open_parent(workspace, parents, create=False) as parent:
        return _file_node(_read_regular(parent, name, budget), parts)


def collect_folder(
    workspace: str, path: str, parts: PartCollector, budget: _Budget
) -> dict[str, Any]:
    """Capture the folder at C{path}: every file and directory, no symlinks."""
    components = path.split("/")
    files: dict[str, bytes] = {}
    directories: list[str] = []
    seen: set[tuple[int, int]] = set()

    def walk(fd: int, prefix: str) -> None:
        info = os.fstat(fd)
        if (info.st_dev, info.st_ino) in seen:
            raise SerializationError(f"directory {prefix or '.'!r} was reached twice")
        seen.add((info.st_dev, info.st_ino))
        for entry in sorted(os.listdir(fd)):
            relative = f"{prefix}{entry}"
            mode = os.stat(entry, dir_fd=fd, follow_symlinks=False).st_mode
            if stat.S_ISDIR(mode):
                directories.append(relative)
                child = os.open(entry, _DIR_FLAGS, dir_fd=fd)
                try:
                    walk(child, relative + "/")
                finally:
                    os.close(child)
            elif stat.S_ISREG(mode):
                files[relative] = _read_regular(fd, entry, budget)
            elif stat.S_ISLNK(mode):
                raise SerializationError(f"{relative!r} is a symbolic link")
            else:
                raise SerializationError(f"{relative!r} is not a regular file or directory")

    with _open_parent(workspace, components, create=False) as root:
        walk(root, "")
    return {
        "type": "folder",
        "files": {key: _file_node(files[key], parts) for key in sorted(files)},
        "directories": sorted(directories),
    }


# ---------------------------------------------------------------------------
# Process state for reuse mode (spec/server.md §3.6)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _sandbox_processes() -> list[int] | None:
    """
    Inside a private PID namespace (bubblewrap), every process except the
    namespace's init and this worker: orphans re-parented to init included.
    C{None} when this worker does not run in its own PID namespace.
    """
    try:
        if os.readlink("/proc/self/ns/pid") == os.readlink("/proc/1/ns/pid"):
            with open("/proc/1/cmdline", "rb") as f:
                init = f.read().split(b"\0", 1)[0]
            if not init.endswith(b"bwrap"):
                return None
        else:
            return None
    except OSError:
        return None
    me = os.getpid()
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) not in (1, me)]


def _terminate(pids: list[int]) -> None:
    """SIGKILL C{pids} and reap those that are our children."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for pid in pids:
        try:
            os.waitpid(pid, 0)
        except OSError:
            pass  # not our child (re-parented to the sandbox's init)


def _proc_children(pid: int) -> list[int] | None:
    """Direct children of C{pid} from procfs, or C{None} where the kernel lacks the file."""
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found.extend(int(child) for child in f.read().split())
    except FileNotFoundError:
        return None
    except OSError:
        return []
    return found


def _descendants() -> list[int] | None:
    """All descendants of this process, read from procfs without a full scan."""
    result: list[int] = []
    pending = [os.getpid()]
    while pending:
        children = _proc_children(pending.pop())
        if children is None:
            return None
        result.extend(children)
        pending.extend(children)
    return result


def _child_processes() -> list[int]:
    sandboxed = _sandbox_processes()
    if sandboxed is not None:
        return sandboxed
    descendants = _descendants()
    if descendants is not None:
        return descendants
    try:
        import psutil
    except ImportError:
        pids = []
        me = str(os.getpid())
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me:
                pids.append(int(entry))
        return pids
    return [child.pid for child in psutil.Process().children(recursive=True)]


def _open_fds_under(root: str) -> list[str]:
    found = []
    try:
        entries = os.listdir("/proc/self/fd")
    except OSError:  # pragma: no cover - not Linux
        return []
    for entry in entries:
        try:
            target = os.readlink(f"/proc/self/fd/{entry}")
        except OSError:
            continue
        if _under(target, root):
            found.append(target)
    return found


@attrs.define
class ProcessState:
    """
    What a reused worker restores after each program: the environment,
    C{sys.path}, modules imported from the workspace; and the baseline that
    leftover threads are compared against.
    """

    environ: dict[str, str]
    path: list[str]
    modules: frozenset[str]
    threads: frozenset[int]

    @classmethod
    def snapshot(cls) -> ProcessState:
        return cls(
            environ=dict(os.environ),
            path=list(sys.path),
            modules=frozenset(sys.modules),
            threads=frozenset(t.ident or 0 for t in threading.enumerate()),
        )

    def leftovers(self, workspace: str, children: list[int] | None = None) -> list[str]:
        """
        Describe threads, child processes and open files the program left behind.

        @param children: the child processes already found, if the caller looked.
        """
        root = os.path.realpath(workspace)
        found = []
        threads = [t.name for t in threading.enumerate() if (t.ident or 0) not in self.threads]
        if threads:
            found.append(f"threads: {', '.join(threads)}")
        if children is None:
            children = _child_processes()
        if children:
            found.append(f"child processes: {children}")
        fds = _open_fds_under(root)
        if fds:
            found.append(f"open files: {fds}")
        return found

    def restore(self, workspace: str) -> None:
        """Put the environment, C{sys.path} and the module table back."""
        for name in list(os.environ):
            if name not in self.environ:
                del os.environ[name]
        for name, value in self.environ.items():
            if os.environ.get(name) != value:
                os.environ[name] = value
        sys.path[:] = self.path
        root = os.path.realpath(workspace)
        for name, module in list(sys.modules.items()):
            if name in self.modules:
                continue
            origin = getattr(module, "__file__", None)
            paths = list(getattr(module, "__path__", None) or [])
            if origin:
                paths.append(origin)
            if any(_under(os.path.realpath(p), root) for p in paths if isinstance(p, str)):
                del sys.modules[name]
        importlib.invalidate_caches()
        for key in [k for k in linecache.cache if k.startswith("<uploaded:")]:
            del linecache.cache[key]


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

    def __attrs_post_init__(self) -> None:
        runtime.install(self.backend, self.lease, self.builtins)

    def run(
        self,
        request: Execute,
        blobs: Mapping[str, bytes] | None = None,
        *,
        retiring: bool = False,
    ) -> Outcome:
        """
        Run one program and return its outcome.

        @param blobs: the blobs sent before C{request}, by digest.
        @param retiring: the worker will exit after this program (its request
            limit is reached), so it keeps the lease and skips the reuse checks.
        """
        state = ProcessState.snapshot()
        program = _parse(request.program, frozenset(self.builtins) | BUILTIN_NAMES)
        run = _ProgramRun(self, request, dict(blobs or {}), program)
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
        leftover_pids = _child_processes()
        if leftover_pids:
            # Background work must finish before a program returns: stop it,
            # and fail a program that otherwise completed (spec §6.3).
            _terminate(leftover_pids)
            retire = retire or RETIRE_REQUEST_LIMIT
            if run.error is None and run.last is not None:
                run.error = run._error(
                    run.last,
                    _Failure(
                        "runtime", "program left background processes running; they were terminated"
                    ),
                )
        outcome = run.outcome(captured)
        del run
        if retire is None and retiring:
            retire = RETIRE_REQUEST_LIMIT
        if retire is None:
            # The device is clean (cleanup ran under the lease): give the GPU
            # to the next worker now and restore host state off the lease.
            self.lease.release()
            leftovers = state.leftovers(request.workspace, children=leftover_pids)
            state.restore(request.workspace)
            gc.collect()
            if leftovers:
                print(
                    "kcoral worker: retiring, the program left " + "; ".join(leftovers),
                    file=sys.stderr,
                    flush=True,
                )
                retire = RETIRE_REQUEST_LIMIT
                # A retiring worker exits (destroys its context) under the lease.
                self.lease.acquire()
        return attrs.evolve(outcome, retire=retire)


class _ProgramRun:
    """The state of one program while it runs."""

    def __init__(
        self, engine: Engine, request: Execute, blobs: dict[str, bytes], program: Program
    ) -> None:
        self.engine = engine
        self.blobs = blobs
        self.backend = engine.backend
        self.lease = engine.lease
        self.request = request
        self.program = program
        self.handles = _Handles()
        self.parts = PartCollector()
        self.results: dict[str, Any] = {}
        self.error: dict[str, Any] | None = None
        self.last: Any = None

    # -- driving --------------------------------------------------------

    def execute(self) -> None:
        for instruction in self.program.instructions:
            self.last = instruction
            self.engine.send(Instruction(instruction.index))
            try:
                self._place(instruction)
                self._dispatch(instruction)
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
        """End-of-program cleanup under the lease; return a retire reason or C{None}."""
        retire = None
        try:
            self.lease.acquire()
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
            parts=tuple(self.parts.parts),
        )

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

    def _place(self, instruction: Any) -> None:
        if isinstance(instruction, Upload):
            if instruction.kind == "bytes":
                return
            if instruction.kind == "file":
                self._release()
                return
            self.lease.acquire()
        elif isinstance(instruction, Return) and instruction.kind is not None:
            self._release()
        elif isinstance(instruction, Run) and self._is_cpu_only_run(instruction):
            self._release()
        else:
            self.lease.acquire()

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
        elif isinstance(instruction, Run):
            self.handles.values[instruction.id] = self._run(instruction)
        elif isinstance(instruction, Return):
            mark = self.parts.mark()
            try:
                self.results[instruction.key] = self._return(instruction)
            except BaseException:
                self.parts.rewind(mark)
                raise
        else:  # pragma: no cover - the parser admits nothing else
            raise _Failure("engine", f"unknown instruction {instruction!r}")

    def _blob(self, digest: str | None) -> bytes:
        try:
            return self.blobs[digest or ""]
        except KeyError:
            raise _Failure("engine", f"blob {digest} was not sent to the worker") from None

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
        return self._blob(instruction.blob)

    def _upload_library(self, instruction: Upload) -> Any:
        data = self._blob(instruction.blob)
        try:
            library = self.backend.load_library(data)
        except ExecutionError as e:
            raise _user_failure(e) from None
        except Exception as e:
            raise _Failure(
                "compile", f"cannot load the uploaded library: {_describe(e)}", e
            ) from None
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
            try:
                return module.get_function(name)
            except ExecutionError as e:
                raise _user_failure(e) from None
            except Exception as e:
                raise _Failure(
                    "compile", f"the uploaded library exports no function {name!r}", e
                ) from None
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
            try:
                return encode_value(value, self.parts, self.backend.tensor_parts)
            except SerializationError as e:
                raise _Failure("serialization", str(e), e) from None
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
            budget = _Budget(self.request.max_response_bytes - self.parts.total_bytes)
            collect = collect_file if kind == "file" else collect_folder
            return collect(self.request.workspace, path, self.parts, budget)
        except (SerializationError, OSError, ValueError) as e:
            raise _Failure("serialization", f"cannot return {kind}: {_describe(e)}", e) from None
