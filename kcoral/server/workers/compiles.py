# -*- test-case-name: tests.unit.test_compiles,tests.integration.test_compile_cache_server -*-
"""
Compiles for the shared compile cache, run by the parent (issue 13, item 6).

Images in the shared cache are loaded by other requests, so none may come
from a process where uploaded code runs.  A sandboxed worker sends its
cacheable compiles here (L{kcoral.wire.channel.CompileRequest}); each runs
in a fresh bubblewrap sandbox of its own (no uploaded code, the worker's
read-only mounts, a seccomp filter), and the parent, not the worker, writes
the entry.  An nvcc compile is nvcc's command line alone in
L{BubblewrapSandbox.compile_command}'s sandbox (no network namespace to
make, every C{socket} refused, no C{/proc}); other backends run
C{python -m kcoral.compilers.isolated} in L{BubblewrapSandbox.run_command}'s.

What the parent trusts (issue 32, item 1):
 - the key is computed here, from the request the worker sent and this
   server's toolchain versions (L{compile_key}); the compile's answer names
   no key, so nothing that runs inside a compile can store an image under
   another request's key;
 - the request is checked here first (backend, arch, flags:
   L{kcoral.compilers.nvcc.validate_options} for the nvcc family, no C{-I});
 - the answer (a JSON line and the image's bytes) comes on a descriptor of
   its own that the compile's descendants cannot write
   (L{kcoral.compilers.isolated}); stdout and stderr are only diagnostics.

Each entry carries the image's sha256, which every read checks.  A request
whose entry is already there is answered without a compile.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IReactorProcess
from twisted.logger import Logger
from twisted.python.failure import Failure

from kcoral.compilers.cache import CompileCache, cache_key
from kcoral.compilers.interfaces import ICommandLineBackend
from kcoral.compilers.isolated import ANSWER_FD
from kcoral.errors import ExecutionError
from kcoral.server.sandbox.bubblewrap import SECCOMP_FD
from kcoral.server.sandbox.collect import Sink, start_bounded
from kcoral.server.sandbox.seats import remove_seat
from kcoral.server.workers.reactor import shielded
from kcoral.wire.channel import CompileDone, CompileRequest

if TYPE_CHECKING:
    from kcoral.server.sandbox.bubblewrap import BubblewrapSandbox

#: Largest image taken from a compile (a cubin is kilobytes to a few MiB).
MAX_IMAGE_BYTES = 256 * 1024 * 1024

#: Bytes of a compile's stdout and stderr kept (diagnostics only).
OUTPUT_BYTES = 64 * 1024

#: Largest answer line before the image.
ANSWER_LINE_BYTES = 64 * 1024

#: Seconds a compile may run past its own timeout before it is killed.
GRACE_SECONDS = 10.0

#: Backends whose flags follow nvcc's policy (checked here before a compile).
NVCC_FAMILY = frozenset({"nvcc", "tvmffi", "sourcemodule"})


def check_request(request: CompileRequest) -> None:
    """
    BLOCKING (C{-I} checks aside, a few regular expressions): refuse what the
    compile would refuse, before a sandbox starts.

    @raise ExecutionError: C{parse} for a bad arch or flag, or any C{-I}
        (included headers are not in the key, so such compiles are never
        cached).
    """
    from kcoral.compilers.nvcc import validate_arch, validate_options

    validate_arch(request.arch)
    for flag in request.options:
        if flag.startswith(("-I", "--include-path")):
            raise ExecutionError("parse", "compiles with -I flags are not cached")
    if request.backend in NVCC_FAMILY:
        validate_options(request.options, workspace="/nonexistent")


def compile_key(request: CompileRequest, backend: Any) -> str:
    """
    BLOCKING (the toolchain probe, once per toolchain): the cache key of
    C{request}, from what the worker asked for and this server's toolchain.
    """
    return cache_key(
        request.source,
        request.arch,
        tuple(request.options),
        backend.name,
        backend.versions(),
    )


def parse_answer(answer: bytes | bytearray) -> tuple[dict[str, Any], bytes] | None:
    """
    The answer line's fields and the image after it, or C{None} when the
    answer is malformed (no line, not a JSON object, a size that does not
    match the bytes that follow).
    """
    line, newline, rest = bytes(answer).partition(b"\n")
    if not newline or len(line) > ANSWER_LINE_BYTES:
        return None
    try:
        fields = json.loads(line)
    except ValueError:
        return None
    if not isinstance(fields, dict):
        return None
    if "kind" in fields:
        return fields, b""
    size, seconds = fields.get("size"), fields.get("seconds")
    if not isinstance(size, int) or size != len(rest) or size > MAX_IMAGE_BYTES:
        return None
    if not isinstance(seconds, (int, float)) or seconds < 0:
        return None
    return fields, rest


def _lookup_backend(name: str) -> Any:
    from kcoral.compilers import MissingBackend, get_backend

    try:
        return get_backend(name)
    except MissingBackend as e:
        raise ExecutionError("unavailable", str(e)) from None


@attrs.define(eq=False)
class IsolatedCompiles:
    """
    Runs L{CompileRequest}s in sandboxes of their own and fills the cache.

    @ivar lookup_backend: BLOCKING: a backend by name; raises
        L{ExecutionError} C{unavailable} when there is none.
    @ivar confirmed: the backends without a command line
        (L{ICommandLineBackend}) whose last sandboxed compile found them
        available: the server's compile-only programs use these, and learn
        it this way because checking here would load them into the server
        (L{compile_image}'s C{available}).
    """

    reactor: IReactorProcess
    sandbox: BubblewrapSandbox
    cache_dir: str
    scratch: Path
    run_blocking: Callable[..., Deferred[Any]]
    lookup_backend: Callable[[str], Any] = _lookup_backend
    _count: int = 0
    _cache: CompileCache | None = attrs.field(default=None, init=False)
    confirmed: set[str] = attrs.field(factory=set, init=False)

    log = Logger()

    async def compile(self, request: CompileRequest, timeout: float) -> CompileDone:
        """Compile C{request} within C{timeout} seconds; never raises."""
        done, _ = await self.compile_image(request, timeout)
        return done

    async def compile_image(
        self, request: CompileRequest, timeout: float, *, available: bool = False
    ) -> tuple[CompileDone, bytes | None]:
        """
        As L{compile}, and the image when there is one (read back from the
        cache, its sha256 checked).  Cancelling it kills the compile's
        sandbox (the wait fails with C{CancelledError} at once; its seat is
        removed once it has ended).

        @param available: check first, as a worker does before it sends a
            request (L{kcoral.compilers.compile_binary}), that the backend
            is available: an L{ICommandLineBackend}'s own C{available()},
            else whether it is L{confirmed}; a C{unavailable} answer if not.
        """
        try:
            return await self._compile(request, timeout, available)
        except CancelledError:
            raise
        except ExecutionError as e:
            return CompileDone(kind=e.kind, error=e.message), None
        except Exception as e:
            self.log.failure("compile for the shared cache failed", Failure())
            return CompileDone(kind="engine", error=f"{type(e).__name__}: {e}"), None

    def _prepare(
        self, request: CompileRequest, available: bool = False, confirmed: bool = False
    ) -> tuple[Any, str, tuple[bytes, float] | None]:
        """
        BLOCKING: check C{request} (its backend's availability first when
        C{available}); its backend, its key and the entry already stored.
        """
        backend = None
        if available:
            backend = self.lookup_backend(request.backend)
            _check_available(backend, confirmed)
        check_request(request)
        # (Not backend.available() otherwise: for PyCUDA that would load the
        # CUDA driver library into the server; the compile itself says so.)
        if backend is None:
            backend = self.lookup_backend(request.backend)
        if self._cache is None:
            self._cache = CompileCache(self.cache_dir)
        key = compile_key(request, backend)
        entry = self._cache.read(key)
        if entry is not None:
            self._cache.touch(key)  # (workers' reads cannot: the cache is read-only there)
        return backend, key, entry

    async def _compile(
        self, request: CompileRequest, timeout: float, available: bool
    ) -> tuple[CompileDone, bytes | None]:
        confirmed = request.backend in self.confirmed
        backend, key, entry = await self.run_blocking(self._prepare, request, available, confirmed)
        if entry is not None:
            return CompileDone(key=key, seconds=entry[1], cached=True), entry[0]
        if ICommandLineBackend.providedBy(backend):
            return await self._run_command(request, backend, key, timeout)
        return await self._run_isolated(request, key, timeout)

    def _seat(self) -> Path:
        self._count += 1
        return self.scratch / f"compile-{self._count}"

    async def _made_seat(self, seat: Path, make: Callable[..., Any], *args: Any) -> Any:
        """
        C{make(*args)} in a thread: it makes C{seat} (and removes it if it
        fails).  If the wait is cancelled, the seat is removed once made.
        """
        making = self.run_blocking(make, *args)
        try:
            return await shielded(making)
        except CancelledError:
            making.addCallbacks(lambda _: self._remove_later(seat), lambda _: None)
            raise

    async def _run_command(
        self, request: CompileRequest, backend: Any, key: str, timeout: float
    ) -> tuple[CompileDone, bytes | None]:
        """
        Run the backend's command line itself in a fresh compile sandbox
        (L{BubblewrapSandbox.compile_command}): no Python and no answer
        descriptor there; the outcome is the exit status the kernel reports
        and the file the command wrote in its workspace.
        """
        seat = self._seat()
        work, inside, argv, env = await self._made_seat(
            seat, self._command_seat, seat, request, backend
        )
        # What uses the seat until it is done: it is removed after that.
        using: Deferred[Any] | None = None
        try:
            # bwrap reads its filter from SECCOMP_FD: mapped there from a
            # descriptor of the filter opened for this compile alone (a
            # shared one would share its offset), with no shell to open it.
            filter_path = self.sandbox.compile_filter
            executable, args, bwrap_env = self.sandbox.compile_command(
                argv, work, env, filter_fd=filter_path is not None
            )
            fds = {}
            if filter_path is not None:
                fds[SECCOMP_FD] = os.open(filter_path, os.O_RDONLY | os.O_CLOEXEC)
            started = time.monotonic()
            try:
                running = start_bounded(
                    self.reactor,
                    executable,
                    args,
                    env=bwrap_env,
                    sinks={"output": Sink((1, 2), OUTPUT_BYTES)},
                    timeout=timeout,
                    fds=fds,
                )
            finally:
                for fd in fds.values():
                    os.close(fd)
            using = running.finished
            finished = await running.wait()
            seconds = time.monotonic() - started
            text = finished.output["output"].decode("utf-8", "replace")
            text = text.replace(inside + "/", "").replace(inside, ".")
            if finished.timed_out:
                return CompileDone(kind="compile", error=f"nvcc timed out after {timeout:g}s"), None
            if finished.exit_code != 0:
                from kcoral.compilers.nvcc import shorten

                error = f"nvcc failed for {request.arch} (exit status {finished.exit_code}):\n" + (
                    shorten(text) or "(no diagnostics)"
                )
                return CompileDone(kind="compile", error=error), None
            using = self.run_blocking(_store_output, self.cache_dir, key, work / _OUTPUT, seconds)
            image = await shielded(using)
            if image is None:
                return CompileDone(
                    kind="compile", error="nvcc succeeded but wrote no module image"
                ), None
            return CompileDone(key=key, seconds=seconds), image
        finally:
            self._remove_after(seat, using)

    def _remove_after(self, seat: Path, using: Deferred[Any] | None) -> None:
        """Remove C{seat} now, or once C{using} (its process, a thread's job) is done."""
        if using is None or using.called:
            self._remove_later(seat)
            return

        def done(result: object) -> None:
            # Only a wait that was cancelled leaves C{using} running.
            if isinstance(result, Failure):
                self.log.failure("a compile's step failed after its wait ended", result)
            self._remove_later(seat)

        using.addBoth(done)

    def _remove_later(self, seat: Path) -> None:
        """
        Remove C{seat} in a thread, without holding the answer for it: it
        is this compile's alone, and on a filesystem with online discard
        each C{rmdir} can take milliseconds.
        """
        removed = self.run_blocking(remove_seat, seat)
        removed.addErrback(
            lambda failure: self.log.failure(
                "could not remove the compile seat {seat}", failure, seat=str(seat)
            )
        )

    def _command_seat(
        self, seat: Path, request: CompileRequest, backend: Any
    ) -> tuple[Path, str, list[str], dict[str, str]]:
        """BLOCKING: a fresh seat holding the source, and the command for it."""
        work = Path(self.sandbox.prepare_compile_seat(seat))
        try:
            inside = self.sandbox.worker_path(work)
            argv, env = backend.command(
                f"{inside}/{_SOURCE}",
                f"{inside}/{_OUTPUT}",
                request.arch,
                tuple(request.options),
                inside,
            )
            with open(work / _SOURCE, "x", encoding="utf-8") as f:
                f.write(request.source)
        except BaseException:
            remove_seat(seat)
            raise
        return work, inside, argv, env

    async def _run_isolated(
        self, request: CompileRequest, key: str, timeout: float
    ) -> tuple[CompileDone, bytes | None]:
        """Run C{python -m kcoral.compilers.isolated} in a fresh sandbox (any backend)."""
        seat = self._seat()
        work = await self._made_seat(seat, self.sandbox.prepare_seat, seat)
        using: Deferred[Any] | None = None
        try:
            executable, argv, env = self.sandbox.run_command(
                [sys.executable, "-m", "kcoral.compilers.isolated"], work
            )
            request_bytes = json.dumps(
                {
                    "source": request.source,
                    "arch": request.arch,
                    "options": list(request.options),
                    "backend": request.backend,
                    "timeout": timeout,
                }
            ).encode()
            running = start_bounded(
                self.reactor,
                executable,
                argv,
                env=env,
                sinks={
                    "answer": Sink((ANSWER_FD,), MAX_IMAGE_BYTES + ANSWER_LINE_BYTES),
                    "err": Sink((1, 2), OUTPUT_BYTES),
                },
                timeout=timeout + GRACE_SECONDS,
                stdin=request_bytes,
            )
            using = running.finished
            finished = await running.wait()
            answer = finished.output["answer"]
            parsed = None if "answer" in finished.overflowed else parse_answer(answer)
            if parsed is None:
                tail = bytes(finished.output["err"][-2048:]).decode("utf-8", "replace")
                return CompileDone(
                    kind="compile", error=f"the compile did not finish: {tail}"
                ), None
            fields, image = parsed
            if fields.get("kind") == "unavailable":
                self.confirmed.discard(request.backend)
            else:
                self.confirmed.add(request.backend)
            if "kind" in fields:
                return CompileDone(
                    kind=str(fields.get("kind") or "compile"), error=str(fields.get("error"))
                ), None
            seconds = float(fields["seconds"])
            using = self.run_blocking(_store, self.cache_dir, key, image, seconds)
            stored = await shielded(using)
            if stored is None:
                return CompileDone(
                    kind="engine", error="the compiled image could not be stored"
                ), None
            return CompileDone(key=key, seconds=seconds), stored
        finally:
            self._remove_after(seat, using)


def _check_available(backend: Any, confirmed: bool) -> None:
    """
    BLOCKING (an L{ICommandLineBackend}'s C{available()}: a look for its
    toolchain): raise C{unavailable} unless C{backend} is available, with
    the message L{kcoral.compilers.compile_binary} gives.  Any other
    backend counts as available when C{confirmed}.
    """
    command_line = ICommandLineBackend.providedBy(backend)
    if command_line:
        ok, reason = backend.available()
    else:
        ok, reason = confirmed, "no compile in a sandbox has found it available yet"
    if not ok:
        raise ExecutionError(
            "unavailable", f"compiler backend {backend.name!r} is unavailable: {reason}"
        )


#: The source and image names in a command compile's workspace.
_SOURCE = "kernel.cu"
_OUTPUT = "module.bin"


def read_output(path: Path) -> bytes | None:
    """
    BLOCKING: the image a command wrote at C{path}, or C{None} unless it is
    a regular file of at most L{MAX_IMAGE_BYTES} (a symbolic link, a FIFO
    or a device the compile left there is not followed or read).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_IMAGE_BYTES:
            return None
        image = f.read(MAX_IMAGE_BYTES + 1)
    return image if len(image) <= MAX_IMAGE_BYTES else None


def _store_output(cache_dir: str, key: str, path: Path, seconds: float) -> bytes | None:
    """
    BLOCKING: store the image a command wrote at C{path} under C{key}; the
    image as it reads back, or C{None}.
    """
    image = read_output(path)
    return None if image is None else _store(cache_dir, key, image, seconds)


def _store(cache_dir: str, key: str, image: bytes, seconds: float) -> bytes | None:
    """
    BLOCKING: put C{image} into the cache under C{key}; the image as it
    reads back (its sha256 checked), or C{None} when it does not.
    """
    cache = CompileCache(cache_dir)
    cache.put(key, image, seconds)
    entry = cache.read(key)
    return None if entry is None else entry[0]
