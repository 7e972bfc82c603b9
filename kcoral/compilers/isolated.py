# -*- test-case-name: tests.integration.test_compile_cache_server -*-
"""
C{python -m kcoral.compilers.isolated}: one compile for the server's shared
compile cache, in a sandbox of its own where no uploaded code runs.

Reads C{{source, arch, options, backend, timeout}} as JSON on stdin, writes
the image to C{image.bin} in its working directory and one JSON line on
stdout: C{{key, seconds}}, or C{{kind, error}} when the compile failed.  The
key is computed here, from the toolchain this process used.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from kcoral.compilers import compile_binary, configure_cache, get_backend
from kcoral.compilers.cache import cache_key
from kcoral.errors import ExecutionError


def run(request: dict[str, Any]) -> dict[str, Any]:
    """Compile C{request}; the answer line's fields."""
    configure_cache(None)
    source, arch = str(request["source"]), str(request["arch"])
    options = tuple(str(o) for o in request["options"])
    backend = str(request["backend"])
    started = time.monotonic()
    try:
        image = compile_binary(
            source, arch, options, float(request["timeout"]), backend=backend, cache_dir=None
        )
        impl = get_backend(backend)
    except ExecutionError as e:
        return {"kind": e.kind, "error": str(e.message)}
    seconds = time.monotonic() - started
    with open("image.bin", "wb") as f:
        f.write(image)
    return {"key": cache_key(source, arch, options, impl.name, impl.versions()), "seconds": seconds}


def main() -> int:
    try:
        request = json.load(sys.stdin)
        answer = run(request)
    except Exception as e:
        answer = {"kind": "engine", "error": f"{type(e).__name__}: {e}"}
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
