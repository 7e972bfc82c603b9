# -*- test-case-name: tests.unit.test_remote_compile -*-
"""
The worker's side of compiles done by the parent (issue 13, item 6).

In a sandbox the shared compile cache is read-only: an image other requests
load must not come from a process where uploaded code runs.  A cacheable
compile is sent to the parent as a L{CompileRequest}; the parent compiles it
in a sandbox of its own and writes the cache entry; L{RemoteCompiler} waits
for L{CompileDone} and hands back the key to read (the parent's: it
computes the key from the request, and answers at once when the entry is
already there).
"""

from __future__ import annotations

import os
import sys
from typing import IO

import attrs

from kcoral.compilers import COMPILE_IN_PARENT_ENV
from kcoral.errors import KINDS, ExecutionError
from kcoral.ipc.channel_io import read_message, write_message
from kcoral.wire.channel import (
    CompileDone,
    CompileRequest,
)

__all__ = ["COMPILE_IN_PARENT_ENV", "RemoteCompiler"]


@attrs.define
class RemoteCompiler:
    """
    C{compile(source, arch, flags, backend, timeout) -> (key, seconds,
    cached)} over the channel.
    """

    _inbox: IO[bytes]
    _outbox: IO[bytes]

    def __call__(
        self, source: str, arch: str, flags: tuple[str, ...], backend: str, timeout: float
    ) -> tuple[str, float, bool]:
        write_message(
            self._outbox,
            CompileRequest(source, arch, list(flags), backend, float(timeout)),
        )
        while True:
            message = read_message(self._inbox)
            if message is None:
                sys.stderr.write("kcoral worker: parent closed the channel during a compile\n")
                sys.stderr.flush()
                os._exit(1)
            if isinstance(message, CompileDone):
                break
        if message.error is not None or not message.key:
            kind = message.kind if message.kind in KINDS else "compile"
            raise ExecutionError(kind, message.error or "compile failed")
        return message.key, float(message.seconds), bool(message.cached)
