# -*- test-case-name: tests.integration.test_compile_cache_server -*-
"""
Compiles for the shared compile cache, run by the parent (issue 13, item 6).

Images in the shared cache are loaded by other requests, so none may come
from a process where uploaded code runs.  A sandboxed worker sends its
cacheable compiles here (L{kcoral.wire.channel.CompileRequest}); each runs
as C{python -m kcoral.compilers.isolated} in a fresh bubblewrap sandbox of
its own (no uploaded code, the worker's read-only mounts, the seccomp
filter), and the parent, not the worker, writes the entry, keyed by source,
options, architecture, backend and toolchain version and carrying the
image's sha256, which every read checks.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from kcoral.compilers.cache import CompileCache
from kcoral.wire.channel import CompileDone, CompileRequest

#: Largest image taken from a compile (a cubin is kilobytes to a few MiB).
MAX_IMAGE_BYTES = 256 * 1024 * 1024

#: Bytes of a compile's stdout and stderr kept (one JSON line; diagnostics).
OUTPUT_BYTES = 64 * 1024

#: Seconds a compile may run past its own timeout before it is killed.
GRACE_SECONDS = 10.0


class _Collect(ProcessProtocol):
    """Feed the request on stdin, keep bounded stdout and stderr, report the end."""

    def __init__(self, request: bytes) -> None:
        self._request = request
        self.out = bytearray()
        self.err = bytearray()
        self.ended: Deferred[None] = Deferred()

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.write(self._request)
        self.transport.closeStdin()

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        buffer = self.out if childFD == 1 else self.err
        if len(buffer) < OUTPUT_BYTES:
            buffer += data[: OUTPUT_BYTES - len(buffer)]

    def processEnded(self, reason: Failure) -> None:
        self.ended.callback(None)


@attrs.define(eq=False)
class IsolatedCompiles:
    """Runs L{CompileRequest}s in sandboxes of their own and fills the cache."""

    reactor: Any
    sandbox: Any
    cache_dir: str
    scratch: Path
    run_blocking: Callable[..., Deferred[Any]]
    _count: int = 0

    log = Logger()

    async def compile(self, request: CompileRequest, timeout: float) -> CompileDone:
        """Compile C{request} within C{timeout} seconds; never raises."""
        try:
            return await self._compile(request, timeout)
        except Exception as e:
            self.log.failure("compile for the shared cache failed", Failure())
            return CompileDone(kind="engine", error=f"{type(e).__name__}: {e}")

    async def _compile(self, request: CompileRequest, timeout: float) -> CompileDone:
        from kcoral.server.sandbox import remove_seat

        self._count += 1
        seat = self.scratch / f"compile-{self._count}"
        work = await self.run_blocking(self.sandbox.prepare_seat, seat)
        try:
            executable, argv, env = self.sandbox.run_command(
                [sys.executable, "-m", "kcoral.compilers.isolated"], work
            )
            protocol = _Collect(
                json.dumps(
                    {
                        "source": request.source,
                        "arch": request.arch,
                        "options": list(request.options),
                        "backend": request.backend,
                        "timeout": timeout,
                    }
                ).encode()
            )
            transport = self.reactor.spawnProcess(protocol, executable, argv, env=env)

            def kill() -> None:
                try:
                    transport.signalProcess("KILL")
                except ProcessExitedAlready:
                    pass

            timer = self.reactor.callLater(timeout + GRACE_SECONDS, kill)
            await protocol.ended
            if timer.active():
                timer.cancel()
            answer = _answer(bytes(protocol.out))
            if answer is None:
                tail = bytes(protocol.err[-2048:]).decode("utf-8", "replace")
                return CompileDone(kind="compile", error=f"the compile did not finish: {tail}")
            if "key" not in answer:
                return CompileDone(
                    kind=str(answer.get("kind") or "compile"), error=str(answer.get("error"))
                )
            key, seconds = str(answer["key"]), float(answer.get("seconds", 0.0))
            stored = await self.run_blocking(
                _store, self.cache_dir, key, os.path.join(work, "image.bin"), seconds
            )
            if not stored:
                return CompileDone(kind="engine", error="the compiled image could not be stored")
            return CompileDone(key=key, seconds=seconds)
        finally:
            await self.run_blocking(remove_seat, seat)


def _answer(out: bytes) -> dict[str, Any] | None:
    lines = out.decode("utf-8", "replace").strip().splitlines()
    if not lines:
        return None
    try:
        answer = json.loads(lines[-1])
    except ValueError:
        return None
    return answer if isinstance(answer, dict) else None


def _store(cache_dir: str, key: str, image_path: str, seconds: float) -> bool:
    """BLOCKING: put the image at C{image_path} into the cache under C{key}."""
    try:
        with open(image_path, "rb") as f:
            image = f.read(MAX_IMAGE_BYTES + 1)
    except OSError:
        return False
    if len(image) > MAX_IMAGE_BYTES:
        return False
    cache = CompileCache(cache_dir)
    try:
        cache._path(key)
    except ValueError:
        return False
    cache.put(key, image, seconds)
    return cache.read(key) is not None
