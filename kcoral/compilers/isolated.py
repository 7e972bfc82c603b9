# -*- test-case-name: tests.integration.test_compile_cache_server -*-
"""
C{python -m kcoral.compilers.isolated}: one compile for the server's shared
compile cache, in a sandbox of its own where no uploaded code runs.

Reads C{{source, arch, options, backend, timeout}} as JSON on stdin and
answers on descriptor L{ANSWER_FD} (not stdout): one JSON line, C{{seconds,
size}} followed by the C{size} bytes of the image, or C{{kind, error}} when
the compile failed.  Stdout and stderr carry nothing the server trusts.

What the compile's descendants (nvcc, the host preprocessor, cicc, ptxas,
any shell among them) cannot do (issue 32, item 1):
 - write the answer: L{ANSWER_FD} is not inherited (nvcc gets fresh pipes
   and C{/dev/null}), and this process makes itself non-dumpable first, so
   C{/proc/PID/fd/N} cannot be opened by another process of the same user
   in the sandbox (no capabilities there);
 - choose the key: the server computes it from the request it sent
   (L{kcoral.server.workers.compiles}); the answer names no key.
They can still kill this process: the server then stores nothing.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from typing import Any

#: The descriptor the answer goes to (the server's C{childFDs}).
ANSWER_FD = 3

_PR_SET_DUMPABLE = 4


def protect() -> None:
    """
    Make this process non-dumpable (its C{/proc/PID/fd} closed to the
    compile's descendants) and L{ANSWER_FD} close-on-exec.

    @raise OSError: either failed.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, "prctl(PR_SET_DUMPABLE, 0): " + os.strerror(errno))
    os.set_inheritable(ANSWER_FD, False)


def run(request: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """Compile C{request}: the answer line's fields and the image."""
    from kcoral.compilers import compile_binary, configure_cache
    from kcoral.errors import ExecutionError

    configure_cache(None)
    source, arch = str(request["source"]), str(request["arch"])
    options = tuple(str(o) for o in request["options"])
    backend = str(request["backend"])
    started = time.monotonic()
    try:
        image = compile_binary(
            source, arch, options, float(request["timeout"]), backend=backend, cache_dir=None
        )
    except ExecutionError as e:
        return {"kind": e.kind, "error": str(e.message)}, b""
    return {"seconds": time.monotonic() - started, "size": len(image)}, image


def main() -> int:
    protect()
    answer = os.fdopen(ANSWER_FD, "wb")
    image = b""
    try:
        request = json.load(sys.stdin)
        fields, image = run(request)
    except Exception as e:
        fields = {"kind": "engine", "error": f"{type(e).__name__}: {e}"}
    answer.write(json.dumps(fields).encode() + b"\n" + image)
    answer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
