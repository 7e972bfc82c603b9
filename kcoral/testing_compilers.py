# -*- test-case-name: tests.unit.test_compilers -*-
"""
Test doubles for L{kcoral.compilers}.

L{FakeCompilerBackend} provides L{ICompilerBackend} without a toolchain:
C{compile} returns a deterministic image derived from its inputs, records
each call, and can be told to fail.
"""

from __future__ import annotations

import hashlib
import threading

import attrs
from twisted.plugin import IPlugin
from zope.interface import implementer

from kcoral.compilers.interfaces import KIND_BINARY, ICompilerBackend
from kcoral.compilers.nvcc import validate_arch, validate_options
from kcoral.errors import ExecutionError

__all__ = ["FAKE_MAGIC", "FakeCompilerBackend"]

#: First bytes of every image the fake produces.
FAKE_MAGIC = b"FAKECUBIN\0"


@implementer(IPlugin, ICompilerBackend)
@attrs.define(eq=False)
class FakeCompilerBackend:
    """
    A compiler that needs nothing.

    @ivar name: the backend's name.
    @ivar usable: what L{available} answers: C{(True, '')} by default.
    @ivar fail: raised by every C{compile} when set.
    @ivar calls: C{(source, arch, options, timeout)} of each C{compile}.
    """

    name: str = "fake"
    kind: str = KIND_BINARY
    usable: tuple[bool, str] = (True, "")
    fail: ExecutionError | None = None
    version: str = "1.0"
    calls: list[tuple[str, str, tuple[str, ...], float]] = attrs.field(factory=list)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)

    def available(self) -> tuple[bool, str]:
        return self.usable

    def versions(self) -> dict[str, str]:
        return {self.name: self.version} if self.usable[0] else {}

    def compile(self, source: str, arch: str, options: tuple[str, ...], timeout: float) -> bytes:
        with self._lock:
            self.calls.append((source, arch, tuple(options), timeout))
        validate_arch(arch)
        args, _ = validate_options(options)
        if not self.usable[0]:
            raise ExecutionError("unavailable", self.usable[1])
        if self.fail is not None:
            raise self.fail
        digest = hashlib.sha256(repr((source, arch, args)).encode()).digest()
        return FAKE_MAGIC + arch.encode("ascii") + b"\0" + digest
