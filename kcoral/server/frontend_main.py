# -*- test-case-name: tests.integration.test_front_ends,tests.unit.test_topology -*-
"""
The process of a front end other than the first:
C{python -m kcoral.server.frontend_main SPEC}.

The first front end (L{kcoral.server.frontends.FrontEndsService}) writes
SPEC, a JSON file with the whole server's configuration, this front end's
place (its index and the lease broker's socket) and the endpoints to
listen on, and starts this module on it.  The process builds the same
root service as the first, placed by L{kcoral.server.topology}, and runs
it until SIGTERM (a graceful stop) or until the broker goes away.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kcoral.config import ServerConfig
from kcoral.server.topology import FrontEnd

__all__ = ["main", "read_spec"]


def read_spec(path: Path) -> tuple[ServerConfig, FrontEnd, list[str]]:
    """
    The whole server's configuration, this front end's place and the
    endpoints, from the SPEC file the first front end wrote.
    """
    spec: dict[str, Any] = json.loads(path.read_text())
    config = ServerConfig(**spec["config"])
    place = spec["front_end"]
    front_end = FrontEnd(index=place["index"], broker=place["broker"])
    return config, front_end, list(spec["endpoints"])


def main(argv: Sequence[str] | None = None) -> int:
    """Run one front end other than the first; the exit status (1: it failed to start)."""
    from twisted.internet import reactor
    from twisted.logger import globalLogBeginner

    from kcoral.server.service import makeService

    args = list(sys.argv[1:] if argv is None else argv)
    config, front_end, endpoints = read_spec(Path(args[0]))
    # kcoral's own console mirror writes its events; Twisted's go nowhere.
    globalLogBeginner.beginLoggingTo([], redirectStandardIO=False)
    root = makeService(config, endpoints, reactor=reactor, front_end=front_end)
    root.exit_status_on_failure = None
    # A front end that cannot start (the broker is gone, say) ends; the
    # first front end starts it again.
    root.ready.addErrback(lambda _: reactor.stop())  # type: ignore[attr-defined]
    # The supervisor stops this process with SIGTERM: a graceful stop.
    reactor.callWhenRunning(root.startService)  # type: ignore[attr-defined]
    reactor.addSystemEventTrigger("before", "shutdown", root.stopService)  # type: ignore[attr-defined]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's ^C is the supervisor's
    reactor.run()  # type: ignore[attr-defined]
    return 1 if root.start_failure else 0


if __name__ == "__main__":
    sys.exit(main())
